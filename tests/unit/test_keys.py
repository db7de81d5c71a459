"""The C key passes (`maru.common._keys`) against the Python rules they stand in for:
`fit` says True only for batches `check_key` accepts whole, and `join` makes exactly what
`prefix + key` makes, or leaves the batch to Python (None)."""

from __future__ import annotations

import random

import pytest

from maru.client.localindex import joined
from maru.common import _keys
from maru.common.protocol import MAX_KEY_CHARS, ProtocolError, all_keys_valid, check_key


def python_valid(keys) -> bool:
    try:
        for key in keys:
            check_key(key)
    except ProtocolError:
        return False
    return True


def random_key(rng: random.Random):
    kind = rng.randrange(8)
    n = rng.choice([0, 1, 5, MAX_KEY_CHARS - 1, MAX_KEY_CHARS, MAX_KEY_CHARS + 1, 300, 1025])
    if kind < 3:
        return "k" * n
    if kind < 5:
        return b"k" * n
    if kind == 5:
        return "ключ" * (n // 4 + 1)  # wide characters: longer encoded than counted
    return rng.choice([None, 7, 1.5, bytearray(b"k"), ("k",)])


@pytest.mark.parametrize("seed", range(4))
def test_fit_never_passes_a_batch_the_key_rules_refuse(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        keys = [random_key(rng) for _ in range(rng.randrange(0, 6))]
        if _keys.fit(keys, MAX_KEY_CHARS):
            assert python_valid(keys), keys
        assert all_keys_valid(keys) == python_valid(keys), keys


def test_fit_passes_the_usual_batch_and_takes_any_sequence() -> None:
    keys = [f"model/{i:064x}" for i in range(256)] + [b"bytes-key"]
    assert _keys.fit(keys, MAX_KEY_CHARS) is True
    assert _keys.fit(tuple(keys), MAX_KEY_CHARS) is True
    assert _keys.fit([], MAX_KEY_CHARS) is True
    assert _keys.fit(["ok", ""], MAX_KEY_CHARS) is False
    assert _keys.fit(["ab"], 1) is False
    with pytest.raises(TypeError):
        _keys.fit(5, MAX_KEY_CHARS)


def test_join_makes_what_python_makes_or_leaves_the_batch_to_python() -> None:
    keys = [f"{i:064x}" for i in range(300)] + ["ключ", "\U0001f511"]
    assert _keys.join("ns:", keys) == ["ns:" + k for k in keys]
    assert _keys.join("ключ:", ["a"]) == ["ключ:a"]
    assert _keys.join(b"ns:", [b"a", b""]) == [b"ns:a", b"ns:"]
    assert _keys.join("ns:", []) == []
    assert _keys.join("ns:", ["a", b"b"]) is None  # a mix: Python raises, as it always did
    assert _keys.join(b"ns:", ["a"]) is None
    assert _keys.join(["ns:"], ["a"]) is None
    with pytest.raises(TypeError):
        joined(["a", b"b"], "ns:")
    assert joined(["a", "b"], "ns:") == ["ns:a", "ns:b"]
    assert joined(["a"], "") == ["a"]
