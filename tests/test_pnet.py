"""A private mesh (libp2p pnet): the cipher against published vectors and libsodium, the key file
format and its refusals, the wrapper over memory streams, then real hosts on loopback: members
connect directly, through a relay and by dial-back; a peer without the key, or with another, is
refused both ways and counted."""

import base64
import os
import stat
from contextlib import AsyncExitStack

import nacl.bindings
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair

from meshd.cli.render import mesh_key_line
from meshd.cli.main import main as meshd_main
from meshd.core.settings import load_settings
from meshd.node.wiring import mesh_key
from meshd.p2p.host import connect, full_addrs, open_host
from meshd.p2p.pnet import MULTISTREAM_HEADER, NotAMember, Pnet, PnetConn, Refusals
from meshd.p2p.swarmkey import SwarmKey, SwarmKeyError, fingerprint, format_swarm_key, parse_swarm_key, \
    read_swarm_key, write_new_swarm_key
from meshd.p2p.xsalsa20 import XSalsa20, hsalsa20
from meshd.relay.circuit import HOP_PROTOCOL, STOP_PROTOCOL, RelayService, accept_circuit, dial_circuit, reserve
from meshd.relay.policy import RelayLimits
from meshd.p2p.addrs import circuit_addr
from meshd.relay.reachability import dial_fresh
from meshd.testing.fakes import raw_conn_pair

KEY = bytes(range(32))
NACL_KEY = bytes.fromhex("1b27556473e985d462cd51197a9a46c76009549eac6474f206c4ee0844f68389")
NACL_NONCE = bytes.fromhex("69696ee955b62b73cd62bda875fc73d68219e0036b7a0b37")


# the cipher: published vectors (NaCl's paper and test suite, Go's x/crypto/salsa20), then libsodium

def test_hsalsa20_gives_nacls_published_subkeys():
    shared = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert hsalsa20(shared, bytes(16)) == NACL_KEY  # crypto_box's "firstkey"
    assert hsalsa20(NACL_KEY, NACL_NONCE[:16]).hex() == \
        "dc908dda0b9344a953629b733820778880f3ceb421bb61b91cbd4c3e66256ce4"
    with pytest.raises(ValueError):
        hsalsa20(NACL_KEY[:31], bytes(16))


def test_xsalsa20_gives_the_published_keystreams():
    assert XSalsa20(NACL_KEY, NACL_NONCE).xor(bytes(32)).hex() == \
        "eea6a7251c1e72916d11c2cb214d3c252539121d8e234e652d651fa4c8cff880"  # NaCl's stream3
    key, nonce = b"this is 32-byte key for xsalsa20", b"24-byte nonce for xsalsa"
    assert XSalsa20(key, nonce).xor(b"Hello world!").hex() == "002d4513843fc240c401e541"
    assert XSalsa20(key, nonce).xor(bytes(64)).hex() == (
        "4848297feb1fb52fb66d81609bd547fabcbe7026edc8b5e5e449d088bfa69c08"
        "8f5d8da1d791267c2c195a7f8cae9c4b4050d08ce6d3a151ec265f3a58e47648")
    with pytest.raises(ValueError):
        XSalsa20(key, nonce[:8])  # Salsa20's short nonce is not what pnet speaks


@settings(max_examples=40, deadline=None)
@given(key=st.binary(min_size=32, max_size=32), nonce=st.binary(min_size=24, max_size=24),
       message=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=8))
def test_xsalsa20_in_any_chunks_equals_libsodiums(key, nonce, message, cuts):
    """libsodium's secretbox XORs the message with XSalsa20's keystream from byte 32 on."""
    expected = nacl.bindings.crypto_secretbox(message, nonce, key)[16:]
    cipher = XSalsa20(key, nonce)
    cipher.xor(bytes(32))
    bounds = sorted({0, len(message), *(c for c in cuts if c < len(message))})
    got = b"".join(cipher.xor(message[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert got == expected


# the key file

def test_every_format_of_a_key_file_gives_the_same_key():
    texts = [format_swarm_key(KEY, enc) for enc in (b"/base16/", b"/base64/", b"/bin/")]
    texts += [b"/key/swarm/psk/1.0.0/\n/base16/\n" + KEY.hex().upper().encode(),  # no final newline, upper case
              b"/key/swarm/psk/1.0.0/\r\n/base64/\r\n" + base64.b64encode(KEY) + b"\r\n",
              b"/key/swarm/psk/1.0.0/\n/bin/\n" + KEY + b"\n"]
    for text in texts:
        assert parse_swarm_key(text) == KEY, text
    assert format_swarm_key(KEY) == b"/key/swarm/psk/1.0.0/\n/base16/\n" + KEY.hex().encode() + b"\n"


@pytest.mark.parametrize("text, message", [
    (b"", "first line must be /key/swarm/psk/1.0.0/"),
    (b"/key/swarm/psk/2.0.0/\n/base16/\n" + KEY.hex().encode(), "first line"),
    (KEY.hex().encode(), "first line"),
    (b"/key/swarm/psk/1.0.0/\n/base32/\nAAAA\n", "second line"),
    (b"/key/swarm/psk/1.0.0/\n/base16/", "second line"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n" + KEY.hex().encode()[:-2], "31"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n" + KEY.hex().encode() + b"00", "33"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n" + b"zz" * 32, "not valid base16"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n\n", "one line"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n" + KEY.hex().encode() + b"\n" + KEY.hex().encode(), "one line"),
    (b"/key/swarm/psk/1.0.0/\n/base64/\n!!!!" + base64.b64encode(KEY), "not valid base64"),
    (b"/key/swarm/psk/1.0.0/\n/bin/\n" + KEY[:20], "20"),
])
def test_a_malformed_key_file_is_refused_saying_why(text, message):
    with pytest.raises(SwarmKeyError, match=message):
        parse_swarm_key(text)


def test_a_new_key_file_is_owner_only_read_back_and_never_overwritten(tmp_path):
    old = os.umask(0)
    try:
        key = write_new_swarm_key(tmp_path / "swarm.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "swarm.key").st_mode) == 0o600
    back = read_swarm_key(tmp_path / "swarm.key")
    assert back.psk == key.psk and back.fingerprint == key.fingerprint and len(key.fingerprint) == 32
    assert key.psk.hex() not in repr(key)
    assert write_new_swarm_key(tmp_path / "other.key").psk != key.psk
    with pytest.raises(SwarmKeyError, match="exists already"):
        write_new_swarm_key(tmp_path / "swarm.key")
    assert read_swarm_key(tmp_path / "swarm.key").psk == key.psk


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644, 0o660])
def test_a_key_file_other_users_can_read_or_change_is_refused(tmp_path, mode):
    path = tmp_path / "swarm.key"
    path.write_bytes(format_swarm_key(KEY))
    os.chmod(path, mode)
    with pytest.raises(SwarmKeyError, match=f"mode {mode:04o}.*chmod 600"):
        read_swarm_key(path)
    os.chmod(path, 0o400)
    assert read_swarm_key(path).psk == KEY


def test_missing_directory_huge_and_malformed_key_files_are_refused(tmp_path):
    with pytest.raises(SwarmKeyError, match="No such file"):
        read_swarm_key(tmp_path / "nothing")
    os.mkdir(tmp_path / "dir", 0o700)
    with pytest.raises(SwarmKeyError, match="not a regular file"):
        read_swarm_key(tmp_path / "dir")
    big = tmp_path / "big"
    big.write_bytes(format_swarm_key(KEY) + b"\0" * 5000)
    os.chmod(big, 0o600)
    with pytest.raises(SwarmKeyError, match="not a swarm key file"):
        read_swarm_key(big)
    bad = tmp_path / "bad"
    bad.write_bytes(b"/key/swarm/psk/1.0.0/\n/base16/\nabc\n")
    os.chmod(bad, 0o600)
    with pytest.raises(SwarmKeyError, match=f"{bad}: .*not valid base16"):
        read_swarm_key(bad)


def test_fingerprints_tell_keys_apart_without_showing_them():
    assert fingerprint(KEY) == SwarmKey(KEY).fingerprint == fingerprint(bytes(range(32)))
    assert fingerprint(KEY) != fingerprint(bytes(32))
    assert KEY.hex()[:8] not in fingerprint(KEY)
    with pytest.raises(SwarmKeyError):
        SwarmKey(b"short")


# settings and the command line

def test_the_key_setting_comes_from_flag_environment_or_config_and_can_be_required(tmp_path):
    path = tmp_path / "swarm.key"
    write_new_swarm_key(path)
    conf = tmp_path / "meshd.toml"
    conf.write_text(f'swarm_key = "{path}"\nrequire_swarm_key = 1\n')
    assert mesh_key(load_settings({}, str(conf), environ={})).psk == read_swarm_key(path).psk
    assert mesh_key(load_settings({}, None, environ={"MESHD_SWARM_KEY": str(path)})).path == str(path)
    assert mesh_key(load_settings({"swarm_key": str(path)}, None, environ={})).path == str(path)
    assert mesh_key(load_settings({}, None, environ={})) is None  # an open mesh
    for s in (load_settings({"require_swarm_key": 1}, None, environ={}),
              load_settings({}, None, environ={"MESHD_REQUIRE_SWARM_KEY": "1"})):
        with pytest.raises(SwarmKeyError, match="swarm key is required"):
            mesh_key(s, environ={})
    with pytest.raises(SwarmKeyError, match="LIBP2P_FORCE_PNET"):
        mesh_key(load_settings({}, None, environ={}), environ={"LIBP2P_FORCE_PNET": "1"})


def test_meshd_swarm_key_new_writes_a_key_and_join_refuses_bad_ones_with_exit_2(tmp_path, capsys, monkeypatch):
    # meshd's logging setup would bind the log to this test's captured stderr, closed after it
    monkeypatch.setattr("meshd.cli.main.setup_logging", lambda level: None)
    path = tmp_path / "swarm.key"
    assert meshd_main(["swarm-key", "new", str(path)]) == 0
    fp = read_swarm_key(path).fingerprint
    assert f"fingerprint {fp}" in capsys.readouterr().out
    assert meshd_main(["swarm-key", "fingerprint", str(path)]) == 0
    assert capsys.readouterr().out.strip() == fp
    assert meshd_main(["swarm-key", "new", str(path)]) == 2
    assert "exists already" in capsys.readouterr().err
    state = ["--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock")]
    os.chmod(path, 0o644)
    assert meshd_main(["join", "--swarm-key", str(path), *state]) == 2
    assert "mode 0644" in capsys.readouterr().err
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"/key/swarm/psk/1.0.0/\n/base58/\nxyz\n")
    os.chmod(bad, 0o600)
    assert meshd_main(["join", "--swarm-key", str(bad), *state]) == 2
    assert "second line" in capsys.readouterr().err
    assert meshd_main(["join", "--require-swarm-key", *state]) == 2
    assert "swarm key is required" in capsys.readouterr().err


def test_status_says_private_or_open():
    assert mesh_key_line({"private": False}) == "mesh      open mesh"
    assert mesh_key_line(None) == "mesh      open mesh"
    assert mesh_key_line({"private": True, "fingerprint": "ab" * 16, "refused": 0}) == \
        f"mesh      private mesh, key {'ab' * 16}"
    assert mesh_key_line({"private": True, "fingerprint": "ab" * 16, "refused": 3}) == \
        f"mesh      private mesh, key {'ab' * 16}; 3 connections without the key refused"


# the wrapper, over memory streams

def test_refusals_log_one_line_per_period_and_count_all():
    r = Refusals(every_s=60)
    assert r.note(0.0) == 0
    assert [r.note(t) for t in (1.0, 2.0, 59.0)] == [None, None, None]
    assert r.note(61.0) == 3  # the line says how many went unlogged
    assert r.note(62.0) is None and r.count == 6


async def _exchange(a, b, payload: bytes) -> bytes:
    """`a` writes `payload` in pieces; what `b` reads."""
    got = []

    async def reader():
        n = 0
        while n < len(payload):
            chunk = await b.read(1 + n % 7)
            assert chunk
            got.append(chunk)
            n += len(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        for i in range(0, len(payload), 333):
            await a.write(payload[i:i + 333])
    return b"".join(got)


async def test_two_members_talk_through_the_wrapper_in_any_chunks():
    pnet = Pnet(SwarmKey(KEY))
    raw_a, raw_b = raw_conn_pair()
    a, b = pnet.protect(raw_a), pnet.protect(raw_b)
    assert pnet.protect(a) is a  # never wrapped twice
    payload = MULTISTREAM_HEADER + os.urandom(5000)
    assert await _exchange(a, b, payload) == payload
    assert await _exchange(b, a, payload) == payload
    assert pnet.refusals.count == 0
    assert a.is_initiator and not b.is_initiator and b.get_remote_address() == ("192.0.2.1", 50000)


async def test_the_nonce_goes_first_and_the_rest_is_xsalsa20():
    raw_a, raw_b = raw_conn_pair()
    a = PnetConn(raw_a, KEY, lambda remote: None)
    await a.write(MULTISTREAM_HEADER + b"hello")
    wire = await raw_b.read(1000)
    nonce, body = wire[:24], wire[24:]
    assert XSalsa20(KEY, nonce).xor(body) == MULTISTREAM_HEADER + b"hello"
    assert MULTISTREAM_HEADER not in wire


async def test_a_reader_sends_its_nonce_before_it_waits():
    """rust-libp2p writes nothing until it has the other side's nonce."""
    raw_a, raw_b = raw_conn_pair()
    a = PnetConn(raw_a, KEY, lambda remote: None)
    got = []

    async def read_one():
        got.append(await a.read(1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_one)
        with trio.fail_after(5):
            nonce = await raw_b.read(100)
        assert len(nonce) == 24
        theirs = os.urandom(24)
        await raw_b.write(theirs + XSalsa20(KEY, theirs).xor(MULTISTREAM_HEADER))
    assert got == [MULTISTREAM_HEADER[:1]]


@pytest.mark.parametrize("what, opening", [
    ("plain libp2p", MULTISTREAM_HEADER + b"\x07/noise\n"),
    ("another key", None),
    ("a short opening", b"\x13/multi"),
    ("an opening cut after the nonce", os.urandom(24) + b"\x13"),
])
async def test_a_peer_without_the_key_is_refused_before_libp2p_reads_a_byte(what, opening):
    refused = []
    raw_a, raw_b = raw_conn_pair()
    member = PnetConn(raw_b, KEY, refused.append)
    if opening is None:
        other = PnetConn(raw_a, bytes(32), lambda remote: None)
        await other.write(MULTISTREAM_HEADER)
    else:
        await raw_a.write(opening)
        if what.startswith(("a short", "an opening cut")):
            await raw_a.close()
    with pytest.raises(NotAMember, match="without the mesh's key from 192.0.2.1:50000"):
        with trio.fail_after(5):
            await member.read(1)
    assert refused == ["192.0.2.1:50000"]


async def test_a_connection_that_ends_before_a_byte_is_no_refusal():
    refused = []
    raw_a, raw_b = raw_conn_pair()
    member = PnetConn(raw_b, KEY, refused.append)
    await raw_a.close()
    with pytest.raises(Exception) as info:
        await member.read(1)
    assert not isinstance(info.value, NotAMember) and refused == []


# real hosts on loopback

def _pnet(key: bytes | None) -> Pnet | None:
    return Pnet(SwarmKey(key)) if key is not None else None


async def _cannot_connect(host, addr: str) -> None:
    with pytest.raises(BaseException):
        await connect(host, addr, timeout=5)
    assert addr.split("/p2p/")[1] not in [p.to_base58() for p in host.get_connected_peers()]


async def test_members_connect_and_others_are_refused_both_ways():
    members = Pnet(SwarmKey(KEY))
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], members))
        b = await stack.enter_async_context(open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], members))
        wrong = _pnet(os.urandom(32))
        w = await stack.enter_async_context(open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], wrong))
        o = await stack.enter_async_context(open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]))
        assert await connect(b, full_addrs(a)[0]) == a.get_id()
        stream = await b.new_stream(a.get_id(), ["/ipfs/id/1.0.0"])  # identify answers: libp2p runs inside
        with trio.fail_after(5):
            assert await stream.read(65536)
        await stream.close()
        before = members.refusals.count
        await _cannot_connect(w, full_addrs(a)[0])  # another key, dialling in
        await _cannot_connect(o, full_addrs(a)[0])  # no key, dialling in
        await _cannot_connect(b, full_addrs(w)[0])  # a member dialling out to them
        await _cannot_connect(b, full_addrs(o)[0])
        assert members.refusals.count >= before + 4 and wrong.refusals.count >= 1
        assert a.get_connected_peers() == [b.get_id()]


async def test_a_relay_serves_members_and_a_circuit_between_them_carries_the_key():
    members = Pnet(SwarmKey(KEY))
    async with AsyncExitStack() as stack:
        relay = await stack.enter_async_context(open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], members))
        service = RelayService(relay, RelayLimits(), own_addrs=lambda: full_addrs(relay))
        relay.set_stream_handler(HOP_PROTOCOL, service.serve_stream)
        hidden = await stack.enter_async_context(open_host(create_new_key_pair(), [], members))
        allowed = {relay.get_id().to_base58()}

        async def stop_handler(stream):
            await accept_circuit(hidden, stream, lambda: allowed)

        hidden.set_stream_handler(STOP_PROTOCOL, stop_handler)
        await connect(hidden, full_addrs(relay)[0])
        await reserve(hidden, relay.get_id().to_base58())
        dialer = await stack.enter_async_context(open_host(create_new_key_pair(), [], members))
        await connect(dialer, full_addrs(relay)[0])
        protected = []
        protect = members.protect

        def spy(raw_conn):  # which raw connections went through pnet
            protected.append(raw_conn.get_connection_type())
            return protect(raw_conn)

        members.protect = spy
        await dial_circuit(dialer, circuit_addr(full_addrs(relay)[0], relay.get_id().to_base58(),
                                                hidden.get_id().to_base58()))
        assert hidden.get_id() in dialer.get_connected_peers()
        assert protected.count(ConnectionType.RELAYED) == 2  # the circuit, at the dialler and at the hidden host
        assert service.summary()["circuits"] == 1
        outsider = await stack.enter_async_context(open_host(create_new_key_pair(), []))
        await _cannot_connect(outsider, full_addrs(relay)[0])  # a non-member never gets to ask for a circuit


async def test_reachability_dial_backs_carry_the_key():
    members = Pnet(SwarmKey(KEY))
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], members) as target:
        addr = full_addrs(target)[0].split("/p2p/")[0]
        pid = target.get_id().to_base58()
        assert await dial_fresh([addr], pid, pnet=members) == addr
        before = members.refusals.count
        assert await dial_fresh([addr], pid) is None  # a probe without the key is refused
        assert members.refusals.count > before
