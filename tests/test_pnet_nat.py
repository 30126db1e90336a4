"""A private mesh behind NAT: three homes and a public relay, all holding the key, on network test
hosts (as tests/test_relay_mesh.py), generate the reference text through the relay and after hole
punching; a public daemon without the key, offering to relay, is never used. Needs root, `ip`
and `nft` (as tests/test_netns.py)."""

import json

import pytest

from meshd.p2p.swarmkey import write_new_swarm_key
from meshd.cli.localmesh import Mesh, ctl, local_text
from meshd.testing.natmesh import PORT, covered_through_relays, start_nat_mesh
from meshd.testing.netns import open_testbed, unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]
DELAY_MS = 10  # one way, per internet link
PROMPT = "The capital of France is"
TOKENS = 16
RANGES = [(0, 10), (10, 20), (20, 30)]
REFUSAL = "refused a connection without the mesh's key from"


def reference(tokens: int) -> str:
    return local_text(PROMPT, tokens)


def generate(home) -> dict:
    out = ctl(home.socket, ["generate", "--max-tokens", str(TOKENS), "--stats", PROMPT], timeout=300)
    assert out.returncode == 0, out.stderr + home.tail()
    assert out.stdout == reference(TOKENS) and out.stdout.strip()
    return json.loads(out.stderr.strip().splitlines()[-1])


def test_keyed_homes_behind_nat_generate_through_a_member_relay_and_never_use_a_non_member_one():
    with open_testbed(public=2, homes=3, delay_ms=DELAY_MS) as bed:
        mesh = Mesh()
        try:
            key = write_new_swarm_key(mesh.root / "swarm.key")
            outsider = mesh.start("outsider", ["--layers", "none", "--relay", "on"], wrap=bed.wrap("pub1"),
                                  listen=f"/ip4/0.0.0.0/tcp/{PORT}")
            stranger = outsider.wait_serving()["addrs"][0]
            [pub], homes = start_nat_mesh(bed, mesh, RANGES, relays=1, pub_extra=["--swarm-key", key.path],
                                          extra=["--swarm-key", key.path, "--hole-punch", "0", "--bootstrap", stranger])
            sts = [h.wait_for(covered_through_relays(1, len(RANGES)), timeout=150, what="coverage through the relay")
                   for h in homes]
            for st in sts:
                assert [r["peer_id"] for r in st["relay"]["client"]["relays"]] == [pub["peer_id"]]
                assert st["mesh_key"]["fingerprint"] == key.fingerprint and st["mesh_key"]["refused"] >= 1
            stats = generate(homes[0])
            assert stats["route"] == [[st["peer_id"], a, b] for st, (a, b) in zip(sts, RANGES)]
            assert set(homes[0].status()["relay"]["relayed_peers"]) >= {sts[1]["peer_id"], sts[2]["peer_id"]}
            svc = mesh.daemons[1].status()["relay"]["service"]  # the member relay carried the circuits
            assert svc["reservations"] == 3 and svc["relayed_bytes"] > 0
            out_st = outsider.status()  # the non-member relay: never reached, never used
            assert out_st["peers"] == [] and out_st["relay"]["service"]["reservations"] == 0
            assert out_st["relay"]["service"]["served"] == 0
            assert all(any(REFUSAL in line for line in h.tail(400).splitlines()) for h in homes)
            print(f"private mesh through a relay: ttft {stats['ttft_s']:.3f} s, "
                  f"decode {stats['decode_tok_per_s']:.1f} tok/s")
        finally:
            mesh.close()


def test_keyed_homes_behind_nat_punch_holes_and_generate_over_direct_connections():
    with open_testbed(public=1, homes=3, delay_ms=DELAY_MS, nat="easy") as bed:
        mesh = Mesh()
        try:
            key = write_new_swarm_key(mesh.root / "swarm.key")
            [pub], homes = start_nat_mesh(bed, mesh, RANGES, relays=1, homes_on_any=True,
                                          pub_extra=["--swarm-key", key.path], extra=["--swarm-key", key.path])
            for h in homes:
                h.wait_for(covered_through_relays(1, len(RANGES)), timeout=150, what="coverage")
            sts = [h.wait_for(lambda s: not s["relay"]["relayed_peers"], timeout=90, what="direct connections")
                   for h in homes]
            assert sum(st["relay"]["hole_punch"]["upgraded"] for st in sts) >= 2  # as tests/test_relay_mesh.py
            stats = generate(homes[0])
            assert homes[0].status()["relay"]["relayed_peers"] == []
            # (a direct connection between two homes exists only if both sides ran pnet on it: members only)
            print(f"private mesh after hole punching: {[st['relay']['hole_punch'] for st in sts]}; "
                  f"ttft {stats['ttft_s']:.3f} s, decode {stats['decode_tok_per_s']:.1f} tok/s")
        finally:
            mesh.close()
