"""SGLang integration: `maru_sglang.maru_storage.MaruStorage` is the HiCache L3 backend."""
