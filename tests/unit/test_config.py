"""MaruConfig validation and the size/bool parsers: every error names the offending field."""

from __future__ import annotations

import pytest

from maru.common.config import ConfigError, MaruConfig, parse_bool, parse_int, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        (4096.0, 4096),
        ("4K", 4 << 10),
        ("4k", 4 << 10),
        ("4KiB", 4 << 10),
        ("4KB", 4 << 10),
        ("500M", 500 << 20),
        ("1MiB", 1 << 20),
        ("4G", 4 << 30),
        (" 2 G ", 2 << 30),
        ("1T", 1 << 40),
        ("1P", 1 << 50),
        ("1.5K", 1536),
        ("0.5G", 512 << 20),
        ("10B", 10),
    ],
)
def test_parse_size_accepts(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "abc", "4X", "-1", "-4G", "1e3", "4 G B", "G", "0", "0K", 0, -5, 1.5, True, None, [4]],
)
def test_parse_size_rejects_and_names_the_field(value):
    with pytest.raises(ConfigError, match=r"^my_field: "):
        parse_size(value, name="my_field")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (1, True), (0, False), ("yes", True), (" OFF ", False)],
)
def test_parse_bool(value, expected):
    assert parse_bool(value, name="flag") is expected


@pytest.mark.parametrize("value", ["maybe", 2, None, 1.0, ""])
def test_parse_bool_rejects(value):
    with pytest.raises(ConfigError, match=r"^flag: expected a boolean"):
        parse_bool(value, name="flag")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_ms", 10**13),
        ("timeout_ms", 1e13),
        ("busy_poll_us", 2**80),
        ("max_inflight", 2**40),
        ("pool_size", 2**80),
        ("pool_size", "9000000T"),
    ],
)
def test_values_past_what_the_handler_can_use_are_config_errors(field, value):
    """Before: accepted, then an OverflowError from the handler's constructor or store."""
    with pytest.raises(ConfigError, match=rf"^{field}: at most "):
        MaruConfig(**{field: value})


@pytest.mark.parametrize("value", [0, -1, "x", None, True, 1.5])
def test_parse_int_rejects(value):
    with pytest.raises(ConfigError, match=r"^timeout_ms: "):
        parse_int(value, name="timeout_ms")


def test_defaults_and_normalisation():
    cfg = MaruConfig(pool_size="64M", chunk_size_bytes="64K", timeout_ms="500", auto_expand="off")
    assert cfg.pool_size == 64 << 20
    assert cfg.chunk_size_bytes == 64 << 10
    assert cfg.timeout_ms == 500
    assert cfg.auto_expand is False
    # the first region: a sixteenth of the per-instance cap, at least 2 MiB, at most the cap
    assert cfg.region_expand_size == 4 << 20
    assert MaruConfig(pool_size="8M").region_expand_size == 2 << 20
    assert MaruConfig(pool_size="1M", chunk_size_bytes="64K").region_expand_size == 1 << 20
    assert MaruConfig(pool_size="64M", expand_size="8M").region_expand_size == 8 << 20
    # every config gets its own instance id
    assert MaruConfig().instance_id != MaruConfig().instance_id


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"server_url": 5555}, "server_url"),
        ({"server_url": "http://localhost:5555"}, "server_url"),
        ({"server_url": "tcp://localhost:70000"}, "server_url"),
        ({"server_url": "tcp://localhost"}, "server_url"),
        ({"server_url": "localhost"}, "server_url"),
        ({"pool_size": "1.5K"}, "pool_size"),  # smaller than the default 1 MiB chunk
        ({"instance_id": ""}, "instance_id"),
        ({"instance_id": "   "}, "instance_id"),
        ({"instance_id": "x" * 129}, "instance_id"),
        ({"pool_size": "lots"}, "pool_size"),
        ({"pool_size": 0}, "pool_size"),
        ({"chunk_size_bytes": 0}, "chunk_size_bytes"),
        ({"chunk_size_bytes": "2G", "pool_size": "1G"}, "chunk_size_bytes"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"max_inflight": -3}, "max_inflight"),
        ({"auto_connect": "perhaps"}, "auto_connect"),
        ({"use_async_rpc": 7}, "use_async_rpc"),
        ({"eager_map": None}, "eager_map"),
        ({"auto_expand": "sure"}, "auto_expand"),
        ({"expand_size": "-1"}, "expand_size"),
        ({"expand_size": "8M", "auto_expand": False}, "expand_size"),
        ({"expand_size": "64K", "chunk_size_bytes": "1M"}, "expand_size"),
        ({"busy_poll_us": -1}, "busy_poll_us"),
        ({"busy_poll_us": "soon"}, "busy_poll_us"),
        ({"local_socket": "maybe"}, "local_socket"),
        ({"copy_threads": 0}, "copy_threads"),
        ({"copy_threads": 17}, "copy_threads"),
        ({"copy_threads": "two"}, "copy_threads"),
    ],
)
def test_validation_error_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        MaruConfig(**kwargs)


def test_from_mapping_with_prefix():
    cfg = MaruConfig.from_mapping(
        {
            "maru_server_url": "tcp://10.0.0.1:6000",
            "maru_pool_size": "2G",
            "maru_auto_expand": "false",
            "backend_name": "maru",  # not ours: ignored
            "page_size": 64,
        },
        prefix="maru_",
    )
    assert cfg.server_url == "tcp://10.0.0.1:6000"
    assert cfg.pool_size == 2 << 30
    assert cfg.auto_expand is False


def test_busy_poll_zero_turns_spinning_off_and_strings_parse():
    assert MaruConfig().busy_poll_us == 200
    assert MaruConfig(busy_poll_us=0).busy_poll_us == 0
    cfg = MaruConfig.from_mapping({"maru_busy_poll_us": "50"}, prefix="maru_")
    assert cfg.busy_poll_us == 50


def test_copy_threads_default_two_and_strings_parse():
    assert MaruConfig().copy_threads == 2
    cfg = MaruConfig.from_mapping({"maru_copy_threads": "1"}, prefix="maru_")
    assert cfg.copy_threads == 1


def test_from_mapping_unknown_prefixed_key_is_an_error():
    with pytest.raises(ConfigError, match=r"^maru_pool_sise: unknown Maru option") as exc:
        MaruConfig.from_mapping({"maru_pool_sise": "1G"}, prefix="maru_")
    assert "maru_pool_size" in str(exc.value)  # the valid keys are listed


def test_from_mapping_error_carries_the_prefixed_name():
    with pytest.raises(ConfigError, match=r"^maru_chunk_size_bytes: must be positive"):
        MaruConfig.from_mapping({"maru_chunk_size_bytes": 0}, prefix="maru_")
    with pytest.raises(ConfigError, match=r"^timeout_ms: "):
        MaruConfig.from_mapping({"timeout_ms": "soon"})
    with pytest.raises(ConfigError, match=r"^bogus: unknown Maru option"):
        MaruConfig.from_mapping({"bogus": 1})


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("localhost:5555", "tcp://localhost:5555"),  # what the `maru` CLI accepts too
        (" tcp://10.0.0.1:6000 ", "tcp://10.0.0.1:6000"),
        ("[::1]:5555", "tcp://[::1]:5555"),
        ("ipc:///tmp/maru.sock", "ipc:///tmp/maru.sock"),
    ],
)
def test_server_url_host_port_is_tcp(url, expected):
    assert MaruConfig(server_url=url).server_url == expected


def test_unknown_keyword_is_a_config_error_naming_it_and_the_nearest_field():
    with pytest.raises(ConfigError, match=r"^poolsize: unknown Maru option") as exc:
        MaruConfig(poolsize="1G")
    assert "did you mean pool_size?" in str(exc.value)
    with pytest.raises(ConfigError, match=r"^maru_pool_sise: .*did you mean maru_pool_size\?"):
        MaruConfig.from_mapping({"maru_pool_sise": "1G"}, prefix="maru_")


def test_small_pool_size_with_default_chunk_blames_pool_size():
    with pytest.raises(ConfigError, match=r"^pool_size: 1536 bytes is smaller than one chunk"):
        MaruConfig(pool_size="1.5K")
    # an explicit chunk that does not fit is the chunk's fault
    with pytest.raises(ConfigError, match=r"^chunk_size_bytes: "):
        MaruConfig(pool_size="4M", chunk_size_bytes="8M")


@pytest.mark.parametrize(("asked", "chunk"), [(1, 4096), (5000, 8192), (7 * 4096, 7 * 4096)])
def test_any_positive_chunk_size_is_taken_and_aligned_to_pages(asked, chunk):
    """LMCache's MaruBackend passes its full KV chunk in bytes (layers x 2 x tokens x heads x
    head size x dtype), rarely a multiple of 4 KiB: the original takes any positive size."""
    assert MaruConfig(chunk_size_bytes=asked).chunk_size_bytes == chunk


@pytest.mark.parametrize(("raw", "expected"), [("0", False), ("off", False), ("1", True)])
def test_maru_eager_map_in_the_environment_overrides_the_config(monkeypatch, raw, expected):
    """The original's MARU_EAGER_MAP wins over what the caller passed."""
    monkeypatch.setenv("MARU_EAGER_MAP", raw)
    assert MaruConfig(eager_map=not expected).eager_map is expected


def test_a_bad_maru_eager_map_names_the_variable(monkeypatch):
    monkeypatch.setenv("MARU_EAGER_MAP", "perhaps")
    with pytest.raises(ConfigError, match=r"^MARU_EAGER_MAP: expected a boolean"):
        MaruConfig()


def test_pool_path_key_wins_over_maru_pool_path(monkeypatch):
    """Unset: the server's path (None); the variable where the key is not set; the key
    (and SGLang's maru_pool_path) over the variable."""
    monkeypatch.delenv("MARU_POOL_PATH", raising=False)
    assert MaruConfig().pool_path is None
    monkeypatch.setenv("MARU_POOL_PATH", "/mnt/cxl/pool")
    assert MaruConfig().pool_path == "/mnt/cxl/pool"
    assert MaruConfig(pool_path="/dev/dax1.0").pool_path == "/dev/dax1.0"
    extra = {"maru_pool_path": "/dev/dax2.0"}
    assert MaruConfig.from_mapping(extra, prefix="maru_").pool_path == "/dev/dax2.0"


@pytest.mark.parametrize("bad", ["", "relative/pool", 7])
def test_a_bad_pool_path_names_the_key_or_the_variable(monkeypatch, bad):
    monkeypatch.delenv("MARU_POOL_PATH", raising=False)
    with pytest.raises(ConfigError, match=r"^maru_pool_path: expected"):
        MaruConfig.from_mapping({"maru_pool_path": bad}, prefix="maru_")
    if isinstance(bad, str) and bad:
        monkeypatch.setenv("MARU_POOL_PATH", bad)
        with pytest.raises(ConfigError, match=r"^MARU_POOL_PATH: expected an absolute path"):
            MaruConfig()


def test_a_curve_key_is_taken_as_text_where_a_file_of_that_name_cannot_be_looked_up(
    monkeypatch,
):
    """A 40-character key whose name cannot be looked up as a file (here: a working directory
    the process may not search, as a client dropped to another uid inside root's 0700
    checkout; root itself searches anything, so the lookup's refusal is raised for it) is the
    key, not a PermissionError out of MaruConfig."""
    import zmq

    from maru.common.config import parse_curve_key

    public, _ = zmq.curve_keypair()
    key = public.decode()

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr("pathlib.Path.is_file", refused)
    assert parse_curve_key(key, name="server_public_key") == key
    with pytest.raises(ConfigError, match="neither a 40-character CURVE key"):
        parse_curve_key("x" * 39, name="server_public_key")
