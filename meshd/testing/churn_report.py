"""What a churn soak found (meshd.testing.churn): failed and wrong generations, latency percentiles per
phase and around restarts, hand-overs and reroutes, the faults, the entry's warnings: functions of
the soak's records and of the entry's log; nothing here runs a process.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

DOWN = {"kill": "down (SIGKILL)", "term": "down (SIGTERM)", "stop": "frozen"}

if TYPE_CHECKING:
    from meshd.testing.churn import Fault, Outcome, SoakPlan
    from meshd.cli.localmesh import DaemonProc


def entry_events(entry: DaemonProc) -> Counter:
    """The entry's warnings and errors, counted by their event (its JSON log lines)."""
    events: Counter = Counter()
    try:
        lines = entry.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return events
    for line in lines:
        if line.startswith("{") and ('"level": "warning"' in line or '"level": "error"' in line):
            try:
                events[json.loads(line).get("event", "?")] += 1
            except ValueError:
                pass
    return events


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latencies(outcomes: list[Outcome]) -> dict:
    lat = [o.latency_s for o in outcomes if o.code == 0]
    return {"n": len(lat), "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "max_s": max(lat, default=None)}


def during_restarts(outcomes: list[Outcome], faults: list[Fault]) -> dict:
    """Latencies of the chaos generations that overlapped a daemon's restart (from its start until it
    served: imports and loading, which take the box's cores) and of the others."""
    windows = [(f.back_at, f.serving_at if f.serving_at is not None else math.inf) for f in faults
               if f.kind != "stop" and f.back_at is not None]
    overlaps = [any(o.at < b and o.at + o.latency_s > a for a, b in windows) for o in outcomes]
    return {"during": latencies([o for o, x in zip(outcomes, overlaps) if x]),
            "outside": latencies([o for o, x in zip(outcomes, overlaps) if not x])}


def around(o: Outcome, faults: list[Fault]) -> list[str]:
    """What the chaos was doing while `o` ran: each daemon down or frozen, or restarting (until it served)."""
    inf = math.inf
    spans = [(f"{f.target} {DOWN[f.kind]}", f.at, f.back_at if f.back_at is not None else inf) for f in faults]
    spans += [(f"{f.target} restarting", f.back_at, f.serving_at if f.serving_at is not None else inf)
              for f in faults if f.kind != "stop" and f.back_at is not None]
    return [what for what, a, b in spans if o.at < b and o.at + o.latency_s > a]


def slowest(outcomes: list[Outcome], faults: list[Fault], n: int = 8) -> list[dict]:
    """The `n` slowest generations that came back, with the entry's view of them and the chaos around."""
    ok = sorted((o for o in outcomes if o.code == 0), key=lambda o: -o.latency_s)[:n]
    return [{"at": o.at, "latency_s": o.latency_s, "pause_s": o.pause_s, "ttft_s": o.stats.get("ttft_s"),
             "route_wait_s": o.stats.get("route_wait_s"), "reroutes": o.stats.get("reroutes", 0),
             "handovers": o.stats.get("handovers", 0), "load": round(o.load, 2), "around": around(o, faults)}
            for o in ok]


def phase_summary(outcomes: list[Outcome], texts: dict[str, str]) -> dict:
    ok = [o for o in outcomes if o.code == 0]
    lat = [o.latency_s for o in ok]
    return {"generations": len(outcomes), "failed": len(outcomes) - len(ok),
            "wrong": sum(o.text != texts.get(o.prompt) for o in ok),
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "max_s": max(lat, default=None),
            "longest_pause_s": max((o.pause_s for o in ok), default=None),
            "handovers": sum(o.stats.get("handovers", 0) for o in ok),
            "handover_fallbacks": sum(o.stats.get("handover_fallbacks", 0) for o in ok),
            "reroutes": sum(o.stats.get("reroutes", 0) for o in ok),
            "mean_load": round(sum(o.load for o in outcomes) / len(outcomes), 2) if outcomes else None}


def report(plan: SoakPlan, calm: list[Outcome], stormy: list[Outcome], faults: list[Fault], deferred: int,
           heal_s: float | None, healed: str, ends: dict, events: Counter) -> dict:
    """What the soak found: per phase, the generations, failed and wrong ones (against the calm mesh's
    first text for the prompt, so a calm generation that differs from it is wrong too), latencies,
    hand-overs and reroutes; the faults; whether and how fast the mesh healed (`ends`: each daemon's
    last status); the entry's warnings (`events`); the bad generations, and every one in short."""
    texts: dict[str, str] = {}
    for o in calm:
        if o.code == 0:
            texts.setdefault(o.prompt, o.text)
    bad = [o for o in stormy + calm if o.code != 0 or o.text != texts.get(o.prompt)]
    return {"plan": asdict(plan), "calm": phase_summary(calm, texts), "chaos": phase_summary(stormy, texts),
            "restart_split": during_restarts(stormy, faults), "slowest": slowest(stormy, faults), "faults": [asdict(f) for f in faults],
            "fault_counts": dict(Counter(f.kind for f in faults)), "deferred_fault_times": deferred,
            "healed": heal_s is not None, "heal_s": round(heal_s, 1) if heal_s is not None else None,
            "not_healed": healed,
            "daemon_handovers": {n: st.get("handovers") for n, st in ends.items()},
            "entry_warnings": dict(events),
            "bad": [{k: v for k, v in asdict(o).items() if k != "stats"} | {"expected": texts.get(o.prompt)}
                    for o in bad[:20]],
            "generations": [{"phase": o.phase, "client": o.client, "at": o.at, "latency_s": o.latency_s,
                             "pause_s": o.pause_s, "code": o.code, "wrong": o.code == 0 and o.text != texts.get(o.prompt),
                             "handovers": o.stats.get("handovers", 0), "reroutes": o.stats.get("reroutes", 0),
                             "ttft_s": o.stats.get("ttft_s"), "load": round(o.load, 2)}
                            for o in calm + stormy]}
