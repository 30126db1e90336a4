"""Daemons behind NAT: three homes (0:10, 10:20, 20:30) behind their own routers, public
bootstrap/relay daemons without layers, on network test hosts with --delay-ms one way per internet link.

Modes, side by side in one run:
  relay   hole punching off: every hop goes through the relay
  direct  hole punching on (routers that keep source ports): hops go direct once punched
  death   two relays, hole punching off; the nearer relay is SIGKILLed mid-generation
For each: seconds from the first daemon's start to complete coverage at the entry; --runs generations
of --tokens greedy tokens: median time to first token and decode tok/s; hole punches; for `death`,
the longest pause the client saw and how fast the homes held two reservations again.
Needs root, `ip` and `nft`. Usage: python bench/relay_bench.py [--delay-ms 10] [--tokens 32] [--runs 3]
[--modes relay,direct,death]. Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from meshd.cli.localmesh import Mesh, read_rest
from meshd.testing.natmesh import covered_through_relays, start_nat_mesh
from meshd.testing.netns import open_testbed
from meshd.testing.netswitch import LinkSpec

RANGES = [(0, 10), (10, 20), (20, 30)]
PROMPT = "The capital of France is"


def start_generation(home, tokens: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(home.socket), "generate",
                             "--max-tokens", str(tokens), "--ignore-eos", "--stats", PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, on_first=None) -> tuple[dict, float]:
    """A generation's stats and the longest pause between its output characters after the first."""
    first = proc.stdout.read(1)
    if on_first:
        on_first()
    _, stall = read_rest(proc.stdout)
    err = proc.stderr.read()
    if proc.wait(timeout=600) != 0 or not first:
        raise RuntimeError(f"generation failed: {err[-2000:]}")
    return json.loads(err.strip().splitlines()[-1]), stall


def run_mode(mode: str, args) -> dict:
    relays = 2 if mode == "death" else 1
    links = {"pub0": LinkSpec(args.delay_ms / 2000, 0.0), "pub1": LinkSpec(args.delay_ms * 2 / 1000, 0.0)}
    extra = ["--hole-punch", "1" if mode == "direct" else "0"]
    with open_testbed(public=relays, homes=3, delay_ms=args.delay_ms, links=links) as bed:
        mesh = Mesh()
        try:
            t0 = time.monotonic()
            pubs, homes = start_nat_mesh(bed, mesh, RANGES, relays, extra)
            for h in homes:
                h.wait_for(covered_through_relays(relays, len(RANGES)), timeout=300, what="coverage through relays")
            covered_s = time.monotonic() - t0
            if mode == "direct":
                for h in homes:
                    h.wait_for(lambda s: not s["relay"]["relayed_peers"], timeout=120, what="direct connections")
            out = {"mode": mode, "covered_s": round(covered_s, 1)}
            if mode == "death":
                stats, stall = finish(start_generation(homes[0], args.tokens * 2), on_first=mesh.daemons[0].kill)
                sts = [h.wait_for(lambda s: len(s["relay"]["client"]["relays"]) == 1 and s["relay"]["client"]["lost"],
                                  timeout=60, what="the dead relay dropped") for h in homes]
                out.update(reroutes=stats["reroutes"], longest_pause_s=round(stall, 2),
                           dropped_relay=[st["relay"]["client"]["lost"] for st in sts])
                return out
            runs = [finish(start_generation(homes[0], args.tokens))[0] for _ in range(args.runs)]
            punch = [h.status()["relay"]["hole_punch"] for h in homes]
            out.update(ttft_s=round(statistics.median(r["ttft_s"] for r in runs), 3),
                       decode_tok_per_s=round(statistics.median(r["decode_tok_per_s"] for r in runs), 2),
                       hole_punch=punch, relayed_peers=len(homes[0].status()["relay"]["relayed_peers"]))
            return out
        finally:
            mesh.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="relay,direct,death")
    args = p.parse_args()
    results = [run_mode(m, args) for m in args.modes.split(",")]
    print(f"three homes behind NAT, {args.delay_ms:g} ms one way per internet link, {args.tokens} tokens,"
          f" median of {args.runs}")
    print(f"{'mode':7} {'covered s':>9} {'ttft s':>7} {'tok/s':>6}  other")
    for r in results:
        other = {k: v for k, v in r.items() if k not in ("mode", "covered_s", "ttft_s", "decode_tok_per_s")}
        print(f"{r['mode']:7} {r['covered_s']:>9} {r.get('ttft_s', '-'):>7} {r.get('decode_tok_per_s', '-'):>6}  {other}")
    print(json.dumps({"delay_ms": args.delay_ms, "tokens": args.tokens, "runs": args.runs, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
