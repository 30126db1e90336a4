"""Daemons behind NAT reach each other through relays: three homes (0:10, 10:20, 20:30) and two
public bootstrap/relay daemons that hold no layers, on network test hosts with latency on the
internet links. Needs root, `ip` and `nft` (as tests/test_netns.py)."""

import json
import signal
import subprocess
import sys
import time

import pytest

from meshd.cli.localmesh import Mesh, ctl, local_text, read_rest
from meshd.testing.natmesh import covered_through_relays, start_nat_mesh
from meshd.testing.netns import open_testbed, unavailable_reason
from meshd.testing.netswitch import LinkSpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]
DELAY_MS = 10  # one way, per internet link
PROMPT = "The capital of France is"
TOKENS = 32
RANGES = [(0, 10), (10, 20), (20, 30)]


def reference(tokens: int) -> str:
    return local_text(PROMPT, tokens)


def start_mesh(bed, mesh: Mesh, relays: int, extra=(), homes_on_any=False):
    pubs, homes = start_nat_mesh(bed, mesh, RANGES, relays, extra, homes_on_any=homes_on_any)
    for i, p in enumerate(pubs):  # listening on 0.0.0.0, each publishes its interface address
        assert p["addrs"] == [f"/ip4/{bed.addr(f'pub{i}')}/tcp/4690/p2p/{p['peer_id']}"]
    return pubs, homes


def relayed_everywhere(relays: int):
    return covered_through_relays(relays, len(RANGES))


def test_three_homes_behind_nat_generate_the_reference_text_through_a_relay():
    t0 = time.monotonic()
    with open_testbed(public=1, homes=3, delay_ms=DELAY_MS) as bed:
        mesh = Mesh()
        try:
            [pub], homes = start_mesh(bed, mesh, relays=1, extra=["--hole-punch", "0"])
            sts = [h.wait_for(relayed_everywhere(1), timeout=120, what="coverage through the relay") for h in homes]
            covered_s = time.monotonic() - t0
            for st, home in zip(sts, homes):  # a home's record carries circuit addresses through the public relay
                [circuit] = st["relay"]["client"]["circuit_addrs"]
                assert circuit == f"{pub['addrs'][0]}/p2p-circuit/p2p/{st['peer_id']}"
                text = ctl(home.socket, ["status"]).stdout
                assert "reach     private" in text and f"relays    reserved at 1 of 2: {pub['peer_id'][-8:]}" in text
                assert f"  circuit {circuit}" in text
            for st in sts:  # ...and the public daemon's record names none: it is dialled directly
                [relay_peer] = [p for p in st["peers"] if p["peer_id"] == pub["peer_id"]]
                assert relay_peer["relay"] and relay_peer["relay_addrs"] == [] and relay_peer["addrs"] == pub["addrs"]
            pub_st = mesh.daemons[0].status()
            assert pub_st["reachability"]["status"] == "public"
            for p in pub_st["peers"]:  # the public daemon's own record names no circuit; the homes' do
                assert p["relay_addrs"]
            out = ctl(homes[0].socket, ["generate", "--max-tokens", str(TOKENS), "--stats", PROMPT], timeout=300)
            assert out.returncode == 0, out.stderr + homes[0].tail()
            assert out.stdout == reference(TOKENS) and out.stdout.strip()
            stats = json.loads(out.stderr.strip().splitlines()[-1])
            assert stats["route"] == [[st["peer_id"], a, b] for st, (a, b) in zip(sts, RANGES)]
            relayed = homes[0].status()["relay"]["relayed_peers"]
            assert set(relayed) >= {sts[1]["peer_id"], sts[2]["peer_id"]}  # the entry reached both hops through the relay
            svc = mesh.daemons[0].status()["relay"]["service"]
            assert svc["on"] and svc["reservations"] == 3 and svc["circuits"] >= 2 and svc["relayed_bytes"] > 0
            assert "relay     offered: 3 reservations" in ctl(mesh.daemons[0].socket, ["status"]).stdout
            # the public daemon holds no layers: it forwards a request to the home entry (over the connection the home opened)
            fwd = ctl(mesh.daemons[0].socket, ["generate", "--max-tokens", "8", PROMPT], timeout=300)
            assert fwd.returncode == 0 and fwd.stdout == reference(8), fwd.stderr
            print(f"three homes via one relay, {DELAY_MS} ms per link: coverage after {covered_s:.1f} s, "
                  f"ttft {stats['ttft_s']:.3f} s, decode {stats['decode_tok_per_s']:.1f} tok/s")
        finally:
            mesh.close()


def test_a_generation_crossing_a_relay_that_dies_finishes_with_the_same_text_and_the_relay_is_replaced():
    links = {"pub0": LinkSpec(0.003, 0.0), "pub1": LinkSpec(0.020, 0.0), "pub2": LinkSpec(0.030, 0.0)}
    with open_testbed(public=3, homes=3, delay_ms=DELAY_MS, links=links) as bed:
        mesh = Mesh()
        try:
            pubs, homes = start_mesh(bed, mesh, relays=3, extra=["--hole-punch", "0"])
            ids = [p["peer_id"] for p in pubs]
            # each home holds two reservations, at the nearest relays (pub0 and pub1)
            for h in homes:
                h.wait_for(lambda s: relayed_everywhere(2)(s)
                           and {r["peer_id"] for r in s["relay"]["client"]["relays"]} == {ids[0], ids[1]},
                           timeout=150, what="reservations at pub0 and pub1")
            proc = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(homes[0].socket), "generate",
                                     "--max-tokens", str(TOKENS * 2), "--stats", PROMPT],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                first = proc.stdout.read(8)  # text is flowing through pub0, the nearest relay
                circuits = mesh.daemons[0].status()["relay"]["service"]["circuits"]
                mesh.daemons[0].kill()
                rest, stall = read_rest(proc.stdout)  # the longest pause: the time the mesh took to recover
                err = proc.stderr.read()
                assert proc.wait(timeout=300) == 0, err + mesh.tails()
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert circuits >= 1  # the route crossed the relay that was killed
            assert first + rest == reference(TOKENS * 2)
            stats = json.loads(err.strip().splitlines()[-1])
            assert stats["reroutes"] >= 1
            # without an operator: every home drops the dead relay, reserves at pub2 and republishes
            sts = [h.wait_for(lambda s: {r["peer_id"] for r in s["relay"]["client"]["relays"]} == {ids[1], ids[2]},
                              timeout=60, what="reservations moved to pub2") for h in homes]
            for st in sts:
                assert st["relay"]["client"]["lost"] >= 1 and st["relay"]["client"]["replaced_in_s"]
                assert not any(ids[0] in a for a in st["relay"]["client"]["circuit_addrs"])
            homes[2].wait_for(lambda s: all(ids[0] not in a for p in s["peers"] for a in p["relay_addrs"]),
                              timeout=30, what="the homes' records without the dead relay")
            # a relay that freezes (SIGSTOP: its connections stay open, it answers nothing) is dropped too
            frozen = mesh.daemons[1].proc
            frozen.send_signal(signal.SIGSTOP)
            try:
                t_frozen = time.monotonic()
                for h in homes:
                    h.wait_for(lambda s: {r["peer_id"] for r in s["relay"]["client"]["relays"]} == {ids[2]}
                               and not any(ids[1] in a for a in s["relay"]["client"]["circuit_addrs"]),
                               timeout=60, what="the frozen relay dropped")
                frozen_s = time.monotonic() - t_frozen
            finally:
                frozen.send_signal(signal.SIGCONT)
            replaced = [st["relay"]["client"]["replaced_in_s"][-1] for st in sts]
            print(f"relay killed mid-generation: {stats['reroutes']} reroute(s), longest pause {stall:.2f} s; "
                  f"reservations replaced in {replaced} s; a frozen relay dropped by every home after {frozen_s:.1f} s")
        finally:
            mesh.close()


@pytest.mark.parametrize("nat", ["easy", "hard"])
def test_hole_punching_turns_relayed_connections_direct_where_the_nats_allow(nat):
    with open_testbed(public=1, homes=3, delay_ms=DELAY_MS, nat=nat) as bed:
        mesh = Mesh()
        try:
            [pub], homes = start_mesh(bed, mesh, relays=1, homes_on_any=True)  # as `meshd join` by default
            for i, h in enumerate(homes):
                st = h.wait_for(relayed_everywhere(1), timeout=150, what="coverage")
                assert st["addrs"] == [f"/ip4/{bed.addr(f'home{i}')}/tcp/4690/p2p/{st['peer_id']}"]
            if nat == "easy":  # routers that keep source ports: every pair of homes goes direct
                sts = [h.wait_for(lambda s: not s["relay"]["relayed_peers"], timeout=60, what="direct connections")
                       for h in homes]
                punch = [st["relay"]["hole_punch"] for st in sts]
                # three pairs of homes, all direct (above); a pair whose punches cross can end direct
                # through the other side's attempt, which neither side counts (seen once in CI: 2 of 3)
                assert sum(p["upgraded"] for p in punch) >= 2
                # status shows a home's own attempts; which side of a pair starts DCUtR varies by run
                puncher = next(h for h, p in zip(homes, punch) if p["attempts"])
                assert "hole punching:" in ctl(puncher.socket, ["status"]).stdout
            else:  # symmetric NATs: punches fail, the relay keeps carrying the traffic
                sts = [h.wait_for(lambda s: s["relay"]["hole_punch"]["attempts"] >= 1, timeout=60,
                                  what="a hole punch attempt") for h in homes]
                time.sleep(10)
                sts = [h.status() for h in homes]
                assert all(st["relay"]["hole_punch"]["upgraded"] == 0 for st in sts)
                assert all(len(st["relay"]["relayed_peers"]) == 2 for st in sts)
            out = ctl(homes[0].socket, ["generate", "--max-tokens", str(TOKENS), "--stats", PROMPT], timeout=300)
            assert out.returncode == 0, out.stderr + homes[0].tail()
            assert out.stdout == reference(TOKENS)
            stats = json.loads(out.stderr.strip().splitlines()[-1])
            relayed = homes[0].status()["relay"]["relayed_peers"]
            assert (relayed == []) if nat == "easy" else (len(relayed) == 2)
            print(f"{nat} NAT: hole punches {[st['relay']['hole_punch'] for st in sts]}; "
                  f"ttft {stats['ttft_s']:.3f} s, decode {stats['decode_tok_per_s']:.1f} tok/s")
        finally:
            mesh.close()
