"""Kademlia lookups as a pure state machine: whom to ask next, and when a walk is done.

Rules (the libp2p Kademlia spec, as py-libp2p's routing table measures distance): keys and peers
share one 256-bit space, a value key at SHA-256(key) and a peer at SHA-256(peer id bytes), and
distance is XOR. A walk keeps at most `alpha` queries in flight, asks only unasked peers among the
`k` closest it knows, and is done when the `k` closest peers that did not fail have all answered,
or nobody is left to ask. No I/O here: a driver (`meshd.dht.kad`) feeds answers in, tests feed
made-up ones.
"""

from __future__ import annotations

import hashlib
from typing import Container, Iterable

K = 20  # replication and result size (Kademlia's k, go-libp2p's and py-libp2p's bucket size)
ALPHA = 3  # queries in flight per walk


def key_point(key: bytes) -> int:
    """Where a record key (or any key) lives in the keyspace."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


def peer_point(peer: bytes) -> int:
    """Where a peer lives in the keyspace (`peer` is the binary peer id)."""
    return key_point(peer)


def closest(target: int, peers: Iterable[bytes], k: int = K) -> list[bytes]:
    """The (at most) k peers closest to `target`, closest first, each once."""
    return sorted(set(peers), key=lambda p: peer_point(p) ^ target)[:k]


class Lookup:
    """One iterative walk towards `target`.

    Peers move from heard to waiting (`next_queries`) to answered or failed (`answer`, `fail`).
    """

    def __init__(self, target: int, seeds: Iterable[bytes] = (), k: int = K, alpha: int = ALPHA,
                 exclude: Iterable[bytes] = ()) -> None:
        self.target, self.k, self.alpha = target, k, alpha
        self.exclude = set(exclude)  # never asked nor returned (the walker itself)
        self.distance: dict[bytes, int] = {}
        self.heard: set[bytes] = set()
        self.waiting: set[bytes] = set()
        self.answered: set[bytes] = set()
        self.failed: set[bytes] = set()
        self.add(seeds)

    def add(self, peers: Iterable[bytes]) -> None:
        """Peers learnt of (seeds, or the closer peers in an answer); known ones are ignored."""
        for p in peers:
            if p not in self.distance and p not in self.exclude:
                self.distance[p] = peer_point(p) ^ self.target
                self.heard.add(p)

    def front(self) -> list[bytes]:
        """The k closest peers known that have not failed, closest first."""
        alive = [p for p in self.distance if p not in self.failed]
        return sorted(alive, key=self.distance.__getitem__)[:self.k]

    def next_queries(self) -> list[bytes]:
        """Peers to ask now (marked waiting): the closest unasked ones of the front, up to alpha in flight."""
        free = self.alpha - len(self.waiting)
        if free <= 0:
            return []
        picked = [p for p in self.front() if p in self.heard][:free]
        for p in picked:
            self.heard.discard(p)
            self.waiting.add(p)
        return picked

    def answer(self, peer: bytes, closer: Iterable[bytes] = ()) -> None:
        """`peer` answered, naming `closer` peers."""
        self.waiting.discard(peer)
        self.answered.add(peer)
        self.add(closer)

    def fail(self, peer: bytes) -> None:
        """`peer` did not answer (refused, reset, timed out, unreachable)."""
        self.waiting.discard(peer)
        self.heard.discard(peer)
        self.failed.add(peer)

    @property
    def done(self) -> bool:
        """Nothing in flight, and every peer of the front has answered."""
        return not self.waiting and all(p in self.answered for p in self.front())

    def settled(self, holders: Container[bytes], quorum: int) -> bool:
        """Whether `quorum` peers of the front hold a value and every front peer closer than the
        quorum-th of them has answered. A get may end there: its values come from the closest
        peers known, not from the first far ones asked (a stale copy, replayed by anyone, can sit
        anywhere; the newest sits at the peers closest to the key)."""
        held = 0
        for p in self.front():
            if p not in self.answered:
                return False
            held += p in holders
            if held >= quorum:
                return True
        return False

    def result(self) -> list[bytes]:
        """The k closest peers that answered, closest first (where a value goes, or comes from)."""
        return sorted(self.answered, key=self.distance.__getitem__)[:self.k]
