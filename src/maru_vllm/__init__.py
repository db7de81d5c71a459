"""vLLM integration: `MaruKVConnector`, a v1 KV connector that shares KV blocks through Maru.

vLLM loads it with `"kv_connector": "MaruKVConnector", "kv_connector_module_path":
"maru_vllm"` in `--kv-transfer-config`; it needs `vllm` (docs/vllm.md)."""

from maru_vllm.connector import MaruConnectorMetadata, MaruKVConnector, MaruKVConnectorStats

__all__ = ["MaruConnectorMetadata", "MaruKVConnector", "MaruKVConnectorStats"]
