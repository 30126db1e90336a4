"""A hop's sessions: one record per (session id, epoch), and the one way in and out of everything a hop holds
for it.

Rules: a session is admitted, opened and closed through its `SessionTable`, and nothing else creates or frees
what a hop keeps for it. Admission at the event loop reserves its room (`reserve`, given back by `settle` once
the open was tried); the endpoint opens it (`open`, after the shard made its KV); every end goes through
`close`: an entry's Close or Cancel, a stream that ended, an idle session whose room a newcomer takes, a
session evicted by the KV store (the store tells the shard, the shard the endpoint, which closes it here).
`close` hands the record to each `closers` in turn: the endpoint's frees its KV and rows in the shard and
writes the ledger; the service's lets go of its due mark and its next hop's link on the event loop. Waiting
work is the scheduler's: an entry's close drops it, an eviction lets it run into `unknown_session`.
The table is written on the compute thread and read on the event loop: readers take `len`, `get`
or a `list(...)` snapshot, never an iteration that a write could interrupt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from meshd.hop.links import Links
from meshd.shard.grammar import Constraint
from meshd.shard.sampler import Sampler

Key = tuple[bytes, int]


@dataclass
class HopSession:
    """One session at a hop: how it runs here (layers, sampler, grammar, microbatch), the KV promised to it and
    where its outputs go. Its KV rows are the shard's and its waiting work the scheduler's, under its key, made
    by its open and the frames that follow, and let go through `SessionTable.close`, like the record itself."""

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
    ended: str = ""  # how it ended, once closed: completed, cancelled, failed or handed_over ("" while open)
    keep: tuple[bytes, ...] = ()  # at its end, the chain of the tokens its KV holds, kept for reuse (prefix.py)


Closer = Callable[[HopSession], None]


class SessionTable(dict[Key, HopSession]):
    """The open sessions by key, the room reserved for those about to open, and the way out of both."""

    def __init__(self) -> None:
        super().__init__()
        self.closers: list[Closer] = []  # told of each session closed, in order (see the module's rules)
        self.reserved: dict[tuple[str, Key], int] = {}  # (peer, key) admitted, not yet opened -> its KV bytes

    def open(self, session: HopSession) -> HopSession:
        """Hold an opened session. A reopened key's record is replaced: the shard reopened its KV empty, and
        the service lets go of the old record's link."""
        self[session.key] = session
        return session

    def close(self, key: Key, outcome: str = "failed", keep: list[bytes] = ()) -> HopSession | None:
        """The way out: forget session `key` and have every closer let go of what it holds for it (with
        `keep`, its KV is kept for a later session extending those tokens). The record, or None if not open."""
        session = self.pop(key, None)
        if session is None:
            return None
        session.ended = "handed_over" if session.handed_over else outcome
        session.keep = tuple(keep)
        for closer in list(self.closers):
            closer(session)
        return session

    def reserve(self, peer: str, key: Key, need: int) -> None:
        """Count a session admitted for `peer` (needing `need` KV bytes) against it until its open was tried."""
        self.reserved[(peer, key)] = need

    def settle(self, peer: str, key: Key) -> bool:
        """The open of a reserved session was tried: it counts as open, or not at all. Whether one was reserved."""
        return self.reserved.pop((peer, key), None) is not None

    def promised(self) -> int:
        """KV bytes promised to all open sessions."""
        return sum(s.promised for s in list(self.values()))

    def held_by(self, peer: str) -> tuple[int, int]:
        """Sessions, and the KV bytes promised to them, that `peer` holds here: those whose home stream comes
        from it, and those reserved for it (a session opened but not yet settled counts once)."""
        reserved = list(self.reserved.items())
        mine = {key: need for (p, key), need in reserved if p == peer}
        for s in list(self.values()):
            if s.key not in mine and s.links is not None and getattr(s.links.home, "peer", "") == peer:
                mine[s.key] = s.promised
        return len(mine), sum(mine.values())

    def pending(self, peer: str) -> tuple[int, int]:
        """Sessions admitted for `peer` and not yet opened, and their KV bytes."""
        needs = [need for (p, _), need in list(self.reserved.items()) if p == peer]
        return len(needs), sum(needs)

    def links(self, key: Key) -> Links | None:
        session = self.get(key)
        return session.links if session is not None else None
