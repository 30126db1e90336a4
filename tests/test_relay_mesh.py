"""Daemons behind NAT reach each other through relays: three homes (0:10, 10:20, 20:30) and two
public bootstrap/relay daemons that hold no layers, on network test hosts with latency on the
internet links. Needs root, `ip` and `nft` (as tests/test_netns.py)."""

import json
import subprocess
import sys
import time

import pytest

from meshd.localmesh import Mesh, ctl
from meshd.testing.netns import open_testbed, unavailable_reason
from meshd.testing.netswitch import LinkSpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]
DELAY_MS = 10  # one way, per internet link
PROMPT = "The capital of France is"
TOKENS = 32
RANGES = [(0, 10), (10, 20), (20, 30)]


def reference(tokens: int) -> str:
    local = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--split", "10,20", "--max-tokens", str(tokens),
                            PROMPT], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    return local.stdout


def start_mesh(bed, mesh: Mesh, relays: int):
    pubs = []
    for i in range(relays):
        boot = [a for p in pubs for a in ("--bootstrap", p["addrs"][0])]
        d = mesh.start(f"pub{i}", ["--layers", "none", *boot], wrap=bed.wrap(f"pub{i}"),
                       listen=f"/ip4/{bed.addr(f'pub{i}')}/tcp/4690")
        pubs.append(d.wait_serving())
    boot = [a for p in pubs for a in ("--bootstrap", p["addrs"][0])]
    homes = [mesh.start(f"home{i}", ["--layers", f"{a}:{b}", "--threads", "1", *boot], wrap=bed.wrap(f"home{i}"),
                        listen=f"/ip4/{bed.addr(f'home{i}')}/tcp/4690")
             for i, (a, b) in enumerate(RANGES)]
    return pubs, homes


def relayed_everywhere(relays: int):
    def ok(s):
        peers = [p for p in s["peers"] if p["range"][0] != p["range"][1]]
        return (s["state"] == "serving" and s["complete"] and s["reachability"]["status"] == "private"
                and len(s["relay"]["client"]["relays"]) == relays
                and len(peers) == 2 and all(p["serving"] and p["relay_addrs"] for p in peers))
    return ok


def test_three_homes_behind_nat_generate_the_reference_text_through_a_relay():
    t0 = time.monotonic()
    with open_testbed(public=1, homes=3, delay_ms=DELAY_MS) as bed:
        mesh = Mesh()
        try:
            [pub], homes = start_mesh(bed, mesh, relays=1)
            sts = [h.wait_for(relayed_everywhere(1), timeout=120, what="coverage through the relay") for h in homes]
            covered_s = time.monotonic() - t0
            for st, home in zip(sts, homes):  # a home's record carries circuit addresses through the public relay
                [circuit] = st["relay"]["client"]["circuit_addrs"]
                assert circuit == f"{pub['addrs'][0]}/p2p-circuit/p2p/{st['peer_id']}"
                text = ctl(home.socket, ["status"]).stdout
                assert "reach     private" in text and f"relays    reserved at 1 of 2: {pub['peer_id'][-8:]}" in text
                assert f"  circuit {circuit}" in text
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
            print(f"three homes via one relay, {DELAY_MS} ms per link: coverage after {covered_s:.1f} s, "
                  f"ttft {stats['ttft_s']:.3f} s, decode {stats['decode_tok_per_s']:.1f} tok/s")
        finally:
            mesh.close()
