"""Route planning: the chain of peers that carries a generation from layer k to the last layer.

Rule: a pure function of the coverage map and link latencies. A hop may enter a peer in the
middle of its range and always leaves at the end of that range; the chosen chain minimises the
estimated time per token, sum over hops of (layers / advertised throughput + link latency).
Ties break deterministically (fewer hops, then peer id), so every entry plans the same way.
"""

from __future__ import annotations

import random

from dataclasses import dataclass
from typing import Callable, Mapping

from meshd.dht.coverage import CoverageMap
from meshd.p2p.addrs import relay_of

DEFAULT_THROUGHPUT = 500.0  # layer-steps per second assumed for a peer that advertises none
DEFAULT_LATENCY = 0.005  # seconds per hop assumed for a link never measured
AVOID_COST_S = 1e6  # what each layer run on a peer to avoid adds to a route's cost: taken only where no other
# peer serves the layers, and for as few layers as the ranges allow


class NoRoute(RuntimeError):
    """The live peers do not cover the layers a generation needs."""

    def __init__(self, missing: list[tuple[int, int]]):
        self.missing = missing
        spans = ", ".join(f"[{a}, {b})" for a, b in missing)
        super().__init__(f"no route: layers {spans} are served by no live peer")


@dataclass(frozen=True)
class Hop:
    peer_id: str
    addrs: tuple[str, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Route:
    hops: tuple[Hop, ...]
    cost_s: float

    def describe(self) -> list[list]:
        return [[h.peer_id, h.start, h.end] for h in self.hops]


def link_latency(records, measured: Mapping[str, float]) -> Callable[[str], float]:
    """Each peer's link latency for planning: measured where known (a record round trip, which for a
    peer reached through a relay includes both legs). A peer never measured is priced at the slowest
    measured link (the default when none is): a round trip is measured only when a record happens to
    be pulled or stored, so which peers have one is chance, and a peer must never look slower than
    an unknown one merely for having been measured (priced at a constant 5 ms, then at the median of
    the measured links, the one peer measured at 22.8 ms, or one at 44.7 ms beside another at 20.8 ms,
    lost to every unmeasured peer on a loaded box). A peer reached only through relays and never
    measured is priced at both legs: its nearest relay's latency (measured, else the prior) plus the
    prior for the leg behind the relay, so an unmeasured direct peer wins over an unmeasured relayed one."""
    prior = max(measured.values()) if measured else DEFAULT_LATENCY
    relayed: dict[str, float] = {}
    for r in records:
        if r.peer_id in measured or not r.relay_addrs:
            continue
        relays = {relay_of(a) for a in r.relay_addrs} - {None}  # a malformed address names no relay
        near = min((measured[x] for x in relays if x in measured), default=prior)
        relayed[r.peer_id] = near + prior
    return lambda peer: measured.get(peer, relayed.get(peer, prior))


def plan_route(coverage: CoverageMap, start: int, latency: Mapping[str, float] | Callable[[str], float] | None = None,
               exclude: frozenset[str] | set[str] = frozenset(), avoid: frozenset[str] | set[str] = frozenset(),
               weigh: Callable[[str], float] | None = None) -> Route:
    """Cheapest chain of hops covering [start, n_layers); raises `NoRoute` naming the gaps. Peers in
    `avoid` are used only for layers no other peer serves (a checked generation's second route). `weigh`
    scales each peer's cost (a check's route drawn at random: `spread_weights`)."""
    n = coverage.n_layers
    if start >= n:
        return Route((), 0.0)
    if callable(latency):
        link = latency
    else:
        table = latency or {}
        link = lambda peer: table.get(peer, DEFAULT_LATENCY)  # noqa: E731
    records = [r for r in coverage.records if r.peer_id not in exclude]
    # best[a] = (cost, hops, path) to have layers [start, a) done
    best: dict[int, tuple[float, int, tuple[Hop, ...]]] = {start: (0.0, 0, ())}
    for a in range(start, n):
        if a not in best:
            continue
        cost, count, path = best[a]
        for r in records:
            if not r.start <= a < r.end:
                continue
            rate = r.throughput if r.throughput > 0 else DEFAULT_THROUGHPUT
            step = ((r.end - a) / rate + link(r.peer_id)) * (weigh(r.peer_id) if weigh is not None else 1.0)
            step += AVOID_COST_S * (r.end - a) if r.peer_id in avoid else 0.0
            cand = (cost + step, count + 1, path + (Hop(r.peer_id, r.dial_addrs, a, r.end),))
            old = best.get(r.end)
            if old is None or _better(cand, old):
                best[r.end] = cand
    if n not in best:
        served = [0] * n
        for r in records:
            for layer in range(max(r.start, start), r.end):
                served[layer] += 1
        raise NoRoute(_gaps(served, start) or [(start, n)])
    cost, _, path = best[n]
    return Route(path, cost)


def route_along(coverage: CoverageMap, start: int, spans, latency: Callable[[str], float],
                exclude: frozenset[str] | set[str] = frozenset()) -> Route | None:
    """The route through the hops `spans` names ([peer, start, end] each, as `Route.describe` gives),
    priced as `plan_route` prices it, if every one is still a serving record's range (entered anywhere,
    left at its end) and they chain from `start` to the last layer; else None."""
    by_peer = {r.peer_id: r for r in coverage.records if r.peer_id not in exclude}
    hops, cost, at = [], 0.0, start
    for peer, a, b in spans:
        r = by_peer.get(peer)
        if r is None or a != at or not r.start <= a < r.end or b != r.end:
            return None
        rate = r.throughput if r.throughput > 0 else DEFAULT_THROUGHPUT
        cost += (b - a) / rate + latency(peer)
        hops.append(Hop(peer, r.dial_addrs, a, b))
        at = b
    return Route(tuple(hops), cost) if at == coverage.n_layers else None


def _better(a, b) -> bool:
    key = lambda c: (round(c[0], 9), c[1], [h.peer_id for h in c[2]])  # noqa: E731
    return key(a) < key(b)


def _gaps(served: list[int], start: int) -> list[tuple[int, int]]:
    """Runs of layers at or after `start` that nobody serves."""
    out, run = [], None
    for layer in range(start, len(served) + 1):
        empty = layer < len(served) and served[layer] == 0
        if empty and run is None:
            run = layer
        elif not empty and run is not None:
            out.append((run, layer))
            run = None
    return out


def plan_around(coverage: CoverageMap, start: int, latency, own_id: str, failed: set[str] = frozenset(),
                busy: set[str] = frozenset(), avoid: set[str] = frozenset(),
                unreachable: set[str] = frozenset(), weigh: Callable[[str], float] | None = None) -> tuple[Route, bool]:
    """A route from layer `start` around the hops that failed and those that are full; and whether it
    had to try a failed hop again because no other covers its layers (a broken stream is not always a
    dead peer; a generation's bounded attempts stop a hop that keeps failing). A hop that could not even
    be reached (`unreachable`: its process is gone, its record not yet lapsed) is tried again only where
    no failed hop that might be alive (one gone silent on a loaded box) serves the layers. A full hop is
    never retried: `NoRoute` then, which the caller waits on."""
    try:
        return plan_route(coverage, start, latency=latency, exclude=set(failed) | set(busy) | {own_id},
                          avoid=avoid, weigh=weigh), False
    except NoRoute:
        if not failed:
            raise
        for exclude in ({*busy, *unreachable, own_id}, {*busy, own_id}) if unreachable else ({*busy, own_id},):
            try:
                return plan_route(coverage, start, latency=latency, exclude=exclude, avoid=avoid, weigh=weigh), True
            except NoRoute:
                pass
        raise


def spread_weights(draw: random.Random, spread: float = 8.0) -> Callable[[str], float]:
    """Per peer, a factor drawn once, log-uniform in [1/spread, spread], to scale its cost by: a route planned
    with it takes, over many draws, every server of a range whose cost is within about `spread` squared of the
    cheapest, not always the cheapest (a check's route: so that checks reach every server of a range)."""
    factors: dict[str, float] = {}
    return lambda peer: factors.setdefault(peer, spread ** draw.uniform(-1.0, 1.0))


def replaced(coverage: CoverageMap, start: int, route: Route, peer: str, latency: Callable[[str], float],
             exclude: set[str] | frozenset[str] = frozenset()) -> Route | None:
    """`route` with hop `peer` replaced by the serving peer that covers the same layers (entered anywhere,
    left at the same end, as `route_along` requires), not leaving, not on the route already and not in
    `exclude`, whose route costs least (ties: peer id); None where no such peer is. A hop that leaves on
    purpose hands its sessions' KV to it (`meshd/hop/handover.py`)."""
    i = next((i for i, h in enumerate(route.hops) if h.peer_id == peer), None)
    if i is None:
        return None
    hop, on_route = route.hops[i], {h.peer_id for h in route.hops}
    best = None
    for r in coverage.records:
        if r.peer_id in on_route or r.peer_id in exclude or r.leaving:
            continue
        if not (r.start <= hop.start < r.end == hop.end):
            continue
        spans = [[h.peer_id, h.start, h.end] if j != i else [r.peer_id, hop.start, hop.end]
                 for j, h in enumerate(route.hops)]
        new = route_along(coverage, start, spans, latency, exclude)
        if new is not None and (best is None or (new.cost_s, r.peer_id) < (best.cost_s, best.hops[i].peer_id)):
            best = new
    return best
