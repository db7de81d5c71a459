"""The reference docs name everything they claim to: every maru-server flag, every MaruConfig
field and maru_* key, every `maru` subcommand, every exported metric."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from maru.client.cli import build_parser as maru_parser
from maru.common import protocol
from maru.common.config import MaruConfig
from maru.server.cli import build_parser as server_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text()


def test_every_server_flag_is_in_the_configuration_table():
    text = doc("configuration.md")
    flags = [
        opt
        for action in server_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]
    assert len(flags) >= 15
    missing = [f for f in flags if f"| `{f}` |" not in text]
    assert not missing, f"flags missing from docs/configuration.md: {missing}"


def test_every_config_field_and_extra_config_key_is_documented():
    text = doc("configuration.md")
    sglang = doc("sglang.md")
    for f in dataclasses.fields(MaruConfig):
        assert f"| `{f.name}` |" in text, f.name
        assert f"`maru_{f.name}`" in text, f.name
        assert f"`maru_{f.name}`" in sglang, f.name


def test_every_maru_subcommand_is_documented():
    text = doc("configuration.md")
    sub = next(a for a in maru_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"`maru {name}" in text, name


def test_every_message_type_has_a_section_in_the_protocol_table():
    text = doc("protocol.md")
    assert "(protocol.md)" in doc("architecture.md")  # the architecture points to it
    for t in protocol.MsgType:
        assert f"## {t.name} ({int(t)})" in text, t.name


def test_every_metric_is_in_the_operations_guide(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from maru.common.protocol import MsgType
    from maru.server.metrics import MaruCollector
    from maru.server.pool import ShmPool
    from maru.server.registry import Registry
    from maru.server.service import MaruService
    from maru.server.token import TokenSigner

    svc = MaruService(
        Registry(ShmPool(str(tmp_path / "pool"), 16 << 20), TokenSigner(b"s" * 32)),
        "tcp://127.0.0.1:0",
    )
    try:
        svc.handle_frame(protocol.encode(MsgType.HANDSHAKE, 1, {"iid": "A", "pid": 1}))
        reg = prometheus_client.CollectorRegistry(auto_describe=False)
        reg.register(MaruCollector(svc.stats))
        families = text_string_to_metric_families(prometheus_client.generate_latest(reg).decode())
        names = [f.name + ("_total" if f.type == "counter" else "") for f in families]
    finally:
        svc.close()
    text = doc("operations.md")
    documented = set(re.findall(r"`(maru_[a-z_]+)`", text))
    assert len(names) >= 40
    missing = [n for n in names if n not in documented]
    assert not missing, f"metrics missing from docs/operations.md: {missing}"


def test_performance_keeps_one_current_table_per_benchmark():
    """docs/performance.md: a targets table, then per benchmark script one section with its
    command, one dated table and how to read it; the run-by-run log lives outside the docs a user
    reads, in benchmarks/results/history.md."""
    text = doc("performance.md")
    benchmarks = sorted(p.name for p in (DOCS.parent / "benchmarks").glob("bench_*.py"))
    # about 30 lines a benchmark (and 60 for the targets), not a run log
    assert len(text.splitlines()) < 30 * (len(benchmarks) + 2)
    assert "## Targets" in text and "**Machine**" in text
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    for name in benchmarks:
        (section,) = [s for s in sections if f"benchmarks/{name}" in s.split("```")[0]]
        assert len(re.findall(r"^\*\*\d{4}-\d{2}-\d{2}\*\*", section, re.MULTILINE)) == 1, name
        assert "```bash" in section and name in section.split("```bash")[1], name
        assert "How to read it" in section, name
    history = (DOCS.parent / "benchmarks" / "results" / "history.md").read_text()
    assert "](../benchmarks/results/history.md)" in text and "### Session 1 figures" in history


def test_links_between_docs_point_at_files_and_headings_that_exist():
    def anchors(md: str) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", md, re.MULTILINE)
        return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in heads}

    for page in DOCS.glob("*.md"):
        for target, anchor in re.findall(r"\]\(([\w\-]+\.md)(?:#([\w\-]+))?\)", page.read_text()):
            assert (DOCS / target).exists(), f"{page.name} links to missing {target}"
            if anchor:
                assert anchor in anchors(doc(target)), f"{page.name} -> {target}#{anchor}"


def test_user_docs_cite_no_issue_or_session_numbers():
    """A user reads the docs, not the project's work log: no internal issue, session or #N
    numbers in README.md and docs/ (dated runs go to benchmarks/results/history.md)."""
    pattern = re.compile(r"\b(?:issues?|sessions?) \d+|(?<![\w&])#\d+\b", re.IGNORECASE)
    pages = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    hits = [f"{p.name}: {m.group()}" for p in pages for m in pattern.finditer(p.read_text())]
    assert not hits, hits
