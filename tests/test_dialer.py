"""The dialler as policy: circuit ranking with made-up inputs, and dialling against an in-memory host on
trio's MockClock (no sockets): one dial per peer however many sessions ask, a stale connection retried
once, the ways to a peer behind relays staggered in rank order, the DHT's dial through known relays."""

from types import SimpleNamespace

import pytest
import trio

from meshd.p2p.addrs import circuit_addr, strip_peer, with_peer
from meshd.p2p.connections import is_connected, live_connections, relayed_peers
from meshd.p2p.dialer import DIAL_STAGGER_S, PROTECT_TAG, Dialer, circuit_rank
from meshd.testing.fakehost import FakeHost, fake_id
from meshd.wire.protocols import SHARD_PROTOCOL

DIRECT = "/ip4/127.0.0.1/tcp/4001/p2p/Target"


def via(relay: str, peer: str = "Target", port: int = 5000) -> str:
    return circuit_addr(f"/ip4/127.0.0.1/tcp/{port}", relay, peer)


# ---- pure: ranking and address helpers ----

def test_connected_relays_rank_first_then_the_nearest_and_unmeasured_count_as_a_second():
    latency = {"RxNear": 0.002, "RxFar": 0.2, "RxTardy": 3.0}
    addrs = [via("RxTardy"), via("RxFar"), "/ip4/1.2.3.4/tcp/1/p2p-circuit", via("RxNew"), via("RxNear"), via("RxHeavy")]
    ranked = sorted(addrs, key=lambda a: circuit_rank(a, {"RxHeavy", "RxTardy"}, latency))
    assert ranked == [via("RxHeavy"), via("RxTardy"),  # connected: unmeasured (1 s) ahead of 3 s
                      via("RxNear"), via("RxFar"), via("RxNew"),  # then by latency, unmeasured as 1 s
                      "/ip4/1.2.3.4/tcp/1/p2p-circuit"]  # not a well-formed circuit: last
    assert circuit_rank(via("RxNew"), set(), {}) == (1, 1.0)


def test_the_peer_tail_is_stripped_and_added_in_one_way():
    assert strip_peer("/ip4/10.0.0.1/tcp/1/p2p/Peer") == "/ip4/10.0.0.1/tcp/1"
    assert strip_peer("/ip4/10.0.0.1/tcp/1") == "/ip4/10.0.0.1/tcp/1"
    assert strip_peer(via("RxA")) == "/ip4/127.0.0.1/tcp/5000"  # a circuit: its relay's transport address
    assert with_peer("/ip4/10.0.0.1/tcp/1", "Peer") == "/ip4/10.0.0.1/tcp/1/p2p/Peer"
    assert with_peer("/ip4/10.0.0.1/tcp/1/p2p/Old", "Peer") == "/ip4/10.0.0.1/tcp/1/p2p/Peer"


def test_only_open_connections_count_and_a_peer_is_relayed_when_all_of_them_are():
    host = FakeHost()
    host.connect_now("Gone", is_closed=True)
    host.connect_now("Both", relayed=True)
    host.connect_now("Both")
    host.connect_now("Hidden", relayed=True)
    host.connect_now("Hidden", relayed=True, is_closed=True)
    net = host.get_network()
    assert not is_connected(net, "Gone") and live_connections(net, fake_id("Gone")) == []
    assert is_connected(net, "Both") and len(live_connections(net, "Both")) == 2
    assert not is_connected(net, "Nobody")
    assert relayed_peers(net) == ["Hidden"]


# ---- the dialler on an in-memory host ----

def make(host, latency=None, known=None) -> Dialer:
    return Dialer(host, host.circuit, latency=lambda: latency or {}, known=lambda: known or {})


async def test_sixteen_sessions_opening_at_once_dial_the_peer_once(autojump_clock):
    host = FakeHost()
    host.delays["Target"] = 0.3
    dialer = make(host)
    async with trio.open_nursery() as nursery:
        for _ in range(16):
            nursery.start_soon(dialer.open_stream, "Target", [DIRECT], SHARD_PROTOCOL)
    assert host.dials == [("Target", "connect")]
    assert len(host.streams) == 16
    assert (fake_id("Target"), PROTECT_TAG) in host.network.protected  # kept from per-peer trimming
    assert host.network.unblocked == [fake_id("Target")]  # a restarted peer is not refused from cache


async def test_a_listed_but_closed_connection_is_redialled_through_the_swarm(autojump_clock):
    host = FakeHost()
    host.connect_now("Target", is_closed=True)
    await make(host).ensure_connected("Target", [DIRECT])
    # host.connect() would return early while any connection is listed: the swarm dials instead
    assert host.dials == [("Target", "dial_peer")]
    assert [str(a) for a in host.peerstore.addrs(fake_id("Target"))] == ["/ip4/127.0.0.1/tcp/4001"]


async def test_a_stream_on_a_stale_connection_is_tried_once_more_on_a_fresh_one(autojump_clock):
    host = FakeHost()
    host.connect_now("Target", stale=True)
    dialer = make(host)
    await dialer.open_stream("Target", [DIRECT], SHARD_PROTOCOL)
    assert host.dials == [("Target", "dial_peer")] and host.streams == [("Target", str(SHARD_PROTOCOL))]
    host.network.connections[fake_id("Target")][0].stale = True
    host.refuse.add("Target")  # the fresh dial fails too: the caller hears of it
    with pytest.raises(OSError, match="refused"):
        await dialer.open_stream("Target", [DIRECT], SHARD_PROTOCOL)


async def test_a_live_connection_is_used_as_it_is(autojump_clock):
    host = FakeHost()
    host.connect_now("Target")
    channel = await make(host).dial_shard("Target", [DIRECT])
    assert host.dials == [] and host.streams == [("Target", str(SHARD_PROTOCOL))]
    assert channel.protocol == str(SHARD_PROTOCOL)


async def test_ways_through_relays_are_staggered_in_rank_order(autojump_clock):
    host = FakeHost()
    host.connect_now("RxHeavy")
    host.delays["Target"] = 1000.0  # the direct way hangs (a private address dropping packets)
    dialer = make(host, latency={"RxNear": 0.001, "RxHeavy": 0.5})
    t0 = trio.current_time()
    host_circuit = host.circuit

    async def circuit(h, addr):  # the circuit's own dial is instant; only the direct one hangs
        host.delays["Target"] = 0.0
        await host_circuit(h, addr)
    dialer.circuit = circuit
    await dialer.ensure_connected("Target", [DIRECT, via("RxNear"), via("RxHeavy")])
    assert trio.current_time() - t0 == pytest.approx(DIAL_STAGGER_S)  # direct got its second, no more
    assert host.dials[0] == ("Target", "connect")
    assert host.dials[1] == ("Target", "circuit via RxHeavy")  # connected relay before the nearer one
    assert ("RxNear", "connect") not in host.dials  # the first circuit won: the next was never due
    assert relayed_peers(host.get_network()) == ["Target"] and dialer.relayed_peers() == ["Target"]


async def test_a_dead_relay_costs_a_failure_and_the_next_relay_is_tried_at_once(autojump_clock):
    host = FakeHost()
    host.refuse.add("RxDead")
    dialer = make(host, latency={"RxDead": 0.001, "RxLive": 0.01})
    t0 = trio.current_time()
    await dialer.ensure_connected("Target", [via("RxDead", port=1), via("RxLive", port=2)])
    assert trio.current_time() - t0 < DIAL_STAGGER_S
    assert [d for d in host.dials] == [("RxDead", "connect"), ("RxLive", "connect"), ("Target", "circuit via RxLive")]


async def test_no_way_through_names_every_failure(autojump_clock):
    host = FakeHost()
    host.refuse |= {"Target", "RxA"}
    with pytest.raises(ConnectionError, match=r"cannot reach .*direct: OSError.*RxA"):
        await make(host).ensure_connected("Target", [DIRECT, via("RxA")])


async def test_the_dht_reaches_a_hidden_peer_through_the_relays_its_record_names(autojump_clock):
    host = FakeHost()
    rec = SimpleNamespace(addrs=(), relay_addrs=(via("RxA"),))
    dialer = make(host, known={"Target": rec})
    await dialer.dial_known(fake_id("Target"))
    assert host.dials == [("RxA", "connect"), ("Target", "circuit via RxA")]


async def test_the_dht_falls_back_to_circuits_in_the_peerstore_and_never_raises(autojump_clock):
    host = FakeHost()
    dialer = make(host)
    await dialer.dial_known(fake_id("Target"))  # nothing known: nothing dialled
    assert host.dials == []
    host.peerstore.add_addrs(fake_id("Target"), [via("RxB")], 60)  # (py-libp2p keeps Multiaddrs; str() alike)
    host.refuse.add("RxB")
    await dialer.dial_known(fake_id("Target"))  # the relay refuses: swallowed
    assert host.dials == [("RxB", "connect")]


async def test_mesh_peers_are_connected_record_holders_not_reached_through_a_relay():
    host = FakeHost()
    host.connect_now("Direct")
    host.connect_now("Hidden", relayed=True)
    host.connect_now("Stranger")
    dialer = make(host, known={"Direct": None, "Hidden": None, "Away": None})
    assert dialer.mesh_peers() == ["Direct"]
