"""Only the optional C helpers live here; everything else is in pyproject.toml.

`maru.client._memcopy`, `maru.client._busypoll`, `maru.server._keyindex` and
`maru.common._shmindex` are built by `pip install -e .` when a C compiler is present; without
one the install still succeeds (`optional=True`). Each sits behind one wrapper module with a
`COMPILED` flag and a fallback: `maru.client.memcopy` (ctypes copies), `maru.client.busypoll`
(replies awaited in poll() only), `maru.server.keyindex` (an OrderedDict key index) and
`maru.common.shmindex` (no local index: clients use the request path).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "maru.client._memcopy",
            ["src/maru/client/_memcopy.c"],
            depends=["src/maru/common/int64_buffer.h"],
            optional=True,
        ),
        Extension("maru.client._busypoll", ["src/maru/client/_busypoll.c"], optional=True),
        Extension("maru.server._keyindex", ["src/maru/server/_keyindex.c"], optional=True),
        Extension(
            "maru.common._shmindex",
            ["src/maru/common/_shmindex.c"],
            depends=["src/maru/common/int64_buffer.h"],
            optional=True,
        ),
    ]
)
