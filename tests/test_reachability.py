"""Reachability by dial-back: the verdict as pure logic, then real libp2p hosts on loopback."""

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from meshd.cli.render import reach_line
from meshd.p2p.host import connect, full_addrs, open_host
from meshd.relay.reachability import (DIALBACK_PROTOCOL, DialBack, Reachability, ReachabilityState, _receive, _send,
                                      dial_candidates)


def answer(peer, ok, at, addr=None, observed="198.18.0.100"):
    return DialBack(peer, ok, addr, observed, at)


def test_the_verdict_follows_fresh_answers():
    s = ReachabilityState(keep_s=100)
    assert s.status(0) == "unknown"
    s.record(answer("a", False, 0))
    assert s.status(1) == "private"
    s.record(answer("b", True, 5, "/ip4/198.18.0.10/tcp/4690"))
    assert s.status(6) == "public"  # one peer got through: dialable
    assert s.summary(6) == {"status": "public", "confirmed_by": ["b"], "refuted_by": ["a"],
                            "reached_at": ["/ip4/198.18.0.10/tcp/4690"], "observed": ["198.18.0.100"]}
    s.record(answer("b", False, 50))  # b's newest answer replaces its older one
    assert s.status(51) == "private"
    assert s.status(200) == "unknown"  # every answer has aged out


def test_peers_are_asked_once_per_recheck_period_whether_or_not_they_answered():
    s = ReachabilityState()
    assert s.to_ask(["a", "b", "c", "d"], 0, recheck_s=10, most=3) == ["a", "b", "c"]
    assert s.to_ask(["a", "b", "c", "d"], 1, recheck_s=10, most=3) == ["d"]
    assert s.to_ask(["a", "b", "c", "d"], 5, recheck_s=10) == []
    assert s.to_ask(["a", "d"], 10, recheck_s=10) == ["a"]  # asked at 0: due again; d at 1: not yet
    assert s.to_ask(["e"], 10, recheck_s=10) == ["e"]


def test_only_addresses_at_the_observed_ip_are_dialled():
    addrs = ["/ip4/192.168.1.2/tcp/4690/p2p/12D3KooWxyz", "/ip4/198.18.0.100/tcp/4001",
             "/ip4/0.0.0.0/tcp/4002", "/ip4/198.18.0.100/udp/4003", "garbage", "/ip4/198.18.0.100/tcp/4001"]
    assert dial_candidates(addrs, "198.18.0.100") == ["/ip4/198.18.0.100/tcp/4001", "/ip4/198.18.0.100/tcp/4002"]
    assert dial_candidates(addrs, "203.0.113.9") == ["/ip4/203.0.113.9/tcp/4002"]
    many = [f"/ip4/10.0.0.1/tcp/{p}" for p in range(1000, 1010)]
    assert len(dial_candidates(many, "10.0.0.1")) == 4


def test_status_lines():
    assert reach_line(None).startswith("reach     unknown")
    assert reach_line({"status": "public", "confirmed_by": ["a", "b"], "refuted_by": [], "observed": [],
                       "reached_at": ["/ip4/198.18.0.10/tcp/4690"]}) == \
        "reach     public: 2 peers dialled back /ip4/198.18.0.10/tcp/4690"
    assert reach_line({"status": "private", "confirmed_by": [], "refuted_by": ["a"], "reached_at": [],
                       "observed": ["198.18.0.100"]}) == "reach     private: 1 peer could not dial back; seen as 198.18.0.100"


async def test_a_listening_host_is_dialled_back_and_a_silent_one_is_not():
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as public, \
            open_host(create_new_key_pair(), []) as hidden:
        host_b = Reachability(server)
        server.set_stream_handler(DIALBACK_PROTOCOL, host_b.serve_stream)
        b_addr = full_addrs(server)[0]
        b_id = b_addr.split("/p2p/")[1]
        await connect(public, b_addr)
        await connect(hidden, b_addr)
        got = await Reachability(public).ask(b_id)
        assert got.reachable and got.addr == full_addrs(public)[0].split("/p2p/")[0] and got.observed == "127.0.0.1"
        with trio.fail_after(5):  # the probe's connection came, and goes with its throwaway host
            while len(public.get_connected_peers()) != 1:
                await trio.sleep(0.05)
        got = await Reachability(hidden).ask(b_id)
        assert not got.reachable and got.addr is None


async def test_a_peer_never_dials_an_address_away_from_the_asker():
    """A requester naming a third party's address (here another real listener) gets no dial."""
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.2/tcp/0"]) as victim, \
            open_host(create_new_key_pair(), []) as asker:
        server.set_stream_handler(DIALBACK_PROTOCOL, Reachability(server).serve_stream)
        b_addr = full_addrs(server)[0]
        pid = await connect(asker, b_addr)
        stream = await asker.new_stream(pid, [DIALBACK_PROTOCOL])
        await _send(stream, {"addrs": [a.split("/p2p/")[0] for a in full_addrs(victim)]})
        with trio.fail_after(10):
            ans = await _receive(stream)
        await stream.close()
        assert ans == {"reachable": False, "addr": None, "observed": "127.0.0.1", "dialled": []}
        assert victim.get_connected_peers() == []
