"""`python -m meshd.sim`: simulate a swarm, print the report (a table, or `--json`), draw `--plot`."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from meshd.sim.run import simulate, table
from meshd.sim.world import GB, Shape, WorldSpec, read_trace


def parse(argv=None) -> tuple[WorldSpec, argparse.Namespace]:
    d = WorldSpec()
    ap = argparse.ArgumentParser(prog="python -m meshd.sim", description=__doc__)
    ap.add_argument("--nodes", type=int, default=d.nodes, help="nodes online at once (seats)")
    ap.add_argument("--hours", type=float, default=d.hours, help="simulated hours")
    ap.add_argument("--model-layers", type=int, default=d.shape.n_layers)
    ap.add_argument("--layer-gb", type=float, default=d.shape.layer_bytes / GB, help="bytes of one layer, in GiB")
    ap.add_argument("--capacity", type=float, default=d.capacity,
                    help="layer slots of the serving nodes over the model's layer count")
    ap.add_argument("--session-median-min", type=float, default=d.session_median_min)
    ap.add_argument("--session-sigma", type=float, default=d.session_sigma)
    ap.add_argument("--nat-share", type=float, default=d.nat_share)
    ap.add_argument("--graceful-share", type=float, default=d.graceful_share)
    ap.add_argument("--requests-per-entry-min", type=float, default=d.requests_per_entry_min)
    ap.add_argument("--walks-per-hour", type=float, default=d.walks_per_hour)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--trace", help="CSV of node,join_s,leave_s rows instead of drawn sessions")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="PNG", help="draw coverage and load over time")
    a = ap.parse_args(argv)
    spec = replace(d, nodes=a.nodes, hours=a.hours, capacity=a.capacity,
                   shape=Shape(a.model_layers, int(a.layer_gb * GB)), session_median_min=a.session_median_min,
                   session_sigma=a.session_sigma, nat_share=a.nat_share, graceful_share=a.graceful_share,
                   requests_per_entry_min=a.requests_per_entry_min, walks_per_hour=a.walks_per_hour, seed=a.seed,
                   trace=read_trace(a.trace) if a.trace else None)
    return spec, a


def main(argv=None) -> None:
    spec, a = parse(argv)
    report, _ = simulate(spec)
    if a.plot:
        from meshd.sim.plot import draw

        report["plot"] = draw(report, a.plot)
    print(json.dumps(report) if a.json else table(report))


if __name__ == "__main__":
    main()
