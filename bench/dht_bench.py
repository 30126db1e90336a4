"""Kademlia lookups on a swarm of lightweight DHT nodes: real libp2p hosts (Noise, Yamux) on
127.0.0.1, all in this one process (so every node shares one core: rates are a floor, not what a
node on its own machine sees).

Each node dials 3 random earlier ones and looks itself up; a few owners publish records; then
every node looks every record up. Reports join time, lookups per second, success rate and
questions per lookup.
Usage: python bench/dht_bench.py [--nodes 64] [--records 8] [--k 20] [--parallel 6]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import trio

from meshd.core.log import setup_logging
from meshd.testing.dhtnet import open_swarm, run_all


async def measure(n: int, n_records: int, k: int, parallel: int) -> dict:
    t0 = time.perf_counter()
    async with open_swarm(n, degree=3, seed=1, k=k) as nodes:
        t_join = time.perf_counter() - t0
        owners = random.Random(1).sample(nodes, n_records)
        values = {o.key: o.signed(1, 600) for o in owners}
        t1 = time.perf_counter()
        stored = await run_all([lambda o=o: o.walker.put(o.key, values[o.key]) for o in owners], parallel)
        t_put = time.perf_counter() - t1
        jobs = [(node, key) for node in nodes for key in values if key != node.key]
        asked = sum(node.walker.queries for node in nodes)
        t2 = time.perf_counter()
        found = await run_all([lambda node=node, key=key: node.walker.get(key) for node, key in jobs], parallel)
        seconds = time.perf_counter() - t2
        questions = sum(node.walker.queries for node in nodes) - asked
        ok = sum(v == values[key] for (_, key), v in zip(jobs, found))
    return {"nodes": n, "records": n_records, "k": k, "join_s": round(t_join, 1), "put_s": round(t_put, 1),
            "stored_min": min(stored), "lookups": len(jobs), "lookup_s": round(seconds, 1),
            "lookups_per_s": round(len(jobs) / seconds, 1), "success": round(ok / len(jobs), 4),
            "questions_per_lookup": round(questions / len(jobs), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--records", type=int, default=8)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=6)
    args = ap.parse_args()
    setup_logging("WARNING")
    res = trio.run(measure, args.nodes, args.records, args.k, args.parallel)
    print(f"{res['nodes']} nodes (k={res['k']}) joined in {res['join_s']} s; {res['records']} records put in "
          f"{res['put_s']} s (each at >= {res['stored_min']} peers)")
    print(f"{'lookups':>8} {'seconds':>8} {'per s':>7} {'success':>8} {'questions each':>15}")
    print(f"{res['lookups']:>8} {res['lookup_s']:>8} {res['lookups_per_s']:>7} {res['success']:>8.2%} "
          f"{res['questions_per_lookup']:>15}")
    print(json.dumps({"bench": "dht", **res}))


if __name__ == "__main__":
    main()
