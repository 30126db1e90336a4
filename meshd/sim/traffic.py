"""Requests through the simulated swarm, and the sampled DHT walks: the entry's own rules, timed.

Rules: requests arrive at each entry (a serving node holding layer 0) as a Poisson process; the
entry admits its own layers (`Capacity.refusal`; full, it hands the request on to `choose_entry`'s
pick), plans with `plan_around` over its view and `link_latency` of its measured round trips, opens
a session on every hop (admission as `Capacity`, a private hop through a circuit its relay's
`RelayLedger` must admit), and follows `Retries` after a hop fails, is full, or no route exists.
A generation lasts its prefill plus one step a token, a step being the route's compute plus each
link's one-way delay (entry to first hop, hop to hop, last hop back). A hop that dies fails its
sessions 1.5 s later (the entry's liveness pings); the retry replays prompt and tokens so far.
A route is priced against the best one of that moment: the planner's own cost with true link
latencies, over the true serving peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.dht.coverage import CoverageMap
from meshd.dht.record import record_key
from meshd.entry.errors import GenerationError, HopFailed
from meshd.entry.policy import BUSY_WAIT_S, Retries, choose_entry
from meshd.entry.route import NoRoute, link_latency, plan_around, plan_route, route_along
from meshd.hop.admission import Capacity
from meshd.sim.swarm import Node, Swarm
from meshd.sim.world import jittered, rtt_s, tokens
from meshd.wire import ErrorCode

FROZEN_S = 1.5  # a dead hop's sessions fail after this (the entry's liveness pings)
LOAD_SAMPLE_S = 60.0
PREFILL_TOKENS_PER_STEP = 64  # prompt positions one step carries (chunks pipeline down the route)


@dataclass
class Request:
    entry: Node
    prompt: int
    tokens: int
    retries: Retries
    tried: set = field(default_factory=set)
    done: int = 0  # tokens generated so far
    hops: list = field(default_factory=list)  # (node, circuit) of the open sessions
    started: float = 0.0
    step_s: float = 0.0
    epoch: int = 0
    priced: bool = False
    n: int = 0  # arrival number


class Traffic:
    def __init__(self, swarm: Swarm) -> None:
        self.swarm, self.spec = swarm, swarm.spec
        self.rng, self.rng_walk = self.spec.rng("requests"), self.spec.rng("walks")
        swarm.on_lost = self.lost
        self.pending: dict[int, Request] = {}  # arrivals with sessions open, by number
        self.arrivals = 0
        self.clock = swarm.clock

    def start(self) -> None:
        self.clock.after(1.0, self.arrive)
        if self.spec.walks_per_hour > 0:
            self.clock.after(self.rng_walk.expovariate(self.spec.walks_per_hour / 3600), self.sample_walk)
        self.clock.after(LOAD_SAMPLE_S, self.sample_load)

    # --- arrivals ---------------------------------------------------------------------------------------

    def entries(self) -> list[Node]:
        return [n for n in self.swarm.serving_nodes() if n.serving[0] == 0]

    def arrive(self) -> None:
        entries = self.entries()
        rate = self.spec.requests_per_entry_min / 60 * max(1, len(entries))
        self.clock.after(self.rng.expovariate(rate), self.arrive)
        if self.spec.requests_per_entry_min <= 0:
            return
        now = self.clock.now
        if not entries:
            self.swarm.metrics.request(now, "failed")
            return
        entry = entries[int(self.rng.random() * len(entries))]
        self.arrivals += 1
        req = Request(entry, tokens(self.rng, self.spec.prompt_tokens_median),
                      tokens(self.rng, self.spec.gen_tokens_median), Retries(deadline=now + BUSY_WAIT_S),
                      n=self.arrivals)
        self.attempt(req)

    def need(self, node: Node) -> int:
        a, b = node.serving
        return (b - a) * self.swarm.shape.kv_layer_bytes

    def capacity(self, node: Node) -> Capacity:
        return Capacity(node.sessions, node.machine.max_sessions, node.promised,
                        node.machine.max_sessions * node.want * self.swarm.shape.kv_layer_bytes)

    # --- one attempt ------------------------------------------------------------------------------------

    def attempt(self, req: Request) -> None:
        now, sw = self.clock.now, self.swarm
        entry = req.entry
        if not entry.alive or not entry.serving:
            self.end(req, "failed")
            return
        if self.capacity(entry).refusal(self.need(entry)) is not None:  # full: hand it to another entry
            req.tried.add(entry.peer_id)
            other = choose_entry(sw.view.serving().records, self.measured(entry), entry.peer_id, req.tried)
            node = sw.nodes.get(other.peer_id) if other else None
            if node is None or not node.serving or node.serving[0] != 0:
                self.end(req, "busy")
                return
            req.entry = node
            self.clock.after(self.leg(entry, node), self.attempt, req)
            return
        view = sw.view.serving()
        latency = link_latency(view.records, self.measured(entry))
        try:
            route, _ = plan_around(view, entry.serving[1], latency, entry.peer_id, req.retries.failed,
                                   req.retries.busy)
        except NoRoute as exc:
            self.no_route(req, GenerationError(ErrorCode.NO_ROUTE, str(exc)))
            return
        entry.sessions += 1
        entry.promised += self.need(entry)
        opened = [(entry, None)]
        for hop in route.hops:
            node = sw.nodes.get(hop.peer_id)
            failure = self.open_hop(entry, node, hop.peer_id, opened)
            if failure is not None:
                self.release(opened)
                try:
                    req.retries.after_failure(failure)
                except GenerationError:
                    self.end(req, "failed")
                    return
                self.clock.after(0.0 if failure.busy_s is not None else 1.0, self.attempt, req)
                return
        req.hops, req.epoch = opened, req.epoch + 1
        self.grant(req, route)

    def open_hop(self, entry: Node, node: Node | None, peer_id: str, opened: list) -> HopFailed | None:
        """A session on one hop, or why not (dead, unreachable, circuit refused, full)."""
        if node is None or not node.alive or not node.serving:
            return HopFailed(peer_id, "unreachable")
        circuit = None
        if node.nat:  # the dialler tries each circuit address, nearest relay first
            refusal = "no relay"
            for relay in self.swarm.relays_of(node):
                cid = self.swarm.ledgers[relay].open(entry.peer_id, peer_id, self.clock.now)
                if not isinstance(cid, str):
                    circuit = (relay, cid)
                    break
                refusal = cid
            if circuit is None:
                return HopFailed(peer_id, refusal)
        if self.capacity(node).refusal(self.need(node)) is not None:
            if circuit:
                self.swarm.ledgers[circuit[0]].close(circuit[1])
            return HopFailed(peer_id, "busy", busy_s=0.5)
        node.sessions += 1
        node.promised += self.need(node)
        opened.append((node, circuit))
        return None

    def release(self, opened: list, req: Request | None = None) -> None:
        for node, circuit in opened:
            node.sessions -= 1
            node.promised -= self.need(node) if node.serving else 0
            node.promised = max(0, node.promised)
            if req is not None:
                node.active.discard(req.n)
            if circuit and circuit[0] in self.swarm.ledgers:
                self.swarm.ledgers[circuit[0]].close(circuit[1])
        opened.clear()

    def grant(self, req: Request, route) -> None:
        now, sw = self.clock.now, self.swarm
        chain = [n for n, _ in req.hops]
        step = sum((n.serving[1] - n.serving[0]) / sw.throughput(n) for n in chain)
        step += sum(self.leg(a, b) for a, b in zip(chain, chain[1:] + chain[:1]))
        replay = req.prompt + req.done
        req.step_s, req.started = step, now + step * (replay / PREFILL_TOKENS_PER_STEP)
        for n in chain:
            n.active.add(req.n)
        self.pending[req.n] = req
        if not req.priced:
            req.priced = True
            self.price(req.entry, route)
        self.clock.at(req.started + step * (req.tokens - req.done), self.finish, req, req.epoch)

    def finish(self, req: Request, epoch: int) -> None:
        if epoch != req.epoch or not req.hops:
            return
        self.release(req.hops, req)
        self.pending.pop(req.n, None)
        self.end(req, "done")

    def lost(self, node: Node) -> None:
        """`node` died: each of its sessions' generations fails over after FROZEN_S."""
        for rid in sorted(node.active):  # in arrival order: a run must not depend on set order
            req = self.pending.get(rid)
            if req is None or not req.hops:
                continue
            now = self.clock.now
            req.done = min(req.tokens, max(req.done, int((now - req.started) / req.step_s) if req.step_s else 0))
            self.release(req.hops, req)
            req.epoch += 1
            try:
                req.retries.after_failure(HopFailed(node.peer_id, "hop died"))
            except GenerationError:
                self.pending.pop(rid, None)
                self.end(req, "failed")
                continue
            self.clock.after(FROZEN_S, self.attempt, req)

    def no_route(self, req: Request, exc: GenerationError) -> None:
        now = self.clock.now
        try:
            if req.retries.busy:
                wait = req.retries.after_refusal(exc, now)
            else:
                lapsed = {r.peer_id for r in self.swarm.records.values() if r.expired(now + self.swarm.ttl)} - \
                    set(self.swarm.nodes)
                wait = req.retries.look_again(exc, lapsed, now)
                if wait is None:
                    self.end(req, "failed")
                    return
        except GenerationError as err:
            self.end(req, "busy" if err.code == ErrorCode.BUSY else "failed")
            return
        self.clock.after(max(wait, 0.05), self.attempt, req)

    def end(self, req: Request, outcome: str) -> None:
        self.swarm.metrics.request(self.clock.now, outcome)

    # --- latency as the entry sees it, and the truth ------------------------------------------------------

    def leg(self, a: Node, b: Node) -> float:
        """One way from a to b (half the round trip, through b's relay when private)."""
        rtt = self.swarm.rtt(a, b)
        return (rtt if rtt is not None else rtt_s(a.place, b.place)) / 2

    def measured(self, entry: Node) -> dict[str, float]:
        """The entry's record round trips: every serving peer's, jittered (it pulls each record directly)."""
        out = {}
        for r in self.swarm.view.serving().records:
            node = self.swarm.nodes.get(r.peer_id)
            if node is not None and node is not entry:
                rtt = self.swarm.rtt(entry, node)
                if rtt is not None:
                    out[r.peer_id] = jittered(self.rng, rtt)
        return out

    def price(self, entry: Node, route) -> None:
        """The chosen route against the best of this moment, both priced as the planner prices, with
        true latencies over the truly serving, reachable peers."""
        sw = self.swarm
        truth = CoverageMap(sw.shape.n_layers, tuple(n.record for n in sw.serving_nodes()
                                                      if n.record is not None and (n.record.start, n.record.end) == n.serving))
        true = {n.peer_id: sw.rtt(entry, n) for n in sw.serving_nodes() if n is not entry}
        lat = lambda p: true.get(p) if true.get(p) is not None else 1e3  # noqa: E731
        try:
            best = plan_route(truth, entry.serving[1], latency=lat, exclude={entry.peer_id})
        except NoRoute:
            return
        chosen = route_along(truth, entry.serving[1], route.describe(), lat, exclude={entry.peer_id})
        if chosen is not None and best.cost_s > 0:
            sw.metrics.route(self.clock.now, chosen.cost_s / best.cost_s)

    # --- samples ------------------------------------------------------------------------------------------

    def sample_walk(self) -> None:
        """One get of a random serving node's record key from a random node."""
        sw, rng = self.swarm, self.rng_walk
        self.clock.after(rng.expovariate(self.spec.walks_per_hour / 3600), self.sample_walk)
        owners = [n for n in sw.serving_nodes() if n.record is not None]
        if not owners or len(sw.nodes) < 2:
            return
        owner = owners[int(rng.random() * len(owners))]
        walker = owner
        while walker is owner:
            walker = rng.choice(list(sw.nodes.values()))
        last_publish = owner.record.expires_at - sw.ttl

        def reach(_: bytes, b: bytes):
            node = sw.nodes.get(sw.keys.id_of.get(b, ""))
            return None if node is None else sw.rtt(walker, node)

        w = sw.keys.walk(walker.peer, record_key(owner.peer_id).encode(), last_publish, self.clock.now, reach)
        sw.metrics.walk(self.clock.now, w.ok, w.hops, w.questions)

    def sample_load(self) -> None:
        self.clock.after(LOAD_SAMPLE_S, self.sample_load)
        loads = [n.sessions for n in self.swarm.serving_nodes()]
        mean = sum(loads) / len(loads) if loads else 0
        if mean > 0:
            self.swarm.metrics.load(self.clock.now, max(loads) / mean)
