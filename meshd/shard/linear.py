"""Weights as the recipe stores them, and the one `linear` that runs them.

Rule: the exact recipe keeps float32 weights and calls `F.linear`; the compact recipe keeps int8
weights with one scale per output row (weight-only quantization: activations stay bfloat16) and
calls torch's int8-weight matmul, which reads a quarter of the bytes of float32 per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8Weight:
    q: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], in the compute dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scales]


Weight = torch.Tensor | Int8Weight


def make_weight(w: torch.Tensor, weight_dtype: str, compute_dtype: torch.dtype) -> Weight:
    """Store a float32 [out, in] weight as the recipe asks: float32, bfloat16 or int8 per row."""
    if weight_dtype == "int8":
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            raise RuntimeError("this torch build has no int8 weight matmul; use the exact recipe")
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Weight(q.contiguous(), scales.to(compute_dtype))
    return w.to(getattr(torch, weight_dtype)).contiguous()


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, Int8Weight):
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w.q, w.scales)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if b is None else y + b
    return F.linear(x, w, b)
