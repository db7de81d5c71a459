"""The package runs on the oldest Python it declares (`requires-python`, 3.10), though the
tests run on 3.11: no source uses syntax newer than 3.10, and no module imports at run time a
`typing` name that 3.10 lacks (`Self` did: `from maru import MaruHandler` failed on 3.10).
Names for type checkers only belong under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "src").rglob("*.py"))
# `typing` names added in Python 3.11 and later
NEWER_TYPING = {
    "Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type",
    "TypeVarTuple", "Unpack", "Required", "NotRequired", "ReadOnly", "dataclass_transform",
    "get_overloads", "clear_overloads", "override", "TypeAliasType", "TypeIs",
    "get_protocol_members",
}  # fmt: skip


def test_the_declared_floor_is_3_10():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'^requires-python = "(.*)"$', pyproject, re.M) == [">=3.10"]


def test_no_source_uses_syntax_newer_than_3_10():
    for path in SOURCES:
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))


def _runtime_typing_imports(tree: ast.Module) -> set[str]:
    """`typing` names imported outside `if TYPE_CHECKING:` blocks."""
    names: set[str] = set()
    checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            checking.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "typing"
            and id(node) not in checking
        ):
            names.update(alias.name for alias in node.names)
        typing_attribute = isinstance(node, ast.Attribute) and (
            getattr(node.value, "id", None) == "typing"
        )
        if typing_attribute and id(node) not in checking:
            names.add(node.attr)
    return names


def test_no_module_imports_a_typing_name_newer_than_3_10_at_run_time():
    found = {
        str(path.relative_to(ROOT)): sorted(
            _runtime_typing_imports(ast.parse(path.read_text())) & NEWER_TYPING
        )
        for path in SOURCES
    }
    assert {path: names for path, names in found.items() if names} == {}
