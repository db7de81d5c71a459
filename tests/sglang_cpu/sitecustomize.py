"""CPU shims that let the real SGLang 0.5.23 run on a CPU-only torch (tests only).

Put this directory on ``PYTHONPATH`` and Python imports this file at start-up in every process,
including the scheduler / tokenizer / detokenizer subprocesses of ``sglang.launch_server``.
In-process, ``sglang_cpu.apply()`` installs the same hooks.

Nothing is imported eagerly: a meta-path finder runs each patch only when the module it concerns
is imported (or right away if it already is), so unrelated Python processes pay nothing.

What each shim replaces (all of it is CUDA-only in SGLang / its wheels):

* ``torchvision::nms`` / ``torchvision::qnms`` op schemas -- normally registered by
  torchvision's compiled ``_C`` extension. The torchvision 0.28.0 wheel is a CUDA build whose
  ``_C`` does not load against torch 2.13.0+cpu, and ``torchvision/_meta_registrations.py`` then
  fails with ``operator torchvision::nms does not exist``. ``import sglang`` reaches torchvision
  through transformers. Schema only: calling the ops still fails.
* ``sgl_kernel`` -- SGLang's compiled kernel package. The CPU build is not on PyPI (the PyPI
  wheels are CUDA-only); with ``SGLANG_USE_CPU_ENGINE=1`` SGLang still imports names from it.
  A stand-in is provided ONLY if no real ``sgl_kernel`` is importable; each attribute is a
  function that raises when called (none is called with the ``torch_native`` attention backend).
  On CPU its submodules stay missing (SGLang's ``except ImportError`` fallbacks run); on a GPU
  host without the wheel (scripts/gpu_host_check.sh) SGLang imports some of them unguarded
  (``sgl_kernel.quantization`` in ``quantization/gguf.py``) and reads names of them at import
  (``scalar_types.uint4b8``), so there the submodules are stand-ins too and every name is a
  placeholder (``_Placeholder``) rather than a function that raises.
* ``pin_memory=True`` on HiCache host pools -- pinning goes through ``cudaHostRegister``
  (``_cuda_host_register``), which fails on CPU torch. Forced to ``False`` when CUDA is absent.
* ``sgl_kernel.kvcacheio`` ``direct`` transfer ops (``transfer_kv_direct``,
  ``transfer_kv_per_layer_direct_pf_lf``, ``transfer_kv_all_layer_direct_lf_pf``) -- imported by
  ``pool_host/mha.py`` and ``pool_host/mla.py`` only on CUDA/HIP, so device<->host copies die
  with ``NameError`` on CPU. Plain torch index-copy versions are injected into those modules.
  Only ``--hicache-io-backend direct`` with ``layer_first`` / ``page_first_direct`` is covered.
* ``torch.cpu.Stream.synchronize`` / ``.query`` -- CUDA streams have them, ``torch.cpu.Stream``
  does not; ``mem_cache/l2_transfer.py`` calls ``synchronize`` on its error path. No-ops on CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_MARK = "_maru_sglang_cpu_shim"

# --------------------------------------------------------------------------------------------
# torchvision op schemas (replaces the schemas that torchvision's CUDA-built _C would register)
# --------------------------------------------------------------------------------------------
_torchvision_lib = None  # keep the Library alive: a collected FRAGMENT drops its schemas


def _register_torchvision_schemas() -> None:
    global _torchvision_lib
    if _torchvision_lib is not None:
        return
    import torch

    if torch.version.cuda is not None:
        return  # a CUDA build: torchvision's _C loads and defines them (twice would abort)

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue  # already defined (a working torchvision _C)
        except RuntimeError:
            pass
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_lib = lib


# --------------------------------------------------------------------------------------------
# sgl_kernel stand-in (replaces the CPU build of sgl-kernel, which is not on PyPI)
# --------------------------------------------------------------------------------------------
class _Placeholder:
    """A name of the GPU host's stand-in: any attribute or call of it is another placeholder
    (SGLang's modules read some at import: `scalar_types.uint4b8` in quantization/utils.py),
    and it is never a value anything computes with; the tests that run there check bytes."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        return _Placeholder(f"{self._qualname}()")

    def __mro_entries__(self, bases):
        return (object,)  # a class defined on one of them

    def __repr__(self) -> str:
        return f"<sgl_kernel test stand-in {self._qualname}>"


class _SglKernelStub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__}.{name}"
        if hasattr(self, "__path__"):  # the GPU host's stand-in (see _stub_submodules)
            return _Placeholder(qualname)

        def _unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"{qualname} is a CPU test stand-in (tests/sglang_cpu): the real sgl_kernel "
                "is not installed"
            )

        _unavailable.__name__ = name
        _unavailable.__qualname__ = qualname
        setattr(self, name, _unavailable)
        return _unavailable


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _SglKernelStub(spec.name)
        setattr(module, _MARK, True)
        if _stub_submodules():
            module.__path__ = []  # a package: `sgl_kernel.x` is found (by _ShimFinder)
        return module

    def exec_module(self, module) -> None:
        module.__version__ = "0.0.0+cpu-test-stub"


def _stub_submodules() -> bool:
    """Whether `sgl_kernel.*` submodules are stand-ins too: only where torch sees a GPU."""
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def _is_stub_submodule(fullname: str) -> bool:
    parent = sys.modules.get(fullname.rpartition(".")[0])
    return getattr(parent, _MARK, False) and hasattr(parent, "__path__")


# --------------------------------------------------------------------------------------------
# HiCache host pools: no pinning without CUDA (replaces cudaHostRegister-based pinning)
# --------------------------------------------------------------------------------------------
def _patch_host_pool_base(module) -> None:
    cls = module.HostKVCache
    init = cls.__init__
    if getattr(init, _MARK, False):
        return
    import functools

    import torch

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


# --------------------------------------------------------------------------------------------
# `direct` io transfer ops (replace sgl_kernel.kvcacheio's CUDA ops of the same names)
# Device buffers are per layer, [tokens, heads, dim]; page_first_direct host buffers are
# [pages, layers, page_size, heads, dim] (one per component: K and V, or the MLA latent).
# --------------------------------------------------------------------------------------------
def _idx(indices, device):
    import torch

    return indices.to(device=device, dtype=torch.long)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Token-indexed copy per layer: ``dst_layers[i][dst_indices] = src_layers[i][src_indices]``."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src.index_select(0, _idx(src_indices, src.device))
        dst.index_copy_(0, _idx(dst_indices, dst.device), rows.to(dst.device))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    """One layer, host page_first_direct -> device layer_first (a load)."""
    host_pages = _idx(src_indices[::page_size], src_ptrs[0].device) // page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        rows = src[host_pages, layer_id].reshape(-1, *dst.shape[1:])
        dst.index_copy_(0, _idx(dst_indices, dst.device), rows.to(dst.device))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """All layers, device layer_first -> host page_first_direct (a backup).

    ``src_ptrs`` holds every layer of component 0, then every layer of component 1 (K then V);
    ``dst_ptrs`` holds one host buffer per component.
    """
    num_layers = len(src_ptrs) // len(dst_ptrs)
    host_pages = _idx(dst_indices[::page_size], dst_ptrs[0].device) // page_size
    for c, dst in enumerate(dst_ptrs):
        for layer in range(num_layers):
            src = src_ptrs[c * num_layers + layer]
            rows = src.index_select(0, _idx(src_indices, src.device))
            dst[host_pages, layer] = rows.reshape(len(host_pages), page_size, *src.shape[1:]).to(
                dst.device
            )


_DIRECT_OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}


def _inject_direct_ops(module) -> None:
    # Only where the module did not bind them itself (i.e. not on CUDA/HIP/XPU).
    for name, fn in _DIRECT_OPS.items():
        if name not in module.__dict__:
            setattr(module, name, fn)


# --------------------------------------------------------------------------------------------
# torch.cpu.Stream.synchronize / query (CUDA streams have them; CPU streams are no-ops anyway)
# --------------------------------------------------------------------------------------------
def _patch_cpu_stream(_module=None) -> None:
    import torch

    stream_cls = torch.cpu.Stream
    if not hasattr(stream_cls, "synchronize"):
        stream_cls.synchronize = lambda self: None
    if not hasattr(stream_cls, "query"):
        stream_cls.query = lambda self: True


# --------------------------------------------------------------------------------------------
# Import hook
# --------------------------------------------------------------------------------------------
_PRE_IMPORT = {"torchvision": _register_torchvision_schemas}
_POST_IMPORT = {
    "sglang.srt.mem_cache.pool_host.base": _patch_host_pool_base,
    "sglang.srt.mem_cache.pool_host.mha": _inject_direct_ops,
    "sglang.srt.mem_cache.pool_host.mla": _inject_direct_ops,
    "sglang.srt.mem_cache.l2_transfer": _patch_cpu_stream,
    "sglang.srt.managers.cache_controller": _patch_cpu_stream,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... for tooling
        return getattr(self._loader, name)


class _ShimFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        setattr(self, _MARK, True)

    def _find_elsewhere(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _PRE_IMPORT:
            _PRE_IMPORT[fullname]()
            return None
        if fullname == "sgl_kernel":
            if self._find_elsewhere(fullname, path, target):
                return None  # a real sgl_kernel is installed: never shadow it
            # Top level only: submodules (sgl_kernel.scalar_type, .kvcacheio, ...) stay
            # missing, so SGLang's `except ImportError` fallbacks keep working.
            return importlib.machinery.ModuleSpec(fullname, _StubLoader())
        if fullname.startswith("sgl_kernel.") and _is_stub_submodule(fullname):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader())
        patch = _POST_IMPORT.get(fullname)
        if patch is None:
            return None
        spec = self._find_elsewhere(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Install the hook (idempotent) and patch whatever is already imported."""
    if not any(getattr(f, _MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, _ShimFinder())
    if "torchvision" not in sys.modules and "torch" in sys.modules:
        _register_torchvision_schemas()
    for name, patch in _POST_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)


install()
