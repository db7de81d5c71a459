"""`MaruAdmin`: an operator's connection to `maru-server` (what the `maru` CLI uses).

Unlike `MaruHandler` it never handshakes: it is not an instance, owns no region, maps no
memory and allocates nothing. It only asks for statistics, lists keys and deletes them, over
the one RPC client (`maru.client.rpc.RpcClient`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from maru.client.connecting import probe
from maru.client.rpc import RpcClient
from maru.common.config import parse_curve_key, parse_server_url
from maru.common.protocol import MAX_LIST_KEYS, MsgType

DEFAULT_SERVER_URL = "tcp://localhost:5555"
SERVER_URL_ENV = "MARU_SERVER_URL"
SERVER_KEY_ENV = "MARU_SERVER_PUBLIC_KEY"
CLIENT_KEY_ENV = "MARU_CURVE_CLIENT_KEY"

Key = str | bytes


def _setting(value: str | None, flag: str, env: str, parse: Callable[..., str]) -> str | None:
    """`value` (given as `flag`), else $`env`, parsed; None if neither is set. A malformed
    one raises `ConfigError` naming where it came from."""
    if value:
        return parse(value, name=flag)
    if os.environ.get(env):
        return parse(os.environ[env], name=f"${env}")
    return None


def _secret_key(value: str, name: str) -> str:
    return parse_curve_key(value, name=name, kind="secret key")


class Deleted(tuple[int, int]):
    """(deleted, kept because pinned or leased), unpacked as before; `cluster`: whether the
    server sent the removal of the keys' cluster objects (asked with `cluster=True`; False
    without a tier, or while it is not connected)."""

    cluster: bool

    def __new__(cls, deleted: int, kept: int, cluster: bool = False) -> Deleted:
        self = super().__new__(cls, (deleted, kept))
        self.cluster = cluster
        return self


@dataclass(frozen=True)
class KeyInfo:
    key: Key
    length: int
    owner: str  # instance whose region holds the bytes


class MaruAdmin:
    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_ms: int = 2000,
        public_key: str | None = None,
        client_key: str | None = None,
    ):
        """`url`: default $MARU_SERVER_URL, else tcp://localhost:5555 ("host:port" means
        tcp://). `public_key`: of a `maru-server --curve` (or its file; default
        $MARU_SERVER_PUBLIC_KEY; none: plain TCP). `client_key`: our CURVE secret key (or its
        file; default $MARU_CURVE_CLIENT_KEY), for a server with --curve-clients."""
        self.url = _setting(url, "--server", SERVER_URL_ENV, parse_server_url) or DEFAULT_SERVER_URL
        self._timeout_ms = timeout_ms
        self._rpc = RpcClient(
            self.url,
            timeout_ms=timeout_ms,
            max_inflight=1,
            server_public_key=_setting(
                public_key, "--server-public-key", SERVER_KEY_ENV, parse_curve_key
            ),
            client_secret_key=_setting(
                client_key, "--curve-client-key", CLIENT_KEY_ENV, _secret_key
            ),
        )

    def probe(self) -> None:
        """Raise at once, as `MaruHandler.connect` does, when nothing listens at a tcp:// URL
        (`MaruServerDown`: "connection refused" in a millisecond, not a request that waits
        out its deadline) or something other than maru-server answers (`MaruConnectRefused`)."""
        probe(self.url, self._timeout_ms)

    def stats(self) -> dict[str, Any]:
        """What STATS returns: pool, keys, instances, counters, per-operation histograms.
        Raises `MaruConnectionError` when the server does not answer in time."""
        return self._rpc.request(MsgType.STATS, {}).result()["stats"]

    def keys(self, prefix: Key | None = None, limit: int = 100) -> tuple[list[KeyInfo], bool]:
        """Up to `limit` (at most MAX_LIST_KEYS) keys starting with `prefix`, most recently
        used first, and whether more matched."""
        body: dict[str, Any] = {"limit": min(int(limit), MAX_LIST_KEYS)}
        if prefix:
            body["prefix"] = prefix
        reply = self._rpc.request(MsgType.KEYS, body).result()
        return [KeyInfo(k, int(n), str(o)) for k, n, o in reply["keys"]], bool(reply["truncated"])

    def delete_prefix(self, prefix: Key, cluster: bool = False) -> Deleted:
        """Delete every key starting with `prefix` that is not pinned or leased; returns
        (deleted, kept because pinned or leased). `cluster`: the server's cluster tier also
        removes those keys' objects from Mooncake (`.cluster` of the result: sent or not),
        so that no node pulls them back (docs/operations.md#cluster-tier)."""
        if not prefix:
            raise ValueError("prefix must not be empty (use clear() to delete every key)")
        return self._delete({"prefix": prefix}, cluster)

    def clear(self, cluster: bool = False) -> Deleted:
        """Delete every key that is not pinned or leased; returns (deleted, kept). `cluster`:
        every object of the server's cluster tier in Mooncake too (as `delete_prefix`)."""
        return self._delete({"all": True}, cluster)

    def _delete(self, body: dict[str, Any], cluster: bool) -> Deleted:
        if cluster:
            body["cluster"] = True
        reply = self._rpc.request(MsgType.DELETE_PREFIX, body).result()
        return Deleted(int(reply["deleted"]), int(reply["pinned"]), bool(reply.get("cluster")))

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> MaruAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
