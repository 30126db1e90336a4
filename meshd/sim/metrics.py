"""What a simulated run measured, whole and per simulated hour, and the report built from it.

Rules: coverage is the truth (servers alive and loaded), not any node's view of it; a time share is
weighted by time; a heal is one loss (the layers whose last server went at one moment) until every
one of those layers is served again; moves and node-hours count from the moment the swarm first
covered every layer (formation), node-hours of serving nodes only (the others never move).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

HOUR = 3600.0


def pct(values, q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`; None when there are none."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Hour:
    t1: float = 0.0  # seconds every layer had a server
    t2: float = 0.0
    seconds: float = 0.0
    moves: int = 0
    flaps: int = 0  # moves back to a range the node had left
    node_s: float = 0.0  # serving-node seconds after formation
    formed: float = 0.0  # seconds after formation
    t1_formed: float = 0.0  # of them, seconds every layer had a server
    heals: list = field(default_factory=list)
    walks: list = field(default_factory=list)  # (ok, hops, questions)
    ratios: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    requests: Counter = field(default_factory=Counter)


class Metrics:
    def __init__(self, n_layers: int, hours: float) -> None:
        self.n_layers = n_layers
        self.hours = [Hour() for _ in range(max(1, math.ceil(hours)))]
        self.last_t, self.min_count, self.n_serving = 0.0, 0, 0
        self.formed_at: float | None = None
        self.prev = [0] * n_layers
        self.loss_of: dict[int, int] = {}  # layer -> loss id
        self.losses: dict[int, tuple[float, set[int]]] = {}  # loss id -> (start, layers not yet served)
        self._loss_id = 0
        self.reasons: Counter = Counter()

    def hour(self, t: float) -> Hour:
        return self.hours[min(len(self.hours) - 1, int(t // HOUR))]

    def advance(self, now: float) -> None:
        """Account the time since the last change to the state that held through it."""
        t = self.last_t
        while t < now:
            h = self.hour(t)
            end = min(now, (int(t // HOUR) + 1) * HOUR)
            dt = end - t
            h.seconds += dt
            h.t1 += dt if self.min_count >= 1 else 0.0
            h.t2 += dt if self.min_count >= 2 else 0.0
            if self.formed_at is not None:
                h.node_s += dt * self.n_serving
                h.formed += dt
                h.t1_formed += dt if self.min_count >= 1 else 0.0
            t = end
        self.last_t = max(self.last_t, now)

    def coverage(self, now: float, counts: list[int], n_serving: int) -> None:
        self.advance(now)
        self.min_count, self.n_serving = min(counts), n_serving
        if self.formed_at is None and self.min_count >= 1:
            self.formed_at = now
        lost = [i for i, (a, b) in enumerate(zip(self.prev, counts)) if a > 0 and b == 0]
        if lost:
            self._loss_id += 1
            self.losses[self._loss_id] = (now, set(lost))
            for i in lost:
                self.loss_of[i] = self._loss_id
        for i, (a, b) in enumerate(zip(self.prev, counts)):
            if a == 0 and b > 0 and i in self.loss_of:
                start, layers = self.losses[self.loss_of.pop(i)]
                layers.discard(i)
                if not layers:
                    self.hour(start).heals.append(now - start)
        self.prev = list(counts)

    def moved(self, now: float, reason: str, back: bool = False) -> None:
        """A serving node moved; `back`: to a range it had served before (a flap)."""
        if self.formed_at is not None:
            self.hour(now).moves += 1
            self.hour(now).flaps += back
            self.reasons[reason.split(" ")[0].rstrip(":")] += 1

    def walk(self, now: float, ok: bool, hops: int, questions: int) -> None:
        self.hour(now).walks.append((ok, hops, questions))

    def route(self, now: float, ratio: float) -> None:
        self.hour(now).ratios.append(ratio)

    def load(self, now: float, ratio: float) -> None:
        self.hour(now).loads.append(ratio)

    def request(self, now: float, outcome: str) -> None:
        """outcome: done, failed (no route, hops failing), busy (refused for lack of room)."""
        self.hour(now).requests[outcome] += 1

    def summary(self, hours: list[Hour] | None = None) -> dict:
        hs = self.hours if hours is None else hours
        seconds = sum(h.seconds for h in hs) or 1.0
        heals = [x for h in hs for x in h.heals]
        walks = [w for h in hs for w in h.walks]
        ratios = [x for h in hs for x in h.ratios]
        loads = [x for h in hs for x in h.loads]
        req = sum((h.requests for h in hs), Counter())
        n_req = sum(req.values())
        node_h = sum(h.node_s for h in hs) / HOUR
        r = lambda x, n=4: None if x is None else round(x, n)  # noqa: E731
        return {
            "covered_1": r(sum(h.t1 for h in hs) / seconds, 5), "covered_2": r(sum(h.t2 for h in hs) / seconds, 5),
            "covered_1_formed": r(sum(h.t1_formed for h in hs) / sum(h.formed for h in hs), 5)
            if sum(h.formed for h in hs) else None,
            "heals": len(heals), "heal_s_p50": r(pct(heals, 50), 1), "heal_s_p99": r(pct(heals, 99), 1),
            "moves": sum(h.moves for h in hs), "moves_back": sum(h.flaps for h in hs),
            "moves_per_node_hour": r(sum(h.moves for h in hs) / node_h if node_h else 0.0),
            "lookups": len(walks), "lookup_success": r(sum(w[0] for w in walks) / len(walks) if walks else None),
            "lookup_hops_p50": pct([w[1] for w in walks if w[0]], 50),
            "lookup_hops_p99": pct([w[1] for w in walks if w[0]], 99),
            "lookup_questions_p50": pct([w[2] for w in walks], 50),
            "route_over_best_p50": r(pct(ratios, 50)), "route_over_best_p99": r(pct(ratios, 99)),
            "load_max_over_mean": r(sum(loads) / len(loads) if loads else None, 3),
            "requests": n_req, "requests_failed_share": r((req["failed"] + req["busy"]) / n_req if n_req else 0.0),
            "requests_busy_share": r(req["busy"] / n_req if n_req else 0.0),
        }
