"""Only the optional C helper lives here; everything else is in pyproject.toml.

`maru._memcopy` is built by `pip install -e .` when a C compiler is present; without one the
install still succeeds (`optional=True`) and `maru.memcopy` copies with ctypes instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("maru._memcopy", ["src/maru/_memcopy.c"], optional=True),
    ]
)
