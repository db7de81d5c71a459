"""The C extensions; everything else is in pyproject.toml.

`maru.common._memcopy` (the page copies and maru64), `maru.client._busypoll` (the RPC client's
spin-wait), `maru.server._keyindex` (the registry's key index) and `maru.common._shmindex` (the
local index) are required: there is no pure-Python stand-in, so an install without a C compiler
or the Python headers stops at once with one line that says so (`BuildExt`).
"""

import os
import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import PlatformError

NEEDS_COMPILER = (
    "maru-kvcache needs a C compiler (gcc or clang) and the Python headers to build its extensions"
)


def missing_build_tool(compiler: object) -> str | None:
    """What of the build's tools is not there: the compiler's command (`CC` or Python's own)
    or Python.h; None when both are. (MSVC: its own check, which names what is missing.)"""
    command = getattr(compiler, "compiler_so", None)
    if command and shutil.which(command[0]) is None:
        return f"the compiler {command[0]!r} was not found"
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if command and not os.path.exists(header):
        return f"{header} was not found"
    return None


class BuildExt(build_ext):
    """build_ext that checks for the compiler and Python.h before the first compile, so that
    a machine without them gets one clear error instead of a compiler's traceback."""

    def build_extensions(self) -> None:
        missing = missing_build_tool(self.compiler)
        if missing is not None:
            raise PlatformError(
                f"{NEEDS_COMPILER}: {missing}. Install them (e.g. `apt install gcc "
                "python3-dev`, `dnf install gcc python3-devel`) and run the install again."
            )
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "maru.common._memcopy",
            ["src/maru/common/_memcopy.c"],
            depends=[
                "src/maru/common/int64_buffer.h",
                "src/maru/common/cacheflush.h",
                "src/maru/common/faultguard.h",
            ],
        ),
        Extension("maru.client._busypoll", ["src/maru/client/_busypoll.c"]),
        Extension(
            "maru.server._keyindex",
            ["src/maru/server/_keyindex.c"],
            depends=["src/maru/common/crc32.h"],
        ),
        Extension("maru.common._keys", ["src/maru/common/_keys.c"]),
        Extension("maru.common._freed", ["src/maru/common/_freed.c"]),
        Extension(
            "maru.common._shmindex",
            ["src/maru/common/_shmindex.c"],
            depends=[
                "src/maru/common/int64_buffer.h",
                "src/maru/common/cacheflush.h",
                "src/maru/common/faultguard.h",
            ],
        ),
    ],
)
