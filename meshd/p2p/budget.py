"""The bytes other daemons' frames may occupy here, counted per peer and in all.

Rule: a frame's declared cost (its body and its raw tensors, `meshd.wire.FrameHead.cost`) is taken
from its sender's share and from the daemon's total before the frame is read past its header, and
given back once the frame's work is done. A frame that alone exceeds a share is refused at once;
one that fits a share but not what is left of it waits (its stream is not read meanwhile: flow
control), up to the stream's deadline. No peer's share is the whole total, so a floor always stays
for the others.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import trio


class OverBudget(Exception):
    """A frame that can never fit its sender's share."""


@dataclass
class ByteBudget:
    total: int  # bytes all peers' frames may occupy at once
    per_peer: int  # bytes one peer's frames may occupy at once (less than `total`)
    used: Counter = field(default_factory=Counter)
    in_use: int = 0
    high_water: int = 0  # most bytes in use since `trimmed()` was last called

    def __post_init__(self) -> None:
        if not 0 < self.per_peer <= self.total:
            raise ValueError(f"a peer's frame share ({self.per_peer}) must be positive and at most the total"
                             f" ({self.total})")
        self._changed = trio.Event()

    def refusal(self, peer: str, n: int) -> str | None:
        """Why `n` more bytes from `peer` can never be held, or None."""
        if n > self.per_peer:
            return f"a frame of {n} bytes exceeds a peer's frame budget of {self.per_peer} bytes"
        return None

    def fits(self, peer: str, n: int) -> bool:
        return self.used[peer] + n <= self.per_peer and self.in_use + n <= self.total

    def take_nowait(self, peer: str, n: int) -> bool:
        """Take `n` bytes for `peer` if they fit now."""
        if n <= 0:
            return True
        if not self.fits(peer, n):
            return False
        self.used[peer] += n
        self.in_use += n
        self.high_water = max(self.high_water, self.in_use)
        return True

    async def take(self, peer: str, n: int) -> None:
        """Take `n` bytes for `peer`, waiting for room (the caller's deadline bounds the wait);
        raises `OverBudget` if they can never fit."""
        why = self.refusal(peer, n)
        if why is not None:
            raise OverBudget(why)
        while not self.take_nowait(peer, n):
            await self._changed.wait()

    def give(self, peer: str, n: int) -> None:
        if n <= 0:
            return
        self.used[peer] -= n
        self.in_use -= n
        if self.used[peer] <= 0:
            del self.used[peer]
        woken, self._changed = self._changed, trio.Event()
        woken.set()

    def trimmed(self, threshold: int) -> bool:
        """True once after a burst: nothing is held now and more than `threshold` bytes were
        (the caller then hands freed heap back to the system)."""
        if self.in_use or self.high_water <= threshold:
            return False
        self.high_water = 0
        return True


@dataclass
class Held:
    """Bytes of one frame held in a budget until `release` (idempotent)."""

    budget: ByteBudget | None
    peer: str
    n: int = 0

    async def grow(self, n: int) -> None:
        """Hold `n` bytes in all (waiting for room); `OverBudget` if `n` can never fit a share."""
        if self.budget is not None and n > self.n:
            why = self.budget.refusal(self.peer, n)
            if why is not None:
                raise OverBudget(why)
            await self.budget.take(self.peer, n - self.n)
        self.n = max(self.n, n)

    def shrink(self, n: int) -> None:
        if self.budget is not None and n < self.n:
            self.budget.give(self.peer, self.n - n)
        self.n = min(self.n, n)

    def release(self) -> None:
        self.shrink(0)
