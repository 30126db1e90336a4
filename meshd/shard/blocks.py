"""GGUF blocks multiplied as they are stored: the native lane's kernel for Q4_0, Q4_1 and Q8_0.

Rule: a `BlockWeight` holds the GGUF tensor's own bytes (memory follows the file, byte for byte) and
multiplies them with integer dot products against float32 activations quantized to 8 bits per
32-wide block, in meshd's C extension (`_blocks.c`, built with the package). Every output is summed in
one fixed order whatever the row count, batch, thread count or CPU (AVX2 or the portable C path), so
a row's bits never depend on its neighbours or on the peer. Where the extension did not build, `KERNEL`
is None, the lane falls back to torch's int4 layout, and its recipe layout says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

try:
    from meshd.shard import _blocks as KERNEL
except ImportError:  # the extension did not build here
    KERNEL = None

TYPES = {QT.Q4_0, QT.Q4_1, QT.Q8_0}
_threads = len(os.sched_getaffinity(0))


def set_threads(n: int) -> None:
    """How many threads the kernel splits a matmul over (its own pool: the results do not depend on it)."""
    global _threads
    _threads = max(1, int(n))


def divide_threads(threads: int, recipe) -> None:
    """Give tensor work `threads` threads, called on the thread that computes. Where this recipe's
    matmuls run in the block kernel, its pool takes them and torch's ops (norms, attention, small
    elementwise work) run on one: two pools spinning on the same cores slowed a SmolLM2 decode step
    from 28 to 61-70 ms on 2 cores (measured). Otherwise torch keeps them all."""
    import torch

    if KERNEL is not None and recipe.weight_dtype == "stored":
        set_threads(threads)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(threads)
LAYOUT = "gguf-blocks x q8-g32 activations, fixed-order sums; v1"


def available(qtype: QT) -> bool:
    """Whether tensors of this GGUF type run in this kernel here."""
    return KERNEL is not None and qtype in TYPES


def isa() -> str:
    """The instruction set the kernel runs on ("avx2", "portable"), or "absent"."""
    return KERNEL.isa() if KERNEL is not None else "absent"


@dataclass
class BlockWeight:
    """A [out, in] matrix as GGUF blocks: `data` is uint8 [out, bytes per row], the file's bytes."""

    qtype: QT
    data: torch.Tensor
    out_features: int
    in_features: int
    portable: bool = False  # force the portable C path (tests compare it with AVX2)

    @classmethod
    def from_raw(cls, qtype: QT, rows: np.ndarray, cols: int) -> "BlockWeight":
        data = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8))
        block, size = GGML_QUANT_SIZES[qtype]
        if data.ndim != 2 or cols % block or data.shape[1] != cols // block * size:
            raise ValueError(f"{qtype.name}: {tuple(data.shape)} bytes do not hold rows of {cols}")
        return cls(qtype, data, data.shape[0], cols)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> float32 [M, N]."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        m = x.shape[0]
        if x.shape[1] != self.in_features:
            raise ValueError(f"matmul of [{m}, {x.shape[1]}] with a [{self.out_features}, {self.in_features}] weight")
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        # beside a torch pool of several threads (divide_threads not called) the kernel keeps to one
        threads = _threads if torch.get_num_threads() == 1 else 1
        KERNEL.matmul(int(self.qtype), self.data.data_ptr(), self.data.shape[1], self.out_features,
                      self.in_features, x.data_ptr(), m, y.data_ptr(), threads, int(self.portable))
        return y
