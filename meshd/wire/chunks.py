"""Prefill in chunks: split a prompt's positions, and check chunks arrive whole and in order.

Rule: chunk i of n covers positions [position, position + len); chunk indices count 0..n-1 with a
total that never changes, and each chunk starts where the previous one ended.
"""

from __future__ import annotations

from meshd.core.settings import default
from meshd.wire.errors import ChunkOrderError
from meshd.wire.messages import Forward

DEFAULT_CHUNK_TOKENS = default("chunk_tokens")

def chunk_spans(n_tokens: int, size: int) -> list[tuple[int, int]]:
    """[start, end) offsets of consecutive chunks of at most `size` tokens covering n_tokens (`size`: the
    entry's --chunk-tokens, passed by whoever prefills)."""
    if size < 1:
        raise ValueError(f"the prefill chunk size must be at least 1 token, not {size}")
    return [(s, min(s + size, n_tokens)) for s in range(0, n_tokens, size)]


class PrefillAssembler:
    """Checks the chunks of one prefill as they arrive; `done` once the last one is in."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.next_index = 0
        self.next_position: int | None = None
        self.chunks: list[Forward] = []

    @property
    def done(self) -> bool:
        return self.total is not None and self.next_index == self.total

    def add(self, frame: Forward, n_tokens: int) -> None:
        """Accept chunk `frame` spanning `n_tokens` positions, or raise `ChunkOrderError`."""
        if self.total is None:
            if frame.chunk_total < 1:
                raise ChunkOrderError(f"chunk total {frame.chunk_total} must be at least 1")
            self.total = frame.chunk_total
        if self.done:
            raise ChunkOrderError(f"chunk {frame.chunk_index} arrived after all {self.total} chunks")
        if frame.chunk_total != self.total:
            raise ChunkOrderError(f"chunk total changed from {self.total} to {frame.chunk_total}")
        if frame.chunk_index != self.next_index:
            raise ChunkOrderError(f"expected chunk {self.next_index} of {self.total}, got {frame.chunk_index}")
        if self.next_position is not None and frame.position != self.next_position:
            raise ChunkOrderError(f"chunk {frame.chunk_index} starts at position {frame.position},"
                                  f" expected {self.next_position}")
        self.next_index += 1
        self.next_position = frame.position + n_tokens
        self.chunks.append(frame)
