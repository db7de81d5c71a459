"""The registry's key index: key -> KeyEntry, oldest first (the order eviction walks).

`KeyIndex` is the C type from `maru._keyindex` (built by `pip install -e .` when a compiler
is present): its batch calls `get_many` and `setdefault_many` overlap the cache misses of a
batch's probes, which at 10^6 keys are most of a lookup's cost. Without the extension it is
`OrderedKeyIndex`, the same interface over an OrderedDict (correct, with one miss after
another). Both take only str and bytes keys; a lookup of anything else is a miss.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

log = logging.getLogger(__name__)

_KEY_TYPES = frozenset((str, bytes))


class OrderedKeyIndex(OrderedDict):
    """The pure-Python `KeyIndex` (and the model the C type is tested against)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(key) not in _KEY_TYPES:
            raise TypeError(f"KeyIndex keys are str or bytes, not {type(key).__name__}")
        super().__setitem__(key, value)

    def __contains__(self, key: object) -> bool:
        return type(key) in _KEY_TYPES and super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(key, default) if type(key) in _KEY_TYPES else default

    def pop(self, key: Any, *default: Any) -> Any:
        if type(key) not in _KEY_TYPES:
            if default:
                return default[0]
            raise KeyError(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if type(key) not in _KEY_TYPES:
            raise TypeError(f"KeyIndex keys are str or bytes, not {type(key).__name__}")
        return super().setdefault(key, default)

    def get_many(self, keys: Sequence[Any], default: Any = None) -> list[Any]:
        return list(map(self.get, keys, repeat(default)))

    def setdefault_many(self, keys: Sequence[Any], values: Sequence[Any]) -> list[Any]:
        if len(keys) != len(values):
            raise ValueError("setdefault_many: keys and values differ in length")
        if not set(map(type, keys)) <= _KEY_TYPES:
            raise TypeError("KeyIndex keys are str or bytes")
        return list(map(super().setdefault, keys, values))

    def keys(self, *, reverse: bool = False) -> Iterator[Any]:  # type: ignore[override]
        return reversed(self) if reverse else iter(self)

    def values(self, *, reverse: bool = False) -> Iterator[Any]:  # type: ignore[override]
        return reversed(super().values()) if reverse else iter(super().values())

    def items(self, *, reverse: bool = False) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        return reversed(super().items()) if reverse else iter(super().items())


try:
    from maru._keyindex import KeyIndex
except ImportError:  # built without a C compiler
    KeyIndex = OrderedKeyIndex  # type: ignore[misc,assignment]
    log.debug("maru._keyindex not built: the key index is an OrderedDict")

__all__ = ["KeyIndex", "OrderedKeyIndex"]
