"""Which sessions' work goes into a shard's next forward pass: pure bookkeeping, no tensors, no I/O.

Rules: each session's work runs in the order it arrived, one piece a pass (its next piece needs the
KV the previous one writes). A pass takes the waiting decode steps of all sessions first (up to
`max_batch`; a speculative step or a replay is one piece of several rows, and its rows past the
first come out of `token_budget`), then prefill chunks in arrival order while they fit in the rows
left, so a long prompt rides along with everybody's decode instead of stalling it; one prefill
chunk always gets in, so prompts progress under any decode load. Past `max_queued` pieces waiting,
new work is refused at once (`QueueFull`) rather than queued without bound.

Microbatches: every piece belongs to a microbatch (the entry gives each generation one,
`OpenSession.microbatch`), and a pass takes the work of one microbatch only, the one whose piece has
waited longest. Why: sessions that share a pass move down the route together, and left alone every
group that catches up with another at some hop merges with it, until one or two groups go round a
three-daemon route and each daemon idles while they are elsewhere. Microbatches keep the groups
apart, as vLLM keeps one micro-batch in flight per pipeline stage.

The caller's loop, as vLLM's scheduler has it: `batch = schedule()`; run the batch;
`update_from_output(batch, outputs)` hands each piece its output and frees its session for the
next pass.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from meshd.core.settings import default

TOKEN_BUDGET = 256  # rows of one pass beyond its decode steps: two 128-token prefill chunks
MAX_BATCH = 64  # sessions in one pass
MAX_QUEUED = default("max_queue")  # pieces of work waiting


class QueueFull(RuntimeError):
    """This shard has as much work waiting as it accepts."""


@dataclass(eq=False)
class Work:
    key: Hashable  # the session
    rows: int  # positions it adds to a pass
    decode: bool  # one decode step (else a prefill chunk)
    payload: Any = None  # what the caller needs to run and answer it
    seq: int = 0  # arrival order
    microbatch: int = 0  # only work of one microbatch shares a pass
    output: Any = None
    done: bool = False


@dataclass
class SchedulerStats:
    passes: int = 0
    rows: int = 0
    sessions: int = 0  # summed over passes: sessions / passes is the mean batch size
    largest: int = 0  # most sessions in one pass
    refused: int = 0  # work refused because the queue was full
    run_passes: int = 0  # of the passes, steps of decode runs (one session's steps back to back: ShardService)

    def count(self, rows: int, sessions: int) -> None:
        """One pass of `rows` rows for `sessions` sessions."""
        self.passes += 1
        self.rows += rows
        self.sessions += sessions
        self.largest = max(self.largest, sessions)

    def as_dict(self) -> dict:
        return {"passes": self.passes, "rows": self.rows, "largest_batch": self.largest, "refused": self.refused,
                "run_passes": self.run_passes,
                "mean_batch": round(self.sessions / self.passes, 2) if self.passes else None}


@dataclass
class Scheduler:
    token_budget: int = TOKEN_BUDGET
    max_batch: int = MAX_BATCH
    max_queued: int = MAX_QUEUED
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        self._queues: dict[Hashable, deque[Work]] = {}
        self._running: set[Hashable] = set()
        self._seq = itertools.count()
        self.queued = 0

    def submit(self, key: Hashable, rows: int, decode: bool, payload: Any = None, microbatch: int = 0) -> Work:
        if self.queued >= self.max_queued:
            self.stats.refused += 1
            raise QueueFull(f"{self.queued} pieces of work already wait at this shard")
        work = Work(key, rows, decode, payload, next(self._seq), microbatch=microbatch)
        self._queues.setdefault(key, deque()).append(work)
        self.queued += 1
        return work

    def schedule(self) -> list[Work]:
        """The next pass, from the microbatch that has waited longest: its decode steps first, then its
        prefill chunks under the token budget."""
        heads = sorted((q[0] for key, q in self._queues.items() if q and key not in self._running),
                       key=lambda w: w.seq)
        if heads:
            microbatch = heads[0].microbatch
            heads = [w for w in heads if w.microbatch == microbatch]
        batch = [w for w in heads if w.decode][:self.max_batch]
        budget = self.token_budget - sum(w.rows - 1 for w in batch)  # a step's drafts count as rows
        prefilling = False
        for w in heads:
            if w.decode or len(batch) >= self.max_batch:
                continue
            if prefilling and w.rows > budget:
                continue  # a smaller chunk further back may still fit
            batch.append(w)
            budget -= w.rows
            prefilling = True
        for w in batch:
            self._queues[w.key].popleft()
            self._running.add(w.key)
        self.queued -= len(batch)
        if batch:
            self.stats.count(sum(w.rows for w in batch), len(batch))
        return batch

    def update_from_output(self, batch: list[Work], outputs: list[Any]) -> list[Work]:
        """Hand each piece of a pass its output; their sessions may run again. Returns the pieces."""
        if len(batch) != len(outputs):
            raise ValueError(f"{len(outputs)} outputs for a pass of {len(batch)}")
        for w, out in zip(batch, outputs):
            w.output, w.done = out, True
            self._running.discard(w.key)
            if not self._queues.get(w.key):
                self._queues.pop(w.key, None)
        return batch

    def cancel(self, key: Hashable) -> list[Work]:
        """Drop a session's waiting work (its session closed); returns what was dropped."""
        dropped = list(self._queues.get(key, ()))
        if key in self._queues and key not in self._running:
            del self._queues[key]
        elif key in self._queues:
            self._queues[key].clear()
        self.queued -= len(dropped)
        return dropped

    def withdraw(self, work: Work) -> bool:
        """Take back one piece not yet scheduled (its caller gave up); False if it already ran or runs."""
        q = self._queues.get(work.key)
        if q is None or work not in q:
            return False
        q.remove(work)
        self.queued -= 1
        if not q and work.key not in self._running:
            del self._queues[work.key]
        return True

    def waiting(self) -> int:
        """Sessions with work waiting."""
        return sum(1 for q in self._queues.values() if q)
