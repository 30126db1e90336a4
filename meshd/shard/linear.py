"""Weights as the recipe stores them, and the one `linear` that runs them.

Rules: `exact` keeps float32 weights and calls `F.linear`. `compact` keeps int8 weights with one
scale per output row and calls torch's int8-weight matmul. `native` keeps each GGUF tensor at its
stored bit width (`blocks.BlockWeight`, the file's own bytes, for the block types meshd's C kernel
runs; `quant.Int4Weight` for the other quantized types; the stored float dtype otherwise). A
weight casts the activations to the dtype its kernel takes; its output stays in that dtype, and
adding it to a float32 residual stream promotes it back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshd.shard import blocks, quant


@dataclass
class Int8Weight:
    q: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], in the compute dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scales]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(self.scales.dtype), self.q, self.scales)


@dataclass
class ConcatWeight:
    """Row blocks stored in different layouts (e.g. Q, K and V of different GGUF types), run as one."""

    parts: list

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in weight_tensors(p)]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        outs = [_mm(x, p) for p in self.parts]
        dtype = functools.reduce(torch.promote_types, (o.dtype for o in outs))
        return torch.cat([o.to(dtype) for o in outs], dim=-1)


Weight = torch.Tensor | Int8Weight | blocks.BlockWeight | quant.Int4Weight | ConcatWeight


def weight_tensors(w) -> list[torch.Tensor]:
    return [w] if isinstance(w, torch.Tensor) else w.tensors()


def make_weight(w: torch.Tensor, weight_dtype: str, compute_dtype: torch.dtype) -> Weight:
    """Store a float32 [out, in] weight as the recipe asks: float32, bfloat16 or int8 per row."""
    if weight_dtype == "int8":
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            raise RuntimeError("this torch build has no int8 weight matmul; use the exact recipe")
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Weight(q.contiguous(), scales.to(compute_dtype))
    return w.to(getattr(torch, weight_dtype)).contiguous()


def native_weight(parts: list, act_dtype: torch.dtype) -> Weight:
    """Row-concatenated parts, each a `quant.RawTensor` (GGUF) or a torch tensor as stored (HF),
    kept at their stored width. Parts of one type are packed together, so they run as one matmul."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()
    groups: list[list] = []
    for p in parts:
        if groups and groups[-1][0].qtype == p.qtype:
            groups[-1].append(p)
        else:
            groups.append([p])
    weights = [_native_one(g, act_dtype) for g in groups]
    return weights[0] if len(weights) == 1 else ConcatWeight(weights)


def _native_one(group: list, act_dtype: torch.dtype) -> Weight:
    qtype, cols = group[0].qtype, group[0].shape[1]
    data = np.concatenate([p.data for p in group]) if len(group) > 1 else group[0].data
    raw = quant.RawTensor(group[0].name, qtype, (sum(p.shape[0] for p in group), cols), data)
    if qtype in quant.FLOAT_TYPES:
        return torch.from_numpy(data.view(quant.FLOAT_TYPES[qtype]).reshape(raw.shape).copy())
    if qtype == quant.QT.BF16:
        return torch.from_numpy(data.view(np.int16).reshape(raw.shape).copy()).view(torch.bfloat16)
    if blocks.available(qtype):
        return blocks.BlockWeight.from_raw(qtype, data, cols)
    return quant.pack(raw, act_dtype)


def _mm(x2: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, (blocks.BlockWeight, ConcatWeight)):
        return w.mm(x2)
    with blocks.torch_matmul_threads(w.shape[0] * w.shape[1]):  # torch's own kernels
        if isinstance(w, torch.Tensor):
            return F.linear(x2 if x2.dtype == w.dtype else x2.to(w.dtype), w)
        return w.mm(x2)


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor) and x.dtype == w.dtype:
        with blocks.torch_matmul_threads(w.numel()):
            return F.linear(x, w, b)
    y = _mm(x.reshape(-1, x.shape[-1]), w)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if b is None else y + b


def load_matrix(artifact, names: list[str], recipe, rows=None, transpose_hf: bool = False) -> Weight:
    """The row-concatenation of the named [out, in] matrices, stored as the recipe says.

    `rows(name, array)` may reorder a matrix's rows (it is given float rows or, in the native lane,
    the GGUF's quantized rows: a row's blocks never straddle rows). `transpose_hf` turns a Hugging
    Face Conv1D [in, out] weight around.
    """
    rows = rows or (lambda name, a: a)
    if recipe.weight_dtype == "stored":
        if artifact.kind == "gguf":
            parts = []
            for n in names:
                raw = artifact.raw(n)
                parts.append(quant.RawTensor(n, raw.qtype, raw.shape, rows(n, raw.data)))
        else:
            parts = [artifact.read_stored(n) for n in names]
            parts = [(p.T if transpose_hf else p).contiguous() for p in parts]
        return native_weight(parts, recipe.torch_matmul)
    arrays = [rows(n, artifact.read(n)) for n in names]
    arrays = [a.T if transpose_hf and artifact.kind == "hf" else a for a in arrays]
    w = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    return make_weight(torch.from_numpy(np.ascontiguousarray(w)), recipe.weight_dtype, recipe.torch_compute)


def load_expert_matrices(artifact, names: list[str], recipe) -> list[Weight]:
    """Per expert, the row-concatenation of the named 3-D GGUF tensors [experts, out, in], each
    read once and stored as the recipe says (one expert's rows never mix with another's)."""
    if recipe.weight_dtype == "stored":
        raws = [artifact.raw(n) for n in names]
        n_experts = raws[0].shape[0]
        per = []
        for e in range(n_experts):
            parts = []
            for r in raws:
                rows = r.data.shape[0] // n_experts
                parts.append(quant.RawTensor(r.name, r.qtype, (rows, r.shape[-1]), r.data[e * rows:(e + 1) * rows]))
            per.append(native_weight(parts, recipe.torch_matmul))
        return per
    arrays = [artifact.read(n) for n in names]
    return [make_weight(torch.from_numpy(np.ascontiguousarray(np.concatenate([a[e] for a in arrays]))),
                        recipe.weight_dtype, recipe.torch_compute) for e in range(arrays[0].shape[0])]


def load_table(artifact, name: str, recipe):
    """An embedding table: float32 rows, or in the native lane the GGUF's own quantized rows."""
    if recipe.weight_dtype == "stored" and artifact.tensor_qtype(name) not in (None, *quant.STORED_FLOATS):
        return quant.QuantRows(artifact.raw(name))
    return torch.from_numpy(np.ascontiguousarray(artifact.read(name)))


def lookup(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table as float32."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.lookup(ids)
