"""Nodes that come and go, publish records, choose and change their layers: meshd's own rules, timed.

Rules: every decision is the daemon's own pure function (`meshd.dht.placement.place_span`,
`meshd.dht.moves.plan_moves` with `Persistence`, `takes_part` and `still_named`, the record's
`bump`/`republish_every`/expiry, `CoverageMap.build`, `Settings.layers_wanted`, the relay client's
`relay_candidates`/`choose_relays` and the relay's `RelayLedger`); this module only times them as the
daemon's loops do (`meshd.dht.rebalancer`'s constants), on simulated time. Every node reads one
shared view of the coverage, rebuilt every `COVERAGE_INTERVAL` from the live records (a real
daemon's view can lag by a pull; here none does). A plan depends only on the map, so it is computed
once per distinct map and each node reads its own line of it, as every daemon computing the same
plan would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.dht.coverage import CoverageMap
from meshd.dht.placement import fit_span, place_span
from meshd.dht.moves import Move, Persistence, plan_moves, still_named, takes_part
from meshd.dht.rebalancer import (AUTO_SETTLE_S, MOVE_JITTER_S, PERSIST_ROUNDS, REBALANCE_PERIOD_S, SETTLE_ROUNDS,
                                  SETTLE_S)
from meshd.dht.record import CoverageRecord, bump, republish_every
from meshd.dht.view import COVERAGE_INTERVAL
from meshd.core.settings import Settings
from meshd.node.wiring import relay_limits
from meshd.relay.client import TICK_S, choose_relays, relay_candidates
from meshd.relay.policy import RelayLedger
from meshd.sim.dht import Keyspace
from meshd.sim.metrics import Metrics
from meshd.sim.world import (GB, Clockwork, Machine, Place, WorldSpec, draw_machine, draw_place, jittered, rtt_s,
                             session_s)

RELAY_SAMPLE = 50  # relay records a private node has heard of when it chooses
RENEW_S = 240.0  # reservations are renewed well inside their `reservation_s`
LOAD_FIXED_S = 1.0  # opening a shard besides reading its bytes


@dataclass
class Node:
    nid: int
    seat: int
    peer_id: str
    machine: Machine
    place: Place
    nat: bool
    server: bool
    joined: float
    want: int = 0
    alive: bool = True
    stage: str = "booting"  # booting, claiming, loading, serving (the daemon's lifecycle, coarsely)
    record: CoverageRecord | None = None
    serving: tuple[int, int] | None = None  # the range it truly serves now
    persist: Persistence | None = None
    cooldown_until: float = 0.0
    relays: set[str] = field(default_factory=set)
    backoff: dict[str, float] = field(default_factory=dict)
    sessions: int = 0
    promised: int = 0
    active: set = field(default_factory=set)  # numbers of the requests with a session here
    served: set = field(default_factory=set)  # ranges it served before (a move back to one is a flap)
    peer: bytes = b""


class Swarm:
    def __init__(self, spec: WorldSpec, settings: Settings | None = None, clock: Clockwork | None = None) -> None:
        self.spec, self.shape = spec, spec.shape
        self.settings = settings or Settings()
        self.ttl = self.settings.record_ttl
        self.clock = clock or Clockwork()
        self.metrics = Metrics(spec.shape.n_layers, spec.hours)
        self.rng_nodes, self.rng_life = spec.rng("nodes"), spec.rng("life")
        self.rng_timing, self.rng_jitter = spec.rng("timing"), spec.rng("jitter")
        self.keys = Keyspace(spec.rng("dht"))
        self.nodes: dict[str, Node] = {}
        self.records: dict[str, CoverageRecord] = {}  # servers' records, the coverage map's input
        self.relay_records: dict[str, CoverageRecord] = {}  # public nodes' (relays') records
        self.ledgers: dict[str, RelayLedger] = {}
        self.holders: dict[str, set[str]] = {}  # relay -> private nodes holding a reservation there
        self.counts = [0] * self.shape.n_layers  # true servers per layer
        self.n_serving = 0
        self.view = CoverageMap(self.shape.n_layers, ())
        self._view_key: tuple | None = None
        self._plans: dict[tuple, dict[str, Move]] = {}
        self.n_server_seats = spec.server_seats()
        self._next_nid = 0
        self.on_lost = None  # traffic's hook: a node with sessions died
        self.refill = True  # a seat left empty is taken by a new node (not in a trace, nor a calibration case)
        self.clock.after(COVERAGE_INTERVAL, self._refresh)

    # --- births and deaths ---------------------------------------------------------------------------

    def populate(self) -> None:
        """Fill every seat at time 0 (a run starts from a formed population) or from the trace."""
        if self.spec.trace:
            for seat, join, leave in self.spec.trace:
                self.clock.at(join, self.spawn, seat, leave)
            return
        for seat in range(self.spec.seats()):
            self.clock.at(self.rng_life.uniform(0, 60), self.spawn, seat, None)

    def spawn(self, seat: int, leave_at: float | None = None, machine: Machine | None = None,
              place: Place | None = None, nat: bool | None = None, boot_s: float | None = None,
              want: int | None = None) -> Node:
        rng, now = self.rng_nodes, self.clock.now
        self._next_nid += 1
        m = machine or draw_machine(rng, self.spec.machines)
        node = Node(self._next_nid, seat, f"p{self._next_nid:07d}", m, place or draw_place(rng),
                    rng.random() < self.spec.nat_share if nat is None else nat, seat < self.n_server_seats, now)
        node.peer = Keyspace.peer_bytes(node.peer_id)
        if node.server:
            wanted = Settings(num_layers=want or self.shape.slots(m))
            node.want = wanted.layers_wanted(self.shape.n_layers, self.shape.layer_bytes)
        self.nodes[node.peer_id] = node
        self.keys.join(node.peer, now, node.peer_id)
        if leave_at is None and not self.spec.trace:
            leave_at = now + session_s(self.rng_life, self.spec)
        if leave_at is not None:
            self.clock.at(leave_at, self.leave, node)
        self.clock.after(self.spec.boot_s if boot_s is None else boot_s, self._listening, node)
        return node

    def leave(self, node: Node, graceful: bool | None = None) -> None:
        if not node.alive:
            return
        now = self.clock.now
        node.alive = False
        if graceful is None:
            graceful = self.rng_life.random() < self.spec.graceful_share
        if node.serving:
            self._count(node.serving, -1)
            node.serving = None
        if node.record is not None and graceful:  # SIGTERM: leaving, then withdrawn
            node.record = self.records[node.peer_id] = bump(node.record, self.ttl, now=now, leaving=True,
                                                            serving=False)
        self.keys.leave(node.peer)
        del self.nodes[node.peer_id]
        if node.peer_id in self.ledgers:
            del self.ledgers[node.peer_id], self.relay_records[node.peer_id]
            for pid in sorted(self.holders.pop(node.peer_id, set())):
                held = self.nodes.get(pid)
                if held is not None:
                    held.relays.discard(node.peer_id)
                    self.clock.after(TICK_S, self._reserve, held)
        for pid in node.relays:
            self.holders.get(pid, set()).discard(node.peer_id)
        if node.active and self.on_lost:
            self.on_lost(node)
        if self.refill and not self.spec.trace:
            self.clock.after(self.rng_life.expovariate(1 / self.spec.rejoin_mean_s), self.spawn, node.seat)

    # --- reachability ------------------------------------------------------------------------------------

    def rtt(self, a: Node, b: Node) -> float | None:
        """The round trip from a to b: direct to a public node, else through b's nearest relay; None
        when b is private and holds no reservation."""
        if not b.nat:
            return rtt_s(a.place, b.place)
        legs = [rtt_s(a.place, r.place) + rtt_s(r.place, b.place)
                for r in (self.nodes.get(p) for p in b.relays) if r is not None]
        return min(legs) if legs else None

    def relays_of(self, b: Node) -> list[str]:
        """The relays b holds a reservation at, nearest to b first."""
        return sorted((p for p in b.relays if p in self.ledgers), key=lambda p: (rtt_s(self.nodes[p].place, b.place), p))

    def _reserve(self, node: Node) -> None:
        """A private node's relay client: reserve at relays `choose_relays` names until it holds enough."""
        if not node.alive or not node.nat:
            return
        now = self.clock.now
        pool = list(self.relay_records.values())
        sample = self.rng_nodes.sample(pool, min(RELAY_SAMPLE, len(pool)))
        latency = {r.peer_id: jittered(self.rng_jitter, rtt_s(node.place, self.nodes[r.peer_id].place)) for r in sample}
        before = set(node.relays)
        for pid in choose_relays(relay_candidates(sample, latency, node.peer_id, now), node.relays, node.backoff, now,
                                 self.settings.relays):
            if len(node.relays) >= self.settings.relays:
                break
            if isinstance(self.ledgers[pid].reserve(node.peer_id, now), str):
                node.backoff[pid] = now + 60.0
                continue
            node.relays.add(pid)
            self.holders.setdefault(pid, set()).add(node.peer_id)
        if len(node.relays) < self.settings.relays:
            self.clock.after(TICK_S * 5, self._reserve, node)
        if node.relays != before and node.record is not None:
            self._publish(node)

    def _renew(self, relay_id: str) -> None:
        ledger = self.ledgers.get(relay_id)
        if ledger is None:
            return
        for pid in sorted(self.holders.get(relay_id, ())):
            ledger.reserve(pid, self.clock.now)
        self.clock.after(RENEW_S, self._renew, relay_id)

    # --- a daemon's start ---------------------------------------------------------------------------------

    def _listening(self, node: Node) -> None:
        if not node.alive:
            return
        now = self.clock.now
        if not node.nat:  # a public daemon relays (`--relay auto`)
            self.relay_records[node.peer_id] = CoverageRecord(node.peer_id, (f"/sim/{node.peer_id}",), "m", "r", 0, 0,
                                                              self.shape.n_layers, relay=True, expires_at=float("inf"))
            self.ledgers[node.peer_id] = RelayLedger(relay_limits(self.settings))
            self.clock.after(RENEW_S, self._renew, node.peer_id)
        else:
            self._reserve(node)
        if node.server:
            node.stage = "claiming"
            self.clock.after(AUTO_SETTLE_S, self._choose, node)

    def _choose(self, node: Node) -> None:
        """`choose_first_range`: the largest gap its layers can fill, claimed (not yet loaded)."""
        if not node.alive:
            return
        start, end = place_span(self.view.without(node.peer_id), node.want, None, self.shape.size)
        node.record = CoverageRecord(node.peer_id, () if node.nat else (f"/sim/{node.peer_id}",), "m", "r", start,
                                     end, self.shape.n_layers, throughput=self.throughput(node), seq=0,
                                     auto_layers=node.want)
        self._publish(node)
        self.clock.after(self.rng_timing.uniform(*SETTLE_S), self._settle, node, 1)

    def _settle(self, node: Node, round_: int) -> None:
        """`Rebalancer.settle_claim`: move the claim while the plan says so, at most SETTLE_ROUNDS times."""
        if not node.alive:
            return
        move = self.own_move(node)
        if move is not None:
            self._publish(node, **dict(zip(("start", "end"), fit_span(*move.to, None, self.shape.size))))
        if move is None or round_ >= SETTLE_ROUNDS:
            node.stage = "loading"
            self.clock.after(self.load_s(node, node.record.start, node.record.end), self._serve, node)
        else:
            self.clock.after(self.rng_timing.uniform(*SETTLE_S), self._settle, node, round_ + 1)

    def _serve(self, node: Node) -> None:
        if not node.alive:
            return
        node.stage = "serving"
        node.serving = (node.record.start, node.record.end)
        self._count(node.serving, +1)
        self._publish(node, serving=True)
        node.persist = Persistence(PERSIST_ROUNDS, self.ttl)
        self.clock.after(republish_every(self.ttl), self._republish, node)
        self.clock.after(self.rng_timing.uniform(0, REBALANCE_PERIOD_S), self._round, node)

    # --- a serving daemon's loops -------------------------------------------------------------------------

    def _republish(self, node: Node) -> None:
        if node.alive:
            self._publish(node, free_sessions=max(0, node.machine.max_sessions - node.sessions),
                          load=round(node.sessions / node.machine.max_sessions, 4))
            self.clock.after(republish_every(self.ttl), self._republish, node)

    def _round(self, node: Node) -> None:
        """One round of `Rebalancer.run`."""
        if not node.alive:
            return
        now = self.clock.now
        if not takes_part(True, now, node.cooldown_until):
            node.persist.reset()
        else:
            if node.record.auto_layers == 0:
                self._publish(node, auto_layers=node.want)
            move = node.persist.observe(self.own_move(node), now)
            if move is not None:
                self.clock.after(self.rng_timing.uniform(*MOVE_JITTER_S), self._confirm, node, move.to)
                return
        self.clock.after(REBALANCE_PERIOD_S, self._round, node)

    def _confirm(self, node: Node, aim: tuple[int, int]) -> None:
        if not node.alive:
            return
        move = self.own_move(node)
        if not still_named(move, aim):
            self.clock.after(REBALANCE_PERIOD_S, self._round, node)
            return
        start, end = fit_span(*move.to, None, self.shape.size)
        node.cooldown_until = self.clock.now + self.settings.move_cooldown
        self.clock.after(self.load_s(node, start, end), self._moved, node, move, (start, end))

    def _moved(self, node: Node, move: Move, to: tuple[int, int]) -> None:
        if not node.alive:
            return
        self._count(to, +1)
        self._count(node.serving, -1)
        node.served.add(node.serving)
        node.serving = to
        self._publish(node, start=to[0], end=to[1], serving=True, auto_layers=0)
        self.metrics.moved(self.clock.now, move.reason, back=to in node.served)
        self.clock.after(REBALANCE_PERIOD_S, self._round, node)

    # --- records and the view -----------------------------------------------------------------------------

    def _publish(self, node: Node, **changes) -> None:
        if node.nat:
            changes["relay_addrs"] = tuple(f"/sim/{r}/p2p-circuit/p2p/{node.peer_id}" for r in sorted(node.relays))
        node.record = self.records[node.peer_id] = bump(node.record, self.ttl, now=self.clock.now, **changes)

    def _refresh(self) -> None:
        """Every COVERAGE_INTERVAL: the live records as a coverage map (expired ones dropped)."""
        now = self.clock.now
        for pid in [p for p, r in self.records.items() if r.expired(now)]:
            del self.records[pid]
        self.view = CoverageMap.build(self.shape.n_layers, self.records.values(), now=now)
        self.clock.after(COVERAGE_INTERVAL, self._refresh)

    def own_move(self, node: Node) -> Move | None:
        """This node's line of `plan_moves(view)`, the plan computed once per distinct map."""
        key = tuple((r.peer_id, r.start, r.end, r.serving, r.auto_layers, r.leaving) for r in self.view.records)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = {m.peer_id: m for m in plan_moves(self.view)}
        return plan.get(node.peer_id)

    # --- the machine ----------------------------------------------------------------------------------------

    def throughput(self, node: Node) -> float:
        """Layer-steps a second: a decode step reads each layer's bytes once."""
        return node.machine.bandwidth_gbs * GB / self.shape.layer_bytes

    def load_s(self, node: Node, start: int, end: int) -> float:
        return LOAD_FIXED_S + self.shape.size(start, end) / (node.machine.disk_mbs * 1e6)

    def _count(self, span: tuple[int, int], delta: int) -> None:
        for layer in range(*span):
            self.counts[layer] += delta
        self.n_serving += delta
        self.metrics.coverage(self.clock.now, self.counts, self.n_serving)

    def serving_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.serving]
