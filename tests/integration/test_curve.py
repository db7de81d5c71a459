"""Issue 13, P5 for clients on other hosts: `maru-server --curve` serves its TCP port with
ZeroMQ CURVE (authenticated and encrypted). A client needs the server's public key: without
it, or with another key, it cannot talk to the server and says why within its deadline; with
it, everything works, also after a server restart (the keypair is kept in the state dir).
With `--curve-clients` the server also needs the client's own public key in its allowlist."""

from __future__ import annotations

import io
import stat

import pytest
import zmq

from maru import MaruHandler
from maru.client.cli import main
from maru.client.rpc import RpcClient
from maru.common.config import ConfigError, MaruConfig
from maru.common.errors import MaruConnectRefused

from .test_crash_safety import wait_until

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")


def handler(url: str, key: str | None = None, client_key: str | None = None) -> MaruHandler:
    # TCP only: a client on another host has no local socket to fall back on
    return MaruHandler(
        server_url=url,
        pool_size="4M",
        timeout_ms=1000,
        local_socket=False,
        server_public_key=key,
        curve_client_key=client_key,
    )


def test_only_a_client_with_the_servers_public_key_talks_to_a_curve_server(maru_server_factory):
    server = maru_server_factory(pool_size="64M", extra_args=["--curve"])
    key_file = server.state_dir / "curve.pub"
    public = key_file.read_text().strip()
    for name in ("curve.key", "curve.pub"):
        assert stat.S_IMODE((server.state_dir / name).stat().st_mode) == 0o600
    secret = (server.state_dir / "curve.key").read_bytes().strip()
    assert zmq.curve_public(secret) == public.encode()
    assert public in server.read_log()  # the operator learns the key from the log too

    # without the key, and with another server's key: refused with the reason, no hang
    for key, why in ((None, "requires CURVE"), (zmq.curve_keypair()[0].decode(), "not this")):
        h = handler(server.url, key)
        assert not h.connected
        assert isinstance(h.connect_error, MaruConnectRefused), h.connect_error
        assert "security handshake failed" in str(h.connect_error)
        assert why in str(h.connect_error)
        h.close()
    out = io.StringIO()
    assert main(["status", "--server", server.url, "--timeout-ms", "1000"], out=out) == 1

    # with the key (as text, or the file's path): stores and reads over CURVE
    writer, reader = handler(server.url, public), handler(server.url, str(key_file))
    assert writer.connected and reader.connected
    assert writer.batch_store(["a", "b"], [b"x" * 5000, b"y" * 70_000]) == [True, True]
    with reader.leased(["a", "b"]) as infos:
        assert [bytes(i.view) for i in infos] == [b"x" * 5000, b"y" * 70_000]
    args = ["status", "--server", server.url, "--server-public-key", str(key_file)]
    assert main(args, out=io.StringIO()) == 0

    # a restart keeps the keypair: connected clients carry on, new ones use the same key
    server.restart()
    assert key_file.read_text().strip() == public
    assert writer.store("c", b"z" * 1000)
    late = handler(server.url, public)
    assert late.connected and late.exists("c")
    for h in (writer, reader, late):
        h.close()


def test_a_client_with_a_key_cannot_talk_to_a_plain_server(maru_server):
    h = handler(maru_server.url, zmq.curve_keypair()[0].decode())
    assert not h.connected
    assert "does not use --curve" in str(h.connect_error)
    h.close()


def test_server_public_key_is_a_key_or_a_readable_file(tmp_path):
    public = zmq.curve_keypair()[0].decode()
    assert MaruConfig(server_public_key=public).server_public_key == public
    path = tmp_path / "curve.pub"
    path.write_text(public + "\n")
    assert MaruConfig(server_public_key=str(path)).server_public_key == public
    with pytest.raises(ConfigError, match="server_public_key"):
        MaruConfig(server_public_key=str(tmp_path / "missing"))
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="40 Z85 characters"):
        MaruConfig(server_public_key=str(path))
    with pytest.raises(ConfigError, match="maru_server_public_key"):
        MaruConfig.from_mapping({"maru_server_public_key": ""}, prefix="maru_")


def test_a_curve_client_on_another_host_never_uses_a_local_socket():
    """The HANDSHAKE names the server's local socket; a client that reached the server over
    the network is on another host, where that name is anyone's (same uid number or not)."""
    key = zmq.curve_keypair()[0].decode()
    for url, expected in (
        ("tcp://10.1.2.3:5555", None),
        ("tcp://127.0.0.1:5555", "@maru:x"),
        ("tcp://localhost:5555", "@maru:x"),
    ):
        rpc = RpcClient(url, server_public_key=key)
        rpc.use_local_socket("@maru:x", 1000)
        assert rpc.local_address == expected, url
        rpc.close()
    plain = RpcClient("tcp://10.1.2.3:5555")  # without CURVE: as before (the uid check)
    plain.use_local_socket("@maru:x", 1000)
    assert plain.local_address == "@maru:x"
    plain.close()


def test_with_curve_clients_only_listed_client_keys_talk_to_the_server(
    maru_server_factory, tmp_path
):
    """`maru curve-keypair` makes a client's keypair; a server with `--curve-clients DIR`
    talks to a client whose public key is in DIR (and that proves it with the secret key),
    and refuses any other (a throwaway keypair, an unlisted one, a listed public key without
    its secret) with a clear error within the deadline, logged by the server. A key added to
    DIR counts from the next connection, without a restart; a key removed from DIR counts for
    the connection already open too."""
    allowed, keys = tmp_path / "allowed", tmp_path / "keys"
    allowed.mkdir()
    keys.mkdir()
    out = io.StringIO()
    assert main(["curve-keypair", str(keys / "alice")], out=out) == 0
    assert main(["curve-keypair", str(keys / "bob")], out=io.StringIO()) == 0
    assert main(["curve-keypair", str(keys / "alice")], out=io.StringIO()) == 1  # kept
    alice_public = (keys / "alice.pub").read_text().strip()
    assert alice_public in out.getvalue()
    assert stat.S_IMODE((keys / "alice.key").stat().st_mode) == 0o600
    alice_secret = (keys / "alice.key").read_text().strip()
    assert zmq.curve_public(alice_secret.encode()).decode() == alice_public
    (allowed / "alice.pub").write_text(f"# alice's laptop\n\n{alice_public} since Monday\n")

    server = maru_server_factory(
        pool_size="64M", extra_args=["--curve", "--curve-clients", str(allowed)]
    )
    server_key = str(server.state_dir / "curve.pub")
    alice = handler(server.url, server_key, str(keys / "alice.key"))  # the key's file
    assert alice.connected
    assert alice.batch_store(["a"], [b"x" * 5000]) == [True]
    assert handler(server.url, server_key, alice_secret).exists("a")  # the key as text

    bob_secret = (keys / "bob.key").read_text().strip()
    refused = 0
    for client_key in (None, bob_secret):  # a throwaway keypair; an unlisted one
        h = handler(server.url, server_key, client_key)
        assert not h.connected
        assert isinstance(h.connect_error, MaruConnectRefused), h.connect_error
        assert "does not list this client's CURVE key" in str(h.connect_error)
        assert "--curve-clients" in str(h.connect_error)
        refused += 1
        h.close()
    assert refused == 2
    # the operator's CLI is a client too
    cli = ["status", "--server", server.url, "--server-public-key", server_key]
    assert main([*cli, "--timeout-ms", "1000"], out=io.StringIO()) == 1
    assert main([*cli, "--curve-client-key", str(keys / "alice.key")], out=io.StringIO()) == 0
    bob_public = (keys / "bob.pub").read_text().strip()
    assert f"refused a CURVE client with key {bob_public}" in server.read_log()

    (allowed / "bob.pub").write_text((keys / "bob.pub").read_text())  # added while it runs
    bob = handler(server.url, server_key, str(keys / "bob.key"))
    assert bob.connected and bob.exists("a")
    # removed while bob is connected: ZeroMQ keeps the connection, the server refuses its
    # requests (within a second, the allowlist's recheck), naming the key
    (allowed / "bob.pub").unlink()
    assert wait_until(lambda: not bob.store("c", b"z" * 1000), 10)
    assert not bob.exists("a") and not bob.exists("c")
    assert f"refused a CURVE client with key {bob_public}: removed from" in server.read_log()
    assert alice.exists("a")  # the others go on
    (allowed / "bob.pub").write_text(bob_public)  # listed again: served again
    assert wait_until(lambda: bob.exists("a"), 10)
    # the allowlist survives a restart (it is the operator's directory, read at start)
    server.restart()
    assert alice.store("b", b"y" * 1000)
    for h in (alice, bob):
        h.close()


def test_curve_client_key_is_a_secret_key_or_its_file(tmp_path):
    secret = zmq.curve_keypair()[1].decode()
    assert MaruConfig(curve_client_key=secret).curve_client_key == secret
    path = tmp_path / "me.key"
    path.write_text(secret + "\n")
    assert MaruConfig(curve_client_key=str(path)).curve_client_key == secret
    path.write_text("short\n")
    with pytest.raises(ConfigError, match=r"curve_client_key: a CURVE secret key is 40 Z85"):
        MaruConfig(curve_client_key=str(path))
    with pytest.raises(ConfigError, match="neither a 40-character CURVE key nor a readable"):
        MaruConfig(curve_client_key="x" * 39)
    with pytest.raises(ConfigError, match="maru_curve_client_key"):
        MaruConfig.from_mapping({"maru_curve_client_key": ""}, prefix="maru_")
