"""A ragged batch: several sessions' positions stacked as the rows of one [1, R, hidden] tensor.

Rules: the linear layers see all rows at once, where their kernel gives every row the same bits
whatever the row count; attention, RoPE and the KV cache run per session, each at its own position.
So a session's output in a batch is bit for bit its output alone. torch's float32 and bfloat16
`F.linear` do not qualify: sgemm picks its kernel by row count (1 row: gemv; 2-4 and 5+ rows: two
gemm paths; each rounds differently, measured), so float weights run per session. The native lane's
kernels (GGUF blocks, torch's int4) are row-invariant (checked for any row count), so quantized shards
batch for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from meshd.shard import blocks, quant
from meshd.shard.linear import ConcatWeight, Weight, linear


@dataclass(frozen=True, slots=True)
class Segment:
    kv: object  # the session's SessionKV
    position: int  # the first position of its rows
    n: int  # how many positions
    row: int  # where its rows start in the batch


def row_invariant(w: Weight) -> bool:
    """Whether running w over many rows gives each row the bits it gets alone."""
    if isinstance(w, ConcatWeight):
        return all(row_invariant(p) for p in w.parts)
    return isinstance(w, (blocks.BlockWeight, quant.Int4Weight))


class Rows:
    """The sessions of one forward pass, in row order."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self._positions: torch.Tensor | None = None

    @classmethod
    def stack(cls, parts: list[tuple[object, int, int]]) -> "Rows":
        """From (kv, position, n) per session, in the order their rows are stacked."""
        segments, row = [], 0
        for kv, position, n in parts:
            segments.append(Segment(kv, position, n, row))
            row += n
        return cls(segments)

    def positions(self) -> torch.Tensor:
        """The position of every row, in row order."""
        if self._positions is None:
            self._positions = torch.cat([torch.arange(s.position, s.position + s.n) for s in self.segments])
        return self._positions

    def split_heads(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each session's rows of x [1, heads, R, ...]."""
        if len(self.segments) == 1:
            return [x]
        return [x[:, :, s.row:s.row + s.n] for s in self.segments]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each session's rows of x [1, R, ...]."""
        if len(self.segments) == 1:
            return [x]
        return [x[:, s.row:s.row + s.n] for s in self.segments]

    def each(self, fn: Callable[[Segment, torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn applied to every session's rows of x, the results stacked again along the rows."""
        outs = [fn(s, part) for s, part in zip(self.segments, self.split(x))]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ b), over all rows in one call when that cannot change a row's bits."""
        if len(self.segments) == 1 or row_invariant(w):
            return linear(x, w, b)
        return self.each(lambda _, part: linear(part, w, b), x)

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every session's last row, stacked: [1, sessions, ...]."""
        if len(self.segments) == 1:
            return x[:, -1:]
        return x[:, [s.row + s.n - 1 for s in self.segments]]
