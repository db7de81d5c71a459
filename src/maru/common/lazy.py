"""A package's public names, loaded on first use (a module `__getattr__`, PEP 562): importing
the package pulls in none of the modules behind them (numpy, the client) until a name is used."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], names: dict[str, Any]) -> Callable:
    """The `__getattr__` of `package`, whose `exports` map each public name to the module that
    defines it; a name, once loaded, is kept in `names` (the package's globals())."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = names[name] = getattr(import_module(module), name)
        return value

    return __getattr__
