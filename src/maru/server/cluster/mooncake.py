"""Loading Mooncake Store's Python client. The CPU wheel's `store.so` links libibverbs and
libnl even for TCP; loading them by path first from where `scripts/install_mooncake_cpu.sh`
unpacks them (the dynamic linker then finds them by soname) spares maru-server and its tests
LD_LIBRARY_PATH where they are not installed system-wide.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# The libraries store.so needs, in the order their own links need them.
PRIVATE_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


class MooncakeMissing(RuntimeError):
    """Mooncake's client cannot be loaded here, with the reason and what installs it."""


def private_libs() -> Path:
    """Where the install script unpacks the libraries."""
    return Path(os.environ.get("MARU_MOONCAKE_LIBS") or Path(sys.prefix) / "mooncake-libs")


def load_mooncake() -> ModuleType:
    """`mooncake.store`, its libraries loaded first from `private_libs()` where present
    (`MooncakeMissing` with the reason when it cannot be loaded)."""
    folder = private_libs()
    for name in PRIVATE_LIBS:
        if (folder / name).exists():
            try:
                ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise MooncakeMissing(f"cannot load {folder / name}: {exc}") from exc
    try:
        import mooncake.store as store
    except ImportError as exc:
        raise MooncakeMissing(
            f"cannot import mooncake.store ({exc}): run scripts/install_mooncake_cpu.sh "
            "(the wheel mooncake-transfer-engine-non-cuda, and its libraries into "
            f"{folder})"
        ) from exc
    return store


def library_env() -> dict[str, str]:
    """This environment with `private_libs()` first on LD_LIBRARY_PATH, for the wheel's
    executables (`mooncake_master`), which cannot preload them."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(private_libs()), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return env


def master_binary() -> Path:
    """The `mooncake_master` executable the wheel ships beside its Python package."""
    try:
        import mooncake
    except ImportError as exc:
        raise MooncakeMissing(f"cannot import mooncake ({exc})") from exc
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(path, os.X_OK):
        raise MooncakeMissing(f"no executable mooncake_master at {path}")
    return path
