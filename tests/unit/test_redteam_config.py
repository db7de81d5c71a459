"""Red-team inputs to the one config parser (`maru.common.config`) that it used to take
silently, crash on or hang on, each now a `ConfigError` naming its key:

- a size string with a fraction of a byte ("1.9" read as 1 byte, where the float 1.9 was
  refused), a long byte count rounded through a float (2**62 + 1 read as 2**62, past the
  cap), "4iB" read as 4 bytes, digits of another script ("٤G");
- a CURVE key file that is binary (a UnicodeDecodeError, a traceback in `maru`), or a FIFO
  no one writes to (an open that never returned); a FIFO with a writer (`<(cat key)`) still
  works;
- `from_mapping` keys that are not strings (an AttributeError), a key `MARU_POOL_SIZE` or
  `Maru_pool_size` (silently ignored as SGLang's), and $MARU_EAGER_MAP's error, which was
  named `maru_MARU_EAGER_MAP`;
- an SGLang extra config that is not a JSON object (a list was taken apart by dict()).
"""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from maru.common.config import ConfigError, MaruConfig, parse_curve_key, parse_size

KEY = zmq.curve_keypair()[0].decode()  # 40 Z85 characters


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1.9", "0.5", "1.5B", "4096.25"])
def test_a_fraction_of_a_byte_is_refused_as_the_float_is(text):
    with pytest.raises(ConfigError, match="pool_size: a byte count must be whole"):
        parse_size(text, name="pool_size")


def test_a_fraction_with_a_unit_is_still_a_size():
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("1.3K") == 1331  # (the whole bytes of 1331.2)


def test_a_long_byte_count_is_read_exactly():
    assert parse_size("9007199254740993") == 2**53 + 1  # (a float made it 2**53)
    with pytest.raises(ConfigError, match="at most"):  # (a float made it 2**62: accepted)
        parse_size(str(2**62 + 1))


@pytest.mark.parametrize("text", ["4iB", "4i", "4ib", "\u0664G", "\u096a"])
def test_sizes_that_are_no_sizes_are_refused(text):
    with pytest.raises(ConfigError, match="expected a size like"):
        parse_size(text, name="pool_size")


# -- CURVE key files -------------------------------------------------------------------------


def test_a_binary_key_file_is_a_config_error_not_a_decode_error(tmp_path):
    path = tmp_path / "binary.key"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"server_public_key: .* holds no CURVE key"):
        parse_curve_key(str(path), name="server_public_key")
    with pytest.raises(ConfigError, match="server_public_key"):
        MaruConfig(server_public_key=str(path), auto_connect=False)


def test_a_huge_key_file_is_read_no_further_than_a_key_could_be(tmp_path):
    path = tmp_path / "huge.key"
    path.write_text("a" * (1 << 20))
    with pytest.raises(ConfigError, match="40 Z85 characters, got 4096"):
        parse_curve_key(str(path), name="k")


def _parse_in_thread(path: str) -> list:
    """parse_curve_key(path) on a thread: [result or exception], [] while it has not returned
    (the bound is a hang guard only)."""
    outcome: list = []

    def work() -> None:
        try:
            outcome.append(parse_curve_key(path, name="k"))
        except Exception as exc:  # (what it raised is checked by the caller)
            outcome.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(10)
    return outcome


def test_a_fifo_no_one_writes_to_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    outcome = _parse_in_thread(str(fifo))
    if not outcome:  # (unblock the stuck open, so the thread ends)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "parse_curve_key blocked opening a FIFO that no one writes to"
    assert isinstance(outcome[0], ConfigError) and "got 0" in str(outcome[0])


def test_a_fifo_with_a_writer_is_read(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)

    def writer() -> None:
        with open(fifo, "w") as f:  # (waits for the reader)
            f.write(KEY + "\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert _parse_in_thread(str(fifo)) == [KEY]
    thread.join(10)


# -- from_mapping ------------------------------------------------------------------------------


def test_keys_that_are_not_strings_are_no_crash():
    config = MaruConfig.from_mapping({5: "x", None: 1, "maru_auto_connect": False}, prefix="maru_")
    assert config.auto_connect is False  # (with the prefix they are not Maru's)
    with pytest.raises(ConfigError, match="5: unknown Maru option"):
        MaruConfig.from_mapping({5: "x"})


@pytest.mark.parametrize("key", ["MARU_POOL_SIZE", "Maru_pool_size", "MARU_pool_size"])
def test_a_maru_key_in_another_case_is_reported_not_ignored(key):
    with pytest.raises(ConfigError, match=f"{key}: unknown Maru option \\(did you mean "):
        MaruConfig.from_mapping({key: "4G", "maru_auto_connect": False}, prefix="maru_")


def test_an_environment_variable_is_named_as_it_is_set(monkeypatch):
    monkeypatch.setenv("MARU_EAGER_MAP", "maybe")
    with pytest.raises(ConfigError) as exc:
        MaruConfig.from_mapping({"maru_auto_connect": False}, prefix="maru_")
    assert str(exc.value).startswith("MARU_EAGER_MAP: expected a boolean")
    monkeypatch.delenv("MARU_EAGER_MAP")
    with pytest.raises(ConfigError) as exc:  # (a key's error still carries the prefix)
        MaruConfig.from_mapping({"maru_eager_map": "maybe"}, prefix="maru_")
    assert str(exc.value).startswith("maru_eager_map: expected a boolean")


@pytest.mark.parametrize("extra", [["maru_pool_size", "4G"], "maru_pool_size=4G"])
def test_an_sglang_extra_config_that_is_no_object_is_a_config_error(extra):
    sglang_cpu = pytest.importorskip("sglang_cpu")
    sglang_cpu.require()
    from maru_sglang.maru_storage import MaruStorage
    from sglang_cpu.host_pools import storage_config

    config = storage_config()
    config.extra_config = extra
    with pytest.raises(ConfigError, match="extra config: expected a JSON object"):
        MaruStorage(config, {})
