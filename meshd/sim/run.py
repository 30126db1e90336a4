"""One simulated run: a world, its swarm and traffic, run to the end; the report as a dict and a table.

Rule: a run is a pure function of its `WorldSpec` (the seed included) apart from `wall_s`, the
seconds it took on this machine, which `deterministic` leaves out.
"""

from __future__ import annotations

import time

from meshd.sim.dht import hops_bound
from meshd.sim.metrics import HOUR
from meshd.sim.swarm import Swarm
from meshd.sim.traffic import Traffic
from meshd.sim.world import WorldSpec

KEYS = ("covered_1", "covered_2", "covered_1_formed", "heal_s_p50", "heal_s_p99", "moves_per_node_hour", "lookup_success",
        "lookup_hops_p99", "route_over_best_p50", "route_over_best_p99", "load_max_over_mean",
        "requests_failed_share")


def simulate(spec: WorldSpec) -> tuple[dict, Swarm]:
    """Run `spec` to its end; the report and the swarm as it ended."""
    t0 = time.perf_counter()
    swarm = Swarm(spec)
    traffic = Traffic(swarm)
    swarm.populate()
    traffic.start()
    events = swarm.clock.run_until(spec.hours * HOUR)
    swarm.metrics.advance(spec.hours * HOUR)
    wall = time.perf_counter() - t0
    m = swarm.metrics
    out = {"nodes": spec.nodes if not spec.trace else spec.seats(), "hours": spec.hours,
           "model_layers": spec.shape.n_layers, "capacity": spec.capacity,
           "session_median_min": spec.session_median_min, "nat_share": spec.nat_share, "seed": spec.seed,
           "server_seats": swarm.n_server_seats, "formed_s": None if m.formed_at is None else round(m.formed_at, 1),
           **m.summary(), "events": events, "wall_s": round(wall, 2),
           "wall_s_per_sim_hour": round(wall / max(spec.hours, 1e-9), 3),
           "lookup_hops_bound": round(hops_bound(spec.seats()), 2),
           "move_reasons": dict(m.reasons),
           "sampling": f"DHT lookups sampled at {spec.walks_per_hour:g} an hour (not one per publish and refresh);"
                       f" routes priced for every request; load sampled every minute",
           "per_hour": [{"hour": i, **m.summary([h])} for i, h in enumerate(m.hours)]}
    return out, swarm


def deterministic(report: dict) -> dict:
    """The report without what depends on this machine (wall times)."""
    return {k: v for k, v in report.items() if not k.startswith("wall_s")}


def table(report: dict) -> str:
    """The report as a readable table: the totals, then one row per simulated hour."""
    lines = [f"meshd.sim: {report['nodes']} nodes, {report['hours']:g} h, {report['model_layers']} layers, "
             f"capacity {report['capacity']:g}x ({report['server_seats']} serving seats), sessions "
             f"{report['session_median_min']:g} min median, NAT {report['nat_share']:.0%}, seed {report['seed']}"]
    for k in (*KEYS, "lookup_hops_bound", "heals", "moves", "moves_back", "move_reasons", "lookups", "requests", "requests_busy_share",
              "formed_s", "events", "wall_s", "wall_s_per_sim_hour"):
        lines.append(f"  {k:<24} {report[k]}")
    lines.append(f"  ({report['sampling']})")
    cols = ("covered_1", "covered_2", "heals", "heal_s_p50", "moves_per_node_hour", "lookup_success",
            "lookup_hops_p99", "route_over_best_p50", "load_max_over_mean", "requests", "requests_failed_share")
    lines.append("  hour " + " ".join(f"{c[:12]:>12}" for c in cols))
    for row in report["per_hour"]:
        lines.append(f"  {row['hour']:>4} " + " ".join(f"{'-' if row[c] is None else row[c]!s:>12}" for c in cols))
    return "\n".join(lines)
