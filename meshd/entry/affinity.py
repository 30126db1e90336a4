"""Which route computed which prefix, so that a conversation's next turn goes where its KV is kept.

Rule: a pure memory, kept as the hops keep their KV (`meshd/shard/prefix.py`'s index, over the same hash
chains): a finished attempt's route is remembered under the chain of the tokens its hops kept, a newer
turn of the same conversation supersedes the older, the least recently used go past `size` entries or
after the TTL. `route_for` names the hops of the longest remembered prefix of a prompt; whether they
may still be used (alive, serving those layers, not failed, full or excluded) is the planner's call.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from meshd.shard.prefix import BLOCK, PrefixIndex

SIZE = 256  # routes remembered at most


class Affinity:
    def __init__(self, ttl_s: float, size: int = SIZE, clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.size = PrefixIndex(ttl_s, clock), size

    def remember(self, hashes: Sequence[bytes], spans: list[list]) -> None:
        """The route whose hops kept the KV of the tokens `hashes` names ([peer, start, end] a hop)."""
        if not hashes or self.index.ttl_s <= 0:
            return
        self.index.insert(None, hashes, tuple(tuple(s) for s in spans), 0)
        self.index.expired()
        while len(self.index) > self.size:
            self.index.remove(self.index.oldest())

    def route_for(self, hashes: Sequence[bytes]) -> tuple[list[list], int]:
        """The hops remembered for the longest prefix of `hashes`, and how many tokens it covers."""
        kept, blocks = self.index.match(None, hashes)
        if kept is None:
            return [], 0
        self.index.touch(kept)
        return [list(s) for s in kept.value], blocks * BLOCK
