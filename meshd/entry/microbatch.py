"""Spreading an entry's generations over microbatches that hops never mix in one pass.

Why: sessions that share a pass move down the route together; left alone, every group that catches
up with another at some hop merges with it, and one group going round a three-daemon route leaves
each daemon idle while it is elsewhere (see meshd/hop/scheduler.py).
"""

from __future__ import annotations


class Microbatches:
    """How many generations run in each microbatch. A new generation takes the least used of the first
    n, so that n groups move down the route apart: while one group computes at a daemon, the others
    are at other daemons (or on the wire), and a daemon has a pass to run while work waits elsewhere."""

    def __init__(self) -> None:
        self.used: dict[int, int] = {}

    def take(self, n: int) -> int:
        microbatch = min(range(max(1, n)), key=lambda i: (self.used.get(i, 0), i))
        self.used[microbatch] = self.used.get(microbatch, 0) + 1
        return microbatch

    def give(self, microbatch: int) -> None:
        self.used[microbatch] -= 1
        if not self.used[microbatch]:
            del self.used[microbatch]

    def counts(self) -> list[int]:
        """Generations in microbatch 0, 1, ... up to the highest in use ([] when none runs)."""
        return [self.used.get(i, 0) for i in range(max(self.used, default=-1) + 1)]
