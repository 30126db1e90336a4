"""A hostile peer against the 10:20 daemon of a three-daemon loopback mesh (SmolLM2, native lane).

Per attack: the victim's RSS before, at its peak and after the attacker left (within 30 s), the
longest heartbeat echo the attacker's second stream saw during the attack, and an honest greedy
generation's time during the attack and just after it (with whether its text matched the one
before any attack). The attacks are those of issue 26: zstd bombs, half-sent frames, a session
flood, many idle streams, wrong dtypes. Extra daemon flags (the limits) go after `--`.
Usage: python bench/hostile_bench.py [--bombs 20] [--bomb-mb 62] [--half-mb 64] [--runs 1] [-- --frame-budget-mb 64 ...]
Prints a table, then one JSON object on the last line (medians over runs per attack).
"""

from __future__ import annotations

import argparse
import json
import statistics

from meshd.testing.hostile_run import honest_generation, run_attack
from meshd.cli.localmesh import Mesh

HIDDEN = 576


def attacks(args) -> dict:
    return {
        "zstd bombs": lambda p: p.zstd_bombs(args.bombs, args.bomb_mb << 20, HIDDEN, 10, 20),
        "half frames": lambda p: p.half_frames(16, args.half_mb << 20, 4 << 20),
        "session flood": lambda p: p.flood_sessions(200, 10, 20),
        "idle streams": lambda p: p.many_streams(300),
        "wrong dtypes": lambda p: _dtypes(p),
    }


async def _dtypes(peer) -> list:
    return [await peer.wrong_dtype(d, HIDDEN, 10, 20) for d in ("int64", "float16", "bfloat16")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bombs", type=int, default=20)
    ap.add_argument("--bomb-mb", type=int, default=62)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--half-mb", type=int, default=64, help="MiB each half-sent frame declares (4 MiB of it sent)")
    ap.add_argument("--settle-to", type=float, default=1.10, help="'after' is the RSS once within this factor of"
                    " 'before', or at 30 s")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    ap.add_argument("flags", nargs="*", help="daemon flags (after --)")
    args = ap.parse_args()
    mesh = Mesh()
    rows: dict[str, list[dict]] = {}
    try:
        a, b, _ = mesh.start_chain([(0, 10), (10, 20), (20, 30)], extra=["--threads", "1", *args.flags])
        reference = honest_generation(a.socket, None)
        assert reference.ok, reference.stderr
        chosen = attacks(args)
        if args.only:
            chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
        for _ in range(args.runs):
            for name, attack in chosen.items():
                hold = 3.0 if name in ("half frames", "idle streams", "session flood") else 0.0
                report = run_attack(name, b.proc.pid, b.addr, a.socket, reference.text, attack, hold_s=hold,
                                    settle_to=args.settle_to)
                rows.setdefault(name, []).append(report.row())
                print(json.dumps(report.row()), flush=True)
    finally:
        mesh.close()
    cols = ["rss_before_mb", "rss_peak_mb", "rss_after_mb", "echo_max_s", "honest_during_s", "honest_after_s"]
    print(f"{'attack':<15}" + "".join(f"{c:>17}" for c in cols) + "  ok")
    summary = {}
    for name, rs in rows.items():
        med = {c: statistics.median(r[c] for r in rs) for c in cols}
        med["ok"] = all(r["honest_during_ok"] and r["honest_after_ok"] for r in rs)
        med["peak_over_before"] = round(med["rss_peak_mb"] / med["rss_before_mb"], 3)
        summary[name] = med
        print(f"{name:<15}" + "".join(f"{med[c]:>17}" for c in cols) + f"  {med['ok']}")
    print(json.dumps({"runs": args.runs, "flags": args.flags, "attacks": summary}))


if __name__ == "__main__":
    main()
