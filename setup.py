"""Only the optional C helpers live here; everything else is in pyproject.toml.

`maru._memcopy` and `maru._busypoll` are built by `pip install -e .` when a C compiler is
present; without one the install still succeeds (`optional=True`): `maru.memcopy` copies with
ctypes instead, and RPC replies are awaited in poll() without spinning (`maru.rpc`).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("maru._memcopy", ["src/maru/_memcopy.c"], optional=True),
        Extension("maru._busypoll", ["src/maru/_busypoll.c"], optional=True),
    ]
)
