"""The one parser of sizes, booleans, numeric flags and `maru_*` keys (`MaruConfig.from_mapping`):
a bad value gets the same error, naming its key, from the SGLang adapter, the CLI or a test."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn

from maru.common.curve import is_key

# ASCII digits, a unit (K, KB, KiB, ...) or B: "4iB" or "4" in another script is no size
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])i?B?|B)?\s*$", re.IGNORECASE | re.ASCII)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DEFAULT_CHUNK = 1 << 20
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the offending key."""


def fmt_bytes(n: float) -> str:
    """Binary units: 512 B, 1.5 KiB, 4.0 GiB (what `parse_size` reads back)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def size_arg(n: int) -> str:
    """A byte count as a user writes it on a command line: "2G", "64M", "1536K", else the
    bytes (what `parse_size` reads back to the same number)."""
    for unit in ("P", "T", "G", "M", "K"):
        if n >= _SIZE_UNITS[unit] and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line first, "prog: error: ...", then a
    pointer to --help, not after a usage block that lists every flag."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


MAX_SIZE = 1 << 62  # any byte count: beyond it a size overflows the wire's int64 in sums


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Parse "4G", "500M", "1MiB", "4096" or an int into a byte count (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{name}: a byte count must be whole, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(
                f"{name}: expected a size like '4G', '500M' or '1048576', got {value!r}"
            )
        # (exactly: through a float, a long byte count came out another number)
        exact = Decimal(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()]
        if m.group(2) is None and exact != exact.to_integral_value():
            raise ConfigError(f"{name}: a byte count must be whole, got {value!r}")
        n = int(exact)  # ("1.3K": the whole bytes of it)
    else:
        raise ConfigError(f"{name}: expected a size like '4G' or a byte count, got {value!r}")
    if n <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    if n > MAX_SIZE:
        raise ConfigError(f"{name}: at most {MAX_SIZE} bytes (2**62), got {value!r}")
    return n


def number_arg(
    kind: type, *, minimum: float, above: bool, top: float | None = None, noun: str = "a number"
) -> Callable[[str], Any]:
    """An argparse type: a `kind` number >= `minimum` (> when `above`), <= `top`; its error
    is one line naming the flag (argparse adds the flag's name)."""
    low = f"{minimum:.15g}"  # (whole numbers in full: 2147483647, not 2.14748e+09)
    high = "" if top is None else f"{top:.15g}"
    rule = f"greater than {low}" if above else f"at least {low}"
    if top is not None:
        rule = f"above {low} and at most {high}" if above else f"from {low} to {high}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {rule}, got {text!r}") from None
        low_ok = value > minimum if above else value >= minimum
        if not low_ok or (top is not None and value > top) or value != value:  # NaN
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


_URL_RE = re.compile(r"^(tcp|ipc|inproc)://(.+)$")
_TCP_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^:\[\]/\s]+):(\d{1,5})$")


def parse_curve_key(value: Any, *, name: str, kind: str = "public key") -> str:
    """A CURVE key: its 40 Z85 characters, or a file holding them (`<state-dir>/curve.pub`, or
    `maru curve-keypair`'s NAME.key / NAME.pub). `kind` ("public key", "secret key"): in errors."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: expected a 40-character CURVE key or a file, got {value!r}")
    text = value.strip()
    if len(text) != 40 or _is_file(text):  # (Z85 has "/" and ".")
        try:
            text = _read_key_file(Path(text).expanduser()).decode().strip()
        except OSError as exc:
            raise ConfigError(
                f"{name}: {value!r} is neither a 40-character CURVE key nor a readable file "
                f"({exc.strerror or exc})"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{name}: {value!r} holds no CURVE key (not text)") from None
    if not is_key(text):
        raise ConfigError(f"{name}: a CURVE {kind} is 40 Z85 characters, got {len(text)}")
    return text


_KEY_FILE_MAX = 4096  # a key file holds 40 characters and a newline


def _read_key_file(path: Path) -> bytes:
    """At most _KEY_FILE_MAX bytes of a key file: /dev/zero is no endless read, and a FIFO
    that no one writes to is empty, not a wait (opened without blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.set_blocking(fd, True)  # (a pipe with a writer: wait for what it writes)
        data = b""
        while len(data) < _KEY_FILE_MAX:
            more = os.read(fd, _KEY_FILE_MAX - len(data))
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def _is_file(text: str) -> bool:
    """Whether `text` names a file here; False where it cannot be looked up (a directory on
    its way this process may not search, e.g. a working directory of another user's)."""
    try:
        return Path(text).expanduser().is_file()
    except OSError:
        return False


def parse_server_url(value: Any, *, name: str = "server_url") -> str:
    """'tcp://host:port', 'ipc://path' or a bare 'host:port' (tcp), checked here so that a typo
    is one clear error, not a ZMQ traceback at the first request."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: expected 'tcp://host:port' (or host:port), got {value!r}")
    url = value.strip()
    if "://" not in url:
        url = f"tcp://{url}"
    m = _URL_RE.match(url)
    if m is None:
        raise ConfigError(
            f"{name}: expected 'tcp://host:port', 'host:port' or 'ipc://path', got {value!r}"
        )
    if m.group(1) == "tcp":
        tcp = _TCP_RE.match(m.group(2))
        if tcp is None or not 1 <= int(tcp.group(2)) <= 65535:
            raise ConfigError(
                f"{name}: expected 'tcp://host:port' with a port from 1 to 65535, got {value!r}"
            )
        host = tcp.group(1)
        try:  # (what the resolver is given: an empty label, or bytes not text, fail there)
            host.encode("idna")
        except UnicodeError:
            raise ConfigError(f"{name}: {host!r} is not a valid host name, in {value!r}") from None
    return url


def parse_pool_path(value: Any, *, name: str) -> str:
    """An absolute path (a file, a device, or an fsdax directory), "~" expanded: a relative
    one would depend on each process's working directory."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: expected the absolute path of the pool, got {value!r}")
    path = os.path.expanduser(value.strip())
    if not os.path.isabs(path):
        raise ConfigError(f"{name}: expected an absolute path, got {value!r}")
    return path


# How the hosts of a CXL pod see each other's writes (`coherence`, `maru-server --coherence`):
# their caches snoop each other, or cache-line flushes around every copy do it for them.
COHERENCE_MODES = ("hardware", "software")


def parse_coherence(value: Any, *, name: str = "coherence") -> str:
    """One of COHERENCE_MODES (any case): a typo must not silently mean no flushes."""
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in COHERENCE_MODES:
        raise ConfigError(f"{name}: expected 'hardware' or 'software', got {value!r}")
    return str(mode)


def parse_bool(value: Any, *, name: str = "flag") -> bool:
    """Accept JSON booleans, 0/1 and the usual strings ("true", "off", ...)."""
    if isinstance(value, int) and value in (0, 1):  # (True and False too)
        return bool(value)
    low = value.strip().lower() if isinstance(value, str) else None
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise ConfigError(f"{name}: expected a boolean (true/false), got {value!r}")


PAGE = 4096  # chunks start on page boundaries of the pool
EAGER_MAP_ENV = "MARU_EAGER_MAP"  # wins over `eager_map`, as in the original Maru
POOL_PATH_ENV = "MARU_POOL_PATH"  # `pool_path` where the key is not set (the key wins)


MAX_COPY_THREADS = 16  # the caller and the 15 copier threads of maru.common._memcopy


def parse_int(value: Any, *, name: str, minimum: int = 1, maximum: int = 2**31 - 1) -> int:
    """An integer from `minimum` (1 unless told) to `maximum` (what a C int holds unless
    told: timeouts and counts end in one), from an int or a string of digits."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    n = None
    if not isinstance(value, bool) and not (isinstance(value, float) and not value.is_integer()):
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            n = int(value)
    if n is None or n < minimum:
        raise ConfigError(f"{name}: expected {kind}, got {value!r}")
    if n > maximum:
        raise ConfigError(f"{name}: at most {maximum}, got {value!r}")
    return n


def unknown_option(key: str, known: set[str], *, prefix: str = "") -> ConfigError:
    """The error for a key that is no MaruConfig field: it, the nearest valid key, all of them."""
    valid = sorted(prefix + k for k in known)
    near = difflib.get_close_matches(key.lower(), valid, n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    return ConfigError(f"{key}: unknown Maru option ({hint}valid keys: {', '.join(valid)})")


@dataclass
class MaruConfig:
    """How a `MaruHandler` reaches the server and how much shared memory it may hold; each field
    is also a `maru_*` key (`from_mapping`), all described in docs/configuration.md. `pool_size`
    caps this instance's regions, none taken at connect: they are requested as data arrives, in
    growing steps (`region_expand_size`), and idle ones may be taken back for another instance.
    """

    server_url: str = "tcp://localhost:5555"
    instance_id: str | None = None  # None: a new UUID (each process its own instance)
    pool_size: int = 1 << 30
    chunk_size_bytes: int = _DEFAULT_CHUNK
    auto_connect: bool = True
    timeout_ms: int = 2000
    use_async_rpc: bool = True  # false: each request waits for the one before (max_inflight 1)
    max_inflight: int = 64  # requests one thread may have in flight (pipelined seals, releases)
    eager_map: bool = True
    ready_at_connect: bool = False  # take and populate regions up to pool_size at connect
    auto_expand: bool = True
    expand_size: int | None = None
    local_socket: bool = True  # RPCs over the server's Unix socket when it offers one
    busy_poll_us: int = 200  # spin this long for a reply on the Unix socket before sleeping
    copy_threads: int = 2  # threads of a page copy: the caller and up to copy_threads - 1
    local_index: bool = True  # exists and reads from the server's shared index, no request
    checksums: bool = False  # maru64 of every value, end to end: a mismatch reads as a miss
    server_public_key: str | None = None  # CURVE key (or its file) of a `--curve` server
    curve_client_key: str | None = None  # this client's CURVE secret key (or its file)
    # Where this host maps the pool (None: MARU_POOL_PATH, else the server's path); proven to
    # be the server's pool before use (`maru.client.poolpath`)
    pool_path: str | None = None
    coherence: str | None = None  # "hardware" or "software"; None: the server's

    def __new__(cls, *args: Any, **kwargs: Any) -> MaruConfig:
        # An unknown keyword is a ConfigError naming it (the dataclass __init__ would raise
        # a TypeError), like an unknown maru_* key in `from_mapping`.
        known = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in known:
                raise unknown_option(key, known)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        raw = os.environ.get(EAGER_MAP_ENV)
        if raw is not None:
            self.eager_map = parse_bool(raw, name=EAGER_MAP_ENV)
        self.validate()

    def validate(self) -> None:
        if self.instance_id is None:
            self.instance_id = str(uuid.uuid4())
        self.server_url = parse_server_url(self.server_url)
        if not isinstance(self.instance_id, str) or not self.instance_id.strip():
            raise ConfigError(f"instance_id: expected a non-empty string, got {self.instance_id!r}")
        if len(self.instance_id.encode()) > 128:
            raise ConfigError("instance_id: at most 128 bytes")
        self.pool_size = parse_size(self.pool_size, name="pool_size")
        # Any positive size, as the original takes (LMCache passes its KV chunk's bytes),
        # rounded up to whole pages: chunks start on page boundaries.
        chunk = parse_size(self.chunk_size_bytes, name="chunk_size_bytes")
        self.chunk_size_bytes = -(-chunk // PAGE) * PAGE
        if self.chunk_size_bytes > self.pool_size:
            # Blame the one that was changed: with the default chunk size it is pool_size.
            if self.chunk_size_bytes == _DEFAULT_CHUNK:
                raise ConfigError(
                    f"pool_size: {self.pool_size} bytes is smaller than one chunk "
                    f"(chunk_size_bytes {self.chunk_size_bytes}); use at least '1M'"
                )
            raise ConfigError(
                f"chunk_size_bytes: {self.chunk_size_bytes} is larger than pool_size "
                f"{self.pool_size}"
            )
        self.timeout_ms = parse_int(self.timeout_ms, name="timeout_ms")
        self.max_inflight = parse_int(self.max_inflight, name="max_inflight")
        self.busy_poll_us = parse_int(
            self.busy_poll_us, name="busy_poll_us", minimum=0, maximum=10_000_000
        )
        self.copy_threads = parse_int(self.copy_threads, name="copy_threads")
        if self.copy_threads > MAX_COPY_THREADS:
            raise ConfigError(f"copy_threads: at most {MAX_COPY_THREADS}, got {self.copy_threads}")
        for f in dataclasses.fields(self):
            if f.type == "bool":  # every flag (the annotations are strings here)
                setattr(self, f.name, parse_bool(getattr(self, f.name), name=f.name))
        if self.expand_size is not None:
            self.expand_size = parse_size(self.expand_size, name="expand_size")
            if not self.auto_expand:  # (as the original refuses them)
                raise ConfigError("expand_size: requires auto_expand=True")
            if self.expand_size < self.chunk_size_bytes:
                raise ConfigError(
                    f"expand_size: {self.expand_size} is smaller than one chunk "
                    f"(chunk_size_bytes {self.chunk_size_bytes})"
                )
        for key, kind in (("server_public_key", "public key"), ("curve_client_key", "secret key")):
            if getattr(self, key) is not None:
                setattr(self, key, parse_curve_key(getattr(self, key), name=key, kind=kind))
        if self.pool_path is None and os.environ.get(POOL_PATH_ENV):
            self.pool_path = parse_pool_path(os.environ[POOL_PATH_ENV], name=POOL_PATH_ENV)
        elif self.pool_path is not None:
            self.pool_path = parse_pool_path(self.pool_path, name="pool_path")
        if self.coherence is not None:
            self.coherence = parse_coherence(self.coherence)

    @property
    def region_expand_size(self) -> int:
        """The first region's size (`expand_size`; each later one is twice the largest held)."""
        return min(self.pool_size, self.expand_size or max(self.pool_size // 16, 2 << 20))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, prefix: str = "") -> MaruConfig:
        """A config from a dict such as SGLang's extra_config: with `prefix="maru_"`, keys without
        it are SGLang's (ignored), and an unknown key with it is an error (almost always a typo)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            if not isinstance(raw_key, str):  # (JSON has none; a Python caller may)
                if prefix:
                    continue
                raise unknown_option(repr(raw_key), known)
            if not raw_key.startswith(prefix):
                if prefix and raw_key.lower().startswith(prefix):  # MARU_POOL_SIZE: a typo
                    raise unknown_option(raw_key, known, prefix=prefix)
                continue
            key = raw_key[len(prefix) :]
            if key not in known:
                raise unknown_option(raw_key, known, prefix=prefix)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            # (a key's error gets the prefix; $MARU_EAGER_MAP's, $MARU_POOL_PATH's do not)
            field_error = str(exc).split(":", 1)[0] in known
            raise ConfigError(f"{prefix}{exc}" if field_error else str(exc)) from None
