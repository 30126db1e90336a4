"""Frames said to be on their way to a hop, so a pass about to start can wait a moment for them.

Why: the tail's tokens reach the entry a moment apart, each on its own stream; without this, the
first to come back would start a pass alone and the others would follow one by one. The entry says
a session's next frame is due (`expect`), with how many tokens of the same tail pass come here; a
pass waits while any are due, at most DUE_WAIT_S. Pure bookkeeping, fed the (trio) time.
"""

from __future__ import annotations

from typing import Hashable

DUE_WAIT_S = 0.008  # the longest a pass waits for frames said to be on their way; a gap-based wait (5 ms
# between arrivals, 25 ms in all) made bigger passes but fewer tokens/s in bench/batch_bench.py


class DueFrames:
    def __init__(self, wait_s: float = DUE_WAIT_S) -> None:
        self.wait_s = wait_s
        self.keys: set[Hashable] = set()  # sessions whose next frame is on its way
        self._groups: dict[tuple, list] = {}  # (peer, pass id) -> [tokens not yet come, until when they are waited for]

    def expect(self, key: Hashable, now: float, group: tuple = (), size: int = 0) -> None:
        """Session `key`'s next frame is on its way, one of `size` tokens of the tail pass `group`."""
        self.keys.add(key)
        if size > 1 and group:
            entry = self._groups.setdefault(group, [size, now + self.wait_s])
            entry[0] -= 1
            if entry[0] <= 0:
                del self._groups[group]

    def arrived(self, key: Hashable) -> None:
        self.keys.discard(key)

    def awaited(self, now: float) -> bool:
        """Frames said to be on their way that have not come yet (groups past their time forgotten)."""
        for group in [g for g, (_, until) in self._groups.items() if until <= now]:
            del self._groups[group]
        return bool(self.keys or self._groups)

    def clear(self) -> None:
        """What has not come within the wait (a generation that ended) is not waited for again."""
        self.keys.clear()
        self._groups.clear()

    def __bool__(self) -> bool:
        return bool(self.keys or self._groups)
