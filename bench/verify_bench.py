"""What checked generations cost the mesh: aggregate throughput with none checked, all checked, and
a share checked at the default --verify-rate, side by side in one run.

Five daemons (0:10, 10:20 twice, 20:30 twice: every layer has a replica, so a checked generation is
fully verified), SmolLM2 Q4_1 on the native lane, greedy, --tokens tokens past end-of-text. Each round
runs --clients concurrent generations in each arm, the arms alternating:
  plain     no generation checked
  checked   every generation checked (`meshctl generate --verify`)
  rate      each generation checked with probability --rate (drawn here, seeded, as the entry draws)
Aggregate tok/s = tokens the clients received / wall time of the round. From the medians it also
derives the drop at --rate from the all-checked cost c = plain / checked (a checked generation's
tokens cost c times as much): 1 - 1 / (1 + rate * (c - 1)); the measured `rate` arm needs many rounds
to resolve a 5% difference on a shared box, the derived figure does not.
Usage: python bench/verify_bench.py [--tokens 32] [--clients 4] [--rounds 2] [--rate 0.05]
Prints one line per round, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from meshd.cli.localmesh import Mesh

RANGES = [(0, 10), (10, 20), (10, 20), (20, 30), (20, 30)]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The best way to learn", "In 1969, the first", "import numpy as np\n", "Dear Sir or Madam,"]


def run_round(entry, prompts: list[str], tokens: int, verify: list[bool]) -> tuple[float, int, list[dict]]:
    """Concurrent generations, one a prompt: (aggregate tok/s, tokens, their stats)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(entry.socket), "generate",
                               "--max-tokens", str(tokens), "--ignore-eos", "--stats",
                               *(["--verify"] if v else []), p], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for p, v in zip(prompts, verify)]
    stats = []
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(err[-2000:])
        stats.append(json.loads(err.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    n = sum(s["tokens"] for s in stats)
    return n / wall, n, stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    draw = random.Random(22)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]
    results: dict[str, list[float]] = {"plain": [], "checked": [], "rate": []}
    checked_in_rate = 0
    mesh = Mesh(env={"MESHD_RECORD_TTL": "30"})
    try:
        entry = mesh.start_chain(RANGES, extra=["--threads", str(args.threads), "--verify-rate", "0"])[0]
        run_round(entry, prompts[:1], 4, [False])  # warm-up
        for r in range(args.rounds):
            for arm in ("plain", "checked", "rate"):
                verify = ([False] * args.clients if arm == "plain" else [True] * args.clients if arm == "checked"
                          else [draw.random() < args.rate for _ in range(args.clients)])
                tps, n, stats = run_round(entry, prompts, args.tokens, verify)
                if arm == "checked":
                    assert all(s["verified"] for s in stats), stats
                checked_in_rate += sum(verify) if arm == "rate" else 0
                results[arm].append(tps)
                print(f"round {r} {arm:8s} {tps:7.2f} tok/s aggregate ({n} tokens, {sum(verify)} checked)",
                      flush=True)
    finally:
        mesh.close()
    med = {arm: statistics.median(v) for arm, v in results.items()}
    cost = med["plain"] / med["checked"]
    derived = 1 - 1 / (1 + args.rate * (cost - 1))
    out = {"cpu": "avx2", "tokens": args.tokens, "clients": args.clients, "rounds": args.rounds, "rate": args.rate,
           "median_tok_per_s": {k: round(v, 3) for k, v in med.items()}, "runs": results,
           "checked_cost": round(cost, 3), "derived_drop_at_rate": round(derived, 4),
           "measured_drop_at_rate": round(1 - med["rate"] / med["plain"], 4), "checked_in_rate_arm": checked_in_rate}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
