"""Only the optional C helpers live here; everything else is in pyproject.toml.

`maru._memcopy`, `maru._busypoll` and `maru._keyindex` are built by `pip install -e .` when a
C compiler is present; without one the install still succeeds (`optional=True`): `maru.memcopy`
copies with ctypes instead, RPC replies are awaited in poll() without spinning (`maru.rpc`),
and the server's key index is an OrderedDict (`maru.server.keyindex`).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("maru._memcopy", ["src/maru/_memcopy.c"], optional=True),
        Extension("maru._busypoll", ["src/maru/_busypoll.c"], optional=True),
        Extension("maru._keyindex", ["src/maru/_keyindex.c"], optional=True),
    ]
)
