"""A hop's sessions: one record per (session id, epoch) that owns what the hop holds for it.

Rule: a session is created in one place (`ShardEndpoint._open`) and released in one place
(`ShardEndpoint.release`, after the service let go of its link); nothing else keys state by a
session. Two things live elsewhere on purpose, under the same key: its KV rows (the shard's
`KVStore`, which the model math writes) and its waiting work (the pure `Scheduler`'s queues).
The table is written on the compute thread and read on the event loop: readers take `len`, `get`
or a `list(...)` snapshot, never an iteration that a write could interrupt.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.hop.links import Links
from meshd.shard.grammar import Constraint
from meshd.shard.sampler import Sampler

Key = tuple[bytes, int]


@dataclass
class HopSession:
    key: Key
    sampler: Sampler | None  # set when the session ends at the last layer (it samples)
    head: bool = False  # the session starts at layer 0 (takes token ids)
    microbatch: int = 0  # the entry's microbatch: only frames of one microbatch share a forward pass
    promised: int = 0  # KV bytes it may grow to, promised at open (it never runs out mid-generation)
    links: Links | None = None  # where its outputs go, once opened over a stream (the service sets it)
    layers: tuple[int, int] = (0, 0)  # the layers it runs here
    requester: str = ""  # the peer that opened it over a stream (its entry); "" for the entry's own
    positions: int = 0  # positions computed for it (the work ledger's count)
    opened_at: float = 0.0  # wall clock
    constraint: Constraint | None = None  # its grammar, where it samples (meshd/shard/grammar.py)
    carries_ids: bool = False  # a head whose route samples under a grammar: its frames carry their token ids on
    handed_over: bool = False  # its KV went to another hop (meshd/hop/handover.py): the ledger says so at its end


class SessionTable(dict[Key, HopSession]):
    """The open sessions by key."""

    def promised(self) -> int:
        """KV bytes promised to all open sessions."""
        return sum(s.promised for s in list(self.values()))

    def held_by(self, peer: str) -> tuple[int, int]:
        """Sessions, and the KV bytes promised to them, whose home stream comes from `peer`."""
        mine = [s for s in list(self.values()) if s.links is not None and getattr(s.links.home, "peer", "") == peer]
        return len(mine), sum(s.promised for s in mine)

    def links(self, key: Key) -> Links | None:
        session = self.get(key)
        return session.links if session is not None else None
