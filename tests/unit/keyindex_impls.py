"""Run registry tests against both key index implementations: the C one (`maru.server._keyindex`,
what `pip install -e .` builds) and the pure-Python fallback (what a machine without a C
compiler runs). A test module opts in with

    from .keyindex_impls import key_index_impl  # noqa: F401  (an autouse fixture)
"""

from __future__ import annotations

import pytest

from maru.server import holds, keyindex, registry


def use_python_key_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registries created from now on keep OrderedKeyIndex / PyKeyEntry and the py_* batch
    helpers, as without the C extension."""
    monkeypatch.setattr(registry, "KeyIndex", keyindex.OrderedKeyIndex)
    monkeypatch.setattr(registry, "KeyEntry", keyindex.PyKeyEntry)
    monkeypatch.setattr(registry, "batch_fits", keyindex.py_batch_fits)
    monkeypatch.setattr(registry, "entry_locations", keyindex.py_entry_locations)
    monkeypatch.setattr(holds, "release_entries", keyindex.py_release_entries)


@pytest.fixture(autouse=True, params=["c", "python"])
def key_index_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c" and keyindex.KeyIndex is keyindex.OrderedKeyIndex:
        pytest.skip("maru.server._keyindex not built")
    if request.param == "python":
        use_python_key_index(monkeypatch)
    return request.param
