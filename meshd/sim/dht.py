"""Kademlia over simulated routing tables: meshd's own `Lookup` walks, answered from tables built the
way a Kademlia node fills its buckets.

Rules of the model: a node's table holds, for each bucket (peers whose id shares exactly i leading
bits with its own), up to k peers drawn at random from the nodes live when the table was (re)built;
a table is rebuilt every `UPKEEP_S` (meshd's upkeep period), so entries of nodes that left since
fail (a question to them costs `QUERY_TIMEOUT`). A peer answers with the k closest peers its table
holds. A record is held by the k nodes closest to its key among those live at its owner's last
publish. A node behind NAT is asked through its relay (both legs) while it holds a reservation,
and fails while it holds none. Lookups are sampled (`WorldSpec.walks_per_hour`), not run for every
publish and refresh of every node: a walk's cost grows with log n, and its outcome depends on the
tables, not on how many other walks run.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from dataclasses import dataclass

from meshd.dht.kad import GET_QUORUM, QUERY_TIMEOUT, UPKEEP_S
from meshd.dht.lookup import ALPHA, K, Lookup, key_point, peer_point

BITS = 256


@dataclass
class Walk:
    ok: bool
    hops: int  # depth of the first holder that answered (a seed is depth 1); 0 when none
    questions: int
    seconds: float


class Keyspace:
    """The live nodes by keyspace point, their routing tables, and walks over them."""

    def __init__(self, rng: random.Random, k: int = K, alpha: int = ALPHA) -> None:
        self.rng, self.k, self.alpha = rng, k, alpha
        self.points: list[int] = []  # sorted
        self.peer_at: dict[int, bytes] = {}
        self.point_of: dict[bytes, int] = {}
        self.tables: dict[bytes, tuple[float, list[bytes]]] = {}  # peer -> (built at, entries)
        self.joined: dict[bytes, float] = {}
        self.id_of: dict[bytes, str] = {}  # peer bytes -> the node's name
        self._gone: dict[bytes, int] = {}  # points of departed peers

    @staticmethod
    def peer_bytes(peer_id: str) -> bytes:
        return hashlib.sha256(peer_id.encode()).digest()

    def join(self, peer: bytes, now: float, name: str = "") -> None:
        p = peer_point(peer)
        self.id_of[peer] = name
        bisect.insort(self.points, p)
        self.peer_at[p], self.point_of[peer], self.joined[peer] = peer, p, now

    def leave(self, peer: bytes) -> None:
        p = self._gone[peer] = self.point_of.pop(peer)
        del self.points[bisect.bisect_left(self.points, p)]
        del self.peer_at[p]
        self.tables.pop(peer, None)
        self.joined.pop(peer, None)
        self.id_of.pop(peer, None)

    def alive(self, peer: bytes) -> bool:
        return peer in self.point_of

    def _range(self, lo: int, hi: int) -> tuple[int, int]:
        return bisect.bisect_left(self.points, lo), bisect.bisect_left(self.points, hi)

    def table(self, peer: bytes, now: float) -> list[bytes]:
        """`peer`'s routing table: up to k live peers of each bucket, rebuilt every UPKEEP_S."""
        built = self.tables.get(peer)
        if built is not None and now - built[0] < UPKEEP_S:
            return built[1]
        x, out = self.point_of[peer], []
        for i in range(BITS):
            shift = BITS - 1 - i
            prefix = (x >> shift) ^ 1  # the first i bits of x, then the other bit
            a, b = self._range(prefix << shift, (prefix + 1) << shift)
            if b - a <= self.k:
                out += [self.peer_at[q] for q in self.points[a:b]]
            else:
                out += [self.peer_at[self.points[j]] for j in self.rng.sample(range(a, b), self.k)]
            same = self._range((x >> shift) << shift, ((x >> shift) + 1) << shift)
            if same[1] - same[0] <= 1:  # nobody else shares i + 1 bits with x: deeper buckets are empty
                break
        self.tables[peer] = (now, out)
        return out

    def answer(self, peer: bytes, target: int, now: float) -> list[bytes]:
        """What `peer` answers a walk towards `target`: the k closest peers of its table."""
        return heapq.nsmallest(self.k, self.table(peer, now), key=lambda q: self.point(q) ^ target)

    def point(self, peer: bytes) -> int:
        """`peer_point`, remembered (a table names departed peers too)."""
        p = self.point_of.get(peer)
        if p is None:
            p = self._gone.get(peer)
            if p is None:
                p = self._gone[peer] = peer_point(peer)
        return p

    def holders(self, key: int, published_at: float) -> set[bytes]:
        """The nodes holding a record of `key`: its k closest among those live at the last publish."""
        span = max(self.k * 4, 64)
        at = bisect.bisect_left(self.points, key)
        window = self.points[max(0, at - span):at + span]  # XOR-closest lie near in sorted order
        near = heapq.nsmallest(self.k * 2, window, key=lambda q: q ^ key)
        there = [self.peer_at[q] for q in near if self.joined[self.peer_at[q]] <= published_at]
        return set(there[:self.k])

    def walk(self, walker: bytes, key: bytes, published_at: float, now: float, reach) -> Walk:
        """A get of `key` from `walker`, as `KadWalker.get` runs it: `Lookup`'s questions, alpha in
        flight, ended once `Lookup.settled` (GET_QUORUM holders) or done. `reach(a, b)`: the round
        trip from a to b in seconds, or None when b cannot be reached."""
        target = key_point(key)
        holders = self.holders(target, published_at)
        lookup = Lookup(target, self.answer(walker, target, now), k=self.k, alpha=self.alpha, exclude=[walker])
        depth = {p: 1 for p in lookup.heard}
        flying: list[tuple[float, int, bytes]] = []
        t, n, first = 0.0, 0, 0
        while True:
            for p in lookup.next_queries():
                rtt = reach(walker, p) if self.alive(p) else None
                n += 1
                heapq.heappush(flying, (t + (QUERY_TIMEOUT if rtt is None else min(rtt, QUERY_TIMEOUT)), n, p))
            if not flying or lookup.settled(holders, GET_QUORUM):
                break
            t, _, p = heapq.heappop(flying)
            if not self.alive(p) or reach(walker, p) is None:
                lookup.fail(p)
                continue
            closer = self.answer(p, target, now)
            for q in closer:
                depth.setdefault(q, depth[p] + 1)
            lookup.answer(p, closer)
            if p in holders and not first:
                first = depth[p]
        return Walk(bool(first), first, n, t)


def hops_bound(n: int) -> float:
    """The goal: a walk ends within log2(n) hops."""
    return math.log2(max(2, n))
