"""Churn soak: does a mesh under churn leave a trace on its users? (issue 36)

Six daemons on loopback (two for each third of SmolLM2, `--threads 1`, records of 8 s), three clients
generating 40-token greedy texts without pause through one entry: first a calm phase, which gives each
prompt's reference text and the calm latencies, then `--minutes` of chaos, a fault every ~15 s on one
daemon (never the entry, never the last server of a range up): SIGKILL and a restart 8 s later from
its state directory, SIGSTOP for 6 s, or SIGTERM (it hands its sessions over and leaves) and a restart.
At the end, the mesh must heal: every daemon serving, every layer served twice. On loopback a restarting
daemon's imports take the cores of the daemons serving (in a real mesh, other machines); `--restart-nice N`
runs it at nice N until it serves, but on a loaded box (load ~11 on 2 cores) nice 15 made restarts take 2-3
minutes, so it is off by default. Other work on the box counts in every figure: each generation's record
carries the load average when it began.
Latency: a client's wall time for one `meshctl generate` (its process start included); pause: the
longest wait between two characters it read. Goals: 0 failed, 0 wrong, chaos p99 <= calm p99 + 2 s.
Usage: python bench/churn_bench.py [--minutes 4] [--seed 0] [--clients 3] [--tokens 40] [--period 15]
       [--calm-seconds 45] [--aim busy|any] [--restart-nice 0] [--out FILE.json] [--keep-logs DIR]
Prints a table, then one JSON object on the last line; exits 1 when a generation failed or went wrong
or the mesh did not heal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import cpu_flags

from meshd.shard import blocks
from meshd.testing.churn import SoakPlan, run_soak

P99_SLACK_S = 2.0


def seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_table(res: dict) -> None:
    print(f"\n{'phase':<6} {'gens':>5} {'failed':>6} {'wrong':>5} {'p50 s':>6} {'p99 s':>6} {'max s':>6}"
          f" {'pause s':>7} {'handovers':>9} {'fallbacks':>9} {'reroutes':>8} {'mean load':>9}")
    for phase in ("calm", "chaos"):
        r = res[phase]
        print(f"{phase:<6} {r['generations']:>5} {r['failed']:>6} {r['wrong']:>5} {seconds(r['p50_s']):>6}"
              f" {seconds(r['p99_s']):>6} {seconds(r['max_s']):>6} {seconds(r['longest_pause_s']):>7}"
              f" {r['handovers']:>9} {r['handover_fallbacks']:>9} {r['reroutes']:>8} {r['mean_load']:>9}")
    print(f"\nfaults ({', '.join(f'{k} {v}' for k, v in sorted(res['fault_counts'].items()))};"
          f" {res['deferred_fault_times']} fault times deferred, no daemon could be faulted):")
    for f in res["faults"]:
        left = f", left in {f['left_s']:.2f} s" if f["left_s"] is not None else ""
        served = f", serving at {f['serving_at']:.1f} s" if f["serving_at"] is not None else ""
        print(f"  {f['at']:7.1f} s  {f['kind']:<4} {f['target']} ({f['sessions']} sessions open){left},"
              f" back at {seconds(f['back_at'])} s{served}{'  ' + f['note'] if f['note'] else ''}")
    split = res["restart_split"]
    print("chaos latencies, generations overlapping a restart (its start until it serves) / the others: "
          + " / ".join(f"n {split[k]['n']}, p50 {seconds(split[k]['p50_s'])} s, p99 {seconds(split[k]['p99_s'])} s"
                       for k in ("during", "outside")))
    print("slowest under chaos (at s: latency s, longest pause s, ttft s, reroutes, hand-overs, load; around it):")
    for g in res["slowest"]:
        print(f"  {g['at']:7.1f}: {g['latency_s']:.2f}, {g['pause_s']:.2f}, {seconds(g['ttft_s'])}, {g['reroutes']},"
              f" {g['handovers']}, {g['load']:.1f}; {', '.join(g['around']) or 'no fault in progress'}")
    print(f"healed: {'yes, in %.1f s' % res['heal_s'] if res['healed'] else 'NO: ' + res['not_healed']}")
    if res["entry_warnings"]:
        print(f"entry's warnings: {json.dumps(res['entry_warnings'])}")
    for b in res["bad"]:
        what = f"exit {b['code']}: {b['error']}" if b["code"] else f"WRONG TEXT {b['text']!r} (calm {b['expected']!r})"
        print(f"  !!! {b['phase']} client {b['client']} at {b['at']:.1f} s, {b['prompt']!r}: {what}")


def goals(res: dict) -> dict:
    calm, chaos = res["calm"], res["chaos"]
    tail = chaos["p99_s"] is not None and calm["p99_s"] is not None and chaos["p99_s"] <= calm["p99_s"] + P99_SLACK_S
    return {"no_failed": chaos["failed"] == 0 and calm["failed"] == 0,
            "no_wrong": chaos["wrong"] == 0 and calm["wrong"] == 0, "p99_within_calm_plus_2s": tail,
            "healed": res["healed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="minutes of chaos")
    p.add_argument("--seed", type=int, default=0, help="the faults' kinds, targets and times")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--period", type=float, default=15.0, help="seconds between faults, give or take a fifth")
    p.add_argument("--calm-seconds", type=float, default=45.0, help="at least, and until every prompt has its text")
    p.add_argument("--aim", choices=["busy", "any"], default="busy",
                   help="fault a daemon with sessions open when one is (busy), or any that may go")
    p.add_argument("--restart-nice", type=int, default=0, help="a restarted daemon's nice value until it serves (0: none)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--keep-logs", type=Path, help="keep the daemons' logs under this directory")
    args = p.parse_args()
    if args.keep_logs:
        os.environ["MESHD_KEEP_LOGS"] = str(args.keep_logs)  # read by Mesh.close
    plan = SoakPlan(clients=args.clients, tokens=args.tokens, calm_s=args.calm_seconds, chaos_s=args.minutes * 60,
                    period_s=args.period, seed=args.seed, aim=args.aim,
                    restart_nice=args.restart_nice)
    t0 = time.monotonic()
    res = run_soak(plan)
    met = goals(res)
    flags = cpu_flags()
    print(f"churn soak: {len(plan.ranges)} daemons {' '.join('%d:%d' % r for r in plan.ranges)} (--threads 1),"
          f" {plan.clients} clients x {plan.tokens} tokens greedy through d0, {args.minutes:g} min of chaos,"
          f" seed {plan.seed}, aim {plan.aim}, restarts at nice {plan.restart_nice} until serving; CPU flags: {' '.join(flags)}; meshd kernel {blocks.isa()};"
          f" {len(os.sched_getaffinity(0))} cores; {time.monotonic() - t0:.0f} s in all")
    print_table(res)
    calm, chaos = res["calm"], res["chaos"]
    ratio = round(chaos["p99_s"] / calm["p99_s"], 2) if chaos["p99_s"] and calm["p99_s"] else None
    print(f"goals: 0 failed {'met' if met['no_failed'] else 'NOT met'}; 0 wrong {'met' if met['no_wrong'] else 'NOT met'};"
          f" chaos p99 {seconds(chaos['p99_s'])} s <= calm p99 {seconds(calm['p99_s'])} s + {P99_SLACK_S:g} s"
          f" {'met' if met['p99_within_calm_plus_2s'] else 'NOT met'} (ratio {ratio});"
          f" median chaos/calm {round(chaos['p50_s'] / calm['p50_s'], 2) if chaos['p50_s'] and calm['p50_s'] else None}")
    result = {"bench": "churn", "argv": sys.argv[1:], "cpu_flags": flags, "isa": blocks.isa(),
              "cores": len(os.sched_getaffinity(0)), "seconds": round(time.monotonic() - t0), "goals": met,
              "p99_ratio": ratio, **res}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if met["no_failed"] and met["no_wrong"] and met["healed"] else 1


if __name__ == "__main__":
    sys.exit(main())
