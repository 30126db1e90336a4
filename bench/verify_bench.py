"""What checked generations cost the mesh: aggregate throughput, compute and a token's latency with no
generation checked, every one checked in lockstep (both routes decode every step), and every one checked by
prefill (a second route recomputes each finished window in one pass: meshd/entry/windows.py), side by side
in one run; and from those, the drop in aggregate throughput at --verify-rate 0.05, 0.25 and 1.0.

Per model, one entry and two servers of every further range (`--model smollm2`: 0:10, 10:20 x2, 20:30 x2;
`synthetic`: the 1.17 B model of meshd.testing.synthetic, its 16 layers in thirds), every daemon on the native
lane with --threads 1. Two entries serve the first range: one checks by prefill, one in lockstep (how an entry
checks is its own setting). Each round runs --clients concurrent generations in each arm, the arms alternating:
  off       no generation checked (the prefill entry)
  lockstep  every generation checked in lockstep (`meshctl generate --verify` at the lockstep entry)
  prefill   every generation checked by prefill, text released once checked
Each generation is --tokens greedy tokens past end-of-text, on prompts of its own (a few topics, not chosen
for the feature). Per arm: aggregate tok/s (tokens the clients received / wall time of the round), the
compute seconds every daemon spent per token (`compute_s` of their status, summed: wall time in tensor work)
and the CPU seconds their processes used per token (/proc: all their work), and a token's latency
(a generation's wall time / its tokens, median over generations). From the medians, the drop at a rate r
(a share r of generations checked, each costing c = off / checked times a plain one):
1 - 1 / (1 + r (c - 1)); a measured arm would need many rounds to resolve 5% on a shared box.
Usage: python bench/verify_bench.py [--model smollm2|synthetic|both] [--tokens 64] [--clients 4] [--rounds 2]
       [--window 16]
Prints one line per round and a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_flags

from meshd.cli.localmesh import Mesh
from meshd.shard.artifact import open_artifact

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The best way to learn", "In 1969, the first", "import numpy as np\n", "Dear Sir or Madam,"]
RATES = (0.05, 0.25, 1.0)
ARMS = ("off", "lockstep", "prefill")


def synthetic_model() -> str:
    from meshd.core.settings import default_cache_dir

    path = default_cache_dir() / "bench" / "synthetic-1b.q4_0.gguf"
    if not path.exists():
        from meshd.testing.synthetic import write_synthetic

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp)
        tmp.rename(path)
    return str(path)


def ranges_of(n_layers: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The entry's range and the others (each served twice)."""
    cuts = [0, n_layers // 3, 2 * n_layers // 3, n_layers]
    spans = list(zip(cuts, cuts[1:]))
    return spans[0], spans[1:]


def run_round(entry, prompts: list[str], tokens: int, verify: bool) -> tuple[float, int, list[dict], list[float]]:
    """Concurrent generations, one a prompt: (aggregate tok/s, tokens, their stats, seconds a token each)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(entry.socket), "generate",
                               "--max-tokens", str(tokens), "--ignore-eos", "--stats", *(["--verify"] if verify else []),
                               p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in prompts]
    stats, per_token = [], []
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(err[-2000:])
        stats.append(json.loads(err.strip().splitlines()[-1]))
        per_token.append((time.perf_counter() - t0) / max(1, stats[-1]["tokens"]))
    wall = time.perf_counter() - t0
    n = sum(s["tokens"] for s in stats)
    return n / wall, n, stats, per_token


def compute_s(daemons) -> float:
    """Seconds the daemons spent in tensor work (their status's `compute_s`: wall time, so it grows with the
    box's load as well as with the work)."""
    return sum(d.status()["compute_s"] for d in daemons)


def cpu_s(daemons) -> float:
    """CPU seconds the daemons' processes used, user and system (/proc/PID/stat): everything they did, the
    tensor work, the wire and Python alike, whatever else loads the box."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for d in daemons:
        with open(f"/proc/{d.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


def run_model(name: str, model: str, args) -> dict:
    art = open_artifact(model)
    head, rest = ranges_of(art.config.n_layers)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    mesh = Mesh(env={"MESHD_RECORD_TTL": "30"})
    common = ["--model", model, "--threads", "1", "--verify-rate", "0"]
    try:
        entry = mesh.start("prefill", ["--layers", f"{head[0]}:{head[1]}", *common, "--verify-by", "prefill",
                                       "--verify-window", str(args.window)])
        boot = ["--bootstrap", entry.wait_serving()["addrs"][0]]
        lock = mesh.start("lockstep", ["--layers", f"{head[0]}:{head[1]}", *common, "--verify-by", "lockstep", *boot])
        others = [mesh.start(f"s{i}{k}", ["--layers", f"{a}:{b}", *common, *boot])
                  for i, (a, b) in enumerate(rest) for k in range(2)]
        daemons = [entry, lock, *others]
        for e in (entry, lock):
            e.wait_for(lambda s: s["state"] == "serving" and s["complete"]
                       and sum(p["serving"] for p in s["peers"]) == len(daemons) - 1, what="every peer serving")
            run_round(e, prompts[:1], 4, True)  # warm-up: streams, tables and threads
        for r in range(args.rounds):
            for arm in ARMS:
                at = lock if arm == "lockstep" else entry
                before, cpu_before = compute_s(daemons), cpu_s(daemons)
                tps, n, stats, per_token = run_round(at, prompts, args.tokens, arm != "off")
                spent, cpu = compute_s(daemons) - before, cpu_s(daemons) - cpu_before
                if arm != "off":
                    assert all(s["verified"] and s["disagreements"] == 0 for s in stats), stats
                runs[arm].append({"tok_per_s": tps, "tokens": n, "compute_s_per_token": spent / n,
                                  "cpu_s_per_token": cpu / n, "s_per_token": statistics.median(per_token)})
                print(f"{name} round {r} {arm:8s} {tps:7.2f} tok/s aggregate, {1000 * spent / n:6.1f} ms compute"
                      f" and {1000 * cpu / n:6.1f} ms CPU a token, {1000 * statistics.median(per_token):6.1f} ms a"
                      f" token ({n} tokens)", flush=True)
    finally:
        mesh.close()
    med = {arm: {k: statistics.median(x[k] for x in v)
                 for k in ("tok_per_s", "compute_s_per_token", "cpu_s_per_token", "s_per_token")}
           for arm, v in runs.items()}
    out = {"model": name, "median": {a: {k: round(v, 5) for k, v in m.items()} for a, m in med.items()}, "runs": runs}
    for arm in ("lockstep", "prefill"):
        cost = med["off"]["tok_per_s"] / med[arm]["tok_per_s"]
        out[arm] = {"throughput_cost": round(cost, 3),
                    "compute_ratio": round(med[arm]["compute_s_per_token"] / med["off"]["compute_s_per_token"], 3),
                    "cpu_ratio": round(med[arm]["cpu_s_per_token"] / med["off"]["cpu_s_per_token"], 3),
                    "latency_added_ms": round(1000 * (med[arm]["s_per_token"] - med["off"]["s_per_token"]), 2),
                    "drop_at_rate": {str(rate): round(1 - 1 / (1 + rate * (cost - 1)), 4) for rate in RATES}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "synthetic", "both"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", type=int, default=16, help="the prefill entry's --verify-window")
    args = ap.parse_args()
    names = ["smollm2", "synthetic"] if args.model == "both" else [args.model]
    results = [run_model(name, "smollm2" if name == "smollm2" else synthetic_model(), args) for name in names]
    print(f"\n{'model':9s} {'arm':9s} {'tok/s':>8s} {'compute/tok':>12s} {'CPU/tok':>9s} {'ms/token':>9s}"
          f" {'cost':>6s} {'compute x':>9s} {'CPU x':>6s} {'drop@0.05':>9s} {'drop@0.25':>9s} {'drop@1':>7s}")
    for res in results:
        for arm in ARMS:
            m, extra = res["median"][arm], res.get(arm, {})
            drops = extra.get("drop_at_rate", {})
            print(f"{res['model']:9s} {arm:9s} {m['tok_per_s']:8.2f} {1000 * m['compute_s_per_token']:10.1f}ms"
                  f" {1000 * m['cpu_s_per_token']:7.1f}ms {1000 * m['s_per_token']:9.1f}"
                  f" {extra.get('throughput_cost', 1.0):6.2f} {extra.get('compute_ratio', 1.0):9.2f}"
                  f" {extra.get('cpu_ratio', 1.0):6.2f} {drops.get('0.05', 0):9.3f} {drops.get('0.25', 0):9.3f}"
                  f" {drops.get('1.0', 0):7.3f}")
    print(json.dumps({"cpu": cpu_flags(), "tokens": args.tokens, "clients": args.clients, "rounds": args.rounds,
                      "window": args.window,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
