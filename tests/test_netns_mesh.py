"""Real daemons on separate network hosts: a public bootstrap and a daemon behind a home NAT, with
latency on the internet links. Needs root, `ip` and `nft` (as tests/test_netns.py)."""

import json
import subprocess
import sys

import pytest

from meshd.cli.localmesh import Mesh, ctl
from meshd.testing.netns import open_testbed, unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]
DELAY_MS = 15  # one way, per internet link: a home-public round trip crosses four of them
PROMPT = "The capital of France is"
TOKENS = 8


def test_a_home_daemon_joins_a_public_one_through_nat_and_generates_across_the_internet():
    with open_testbed(public=1, homes=1, delay_ms=DELAY_MS) as bed:
        mesh = Mesh()
        try:
            pub = mesh.start("pub", ["--layers", "15:30", "--threads", "1"], wrap=bed.wrap("pub0"),
                             listen=f"/ip4/{bed.addr('pub0')}/tcp/4690")
            pub_st = pub.wait_serving()
            assert pub_st["addrs"] == [f"/ip4/{bed.addr('pub0')}/tcp/4690/p2p/{pub_st['peer_id']}"]
            home = mesh.start("home", ["--layers", "0:15", "--threads", "1", "--bootstrap", pub_st["addrs"][0]],
                              wrap=bed.wrap("home0"), listen=f"/ip4/{bed.addr('home0')}/tcp/4690")
            st = home.wait_for(lambda s: s["state"] == "serving" and s["complete"], what="complete coverage")
            [peer] = st["peers"]  # the public daemon's signed record, fetched across the NAT
            assert peer["peer_id"] == pub_st["peer_id"] and peer["range"] == [15, 30] and peer["serving"]
            assert peer["addrs"] == pub_st["addrs"]
            assert peer["rtt_ms"] >= 4 * DELAY_MS  # the daemon measures the latency the bed adds
            # the public daemon sees the home one over the connection the home opened
            pub.wait_for(lambda s: [p["peer_id"] for p in s["peers"] if p["serving"]] == [st["peer_id"]],
                         timeout=30, what="the home daemon's record")
            # each learns by dial-back whether it can be dialled: the home one cannot
            reach = home.wait_for(lambda s: s["reachability"]["status"] == "private", timeout=30,
                                  what="private reachability")["reachability"]
            assert reach["refuted_by"] == [pub_st["peer_id"]] and reach["observed"] == [bed.addr("gw0")]
            reach = pub.wait_for(lambda s: s["reachability"]["status"] == "public", timeout=30,
                                 what="public reachability")["reachability"]
            assert reach["confirmed_by"] == [st["peer_id"]] and reach["reached_at"] == [f"/ip4/{bed.addr('pub0')}/tcp/4690"]
            assert f"reach     private: 1 peer could not dial back; seen as {bed.addr('gw0')}" in \
                ctl(home.socket, ["status"]).stdout
            out = ctl(home.socket, ["generate", "--max-tokens", str(TOKENS), "--stats", PROMPT], timeout=120)
            assert out.returncode == 0, out.stderr
            local = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--split", "15", "--max-tokens",
                                    str(TOKENS), PROMPT], capture_output=True, text=True, timeout=120)
            assert local.returncode == 0, local.stderr
            assert out.stdout == local.stdout and out.stdout.strip()
            stats = json.loads(out.stderr.strip().splitlines()[-1])
            assert stats["route"] == [[st["peer_id"], 0, 15], [pub_st["peer_id"], 15, 30]]
            print(f"home->public mesh, {DELAY_MS} ms per link: ttft {stats['ttft_s']:.3f} s, "
                  f"decode {stats['decode_tok_per_s']:.1f} tok/s, record rtt {peer['rtt_ms']} ms")
        finally:
            mesh.close()
