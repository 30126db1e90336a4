"""GGUF quantized blocks turned, without loss, into the layout torch's int4 CPU kernel multiplies: the
native lane's layout where meshd's C kernel (`blocks.py`) did not build.

Rule: a block type is first decoded into affine codes, `w = a * u + b` per group of 32 along a row
(u unsigned, 4 or 8 bits), which is what every supported GGUF type is. 4-bit codes become one int4
matrix (`w = (u - 8) * scale + zero`, scale = a, zero = 8a + b). 8-bit codes (Q8_0, and Q5_x's
5-bit ones) split into two int4 halves laid side by side along K, `u = 16 * hi + lo`, multiplied by
the activations repeated twice: the same result from one kernel call, at 10 bits a weight instead
of the 16 of bfloat16. Q6_K's 16-wide sub-blocks do not fit 32-wide groups: it is re-quantized to
8-bit codes per 32 (the smallest loss at that size; measured in tests). Anything else is refused by
name. A tensor is packed in row chunks, so the int32 staging copy stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

GROUP = 32
PACK_ROWS = 1024  # rows packed per kernel call (a multiple of the kernel's 64-row tiles; small staging)
FLOAT_TYPES = {QT.F32: np.float32, QT.F16: np.float16}
STORED_FLOATS = {QT.F32, QT.F16, QT.BF16}  # not block-quantized: the native lane keeps them as stored
LOSSLESS = {QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q8_0}
REQUANTIZED = {QT.Q6_K}
SUPPORTED = LOSSLESS | REQUANTIZED | STORED_FLOATS
LAYOUT = "int4-g32 (4-bit codes) | dual-int4-g32 (8-bit codes) | Q6_K->q8-g32; scales in the matmul dtype; v1"


class UnsupportedQuantization(ValueError):
    """The native lane has no layout for this GGUF tensor type."""


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A GGUF tensor's stored bytes: `data` is uint8 [rows, bytes per row]; `shape` is [rows, cols]."""

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class Codes:
    """w[n, k] = a[n, k // 32] * u[n, k] + b[n, k // 32]."""

    u: np.ndarray  # uint8 [N, K]
    a: np.ndarray  # float32 [N, K // 32]
    b: np.ndarray  # float32 [N, K // 32]
    bits: int  # 4 or 8


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles first, then high nibbles (GGUF's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1: bit j of a little-endian u32 is element j's fifth bit."""
    bits = np.ascontiguousarray(qh).view("<u4") >> np.arange(n, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def decode(raw: RawTensor) -> Codes:
    """Affine codes of a quantized tensor, exact for the LOSSLESS types."""
    rows, cols = raw.shape
    block, size = GGML_QUANT_SIZES[raw.qtype]
    if cols % GROUP or cols % block:
        raise UnsupportedQuantization(f"{raw.name}: rows of {cols} do not split into {GROUP}-wide groups")
    b = raw.data.reshape(-1, size)
    qt = raw.qtype
    if qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        d = _f16(b[:, 0:2])
        if qt == QT.Q8_0:
            u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return _codes(u, d, -128 * d, 8, rows)
        off = 4 if qt in (QT.Q4_1, QT.Q5_1) else 2
        m = _f16(b[:, 2:4]) if off == 4 else None
        if qt in (QT.Q4_0, QT.Q4_1):
            u = _nibbles(b[:, off:])
            return _codes(u, d, m if m is not None else -8 * d, 4, rows)
        u = _nibbles(b[:, off + 4:]) | (_high_bits(b[:, off:off + 4], 32) << 4)
        return _codes(u, d, m if m is not None else -16 * d, 8, rows)
    if qt in (QT.Q4_K, QT.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        a, off = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)  # [blocks, 8]
        if qt == QT.Q4_K:
            # each 32-byte chunk holds sub-block 2c in its low nibbles, 2c + 1 in its high ones
            qs = b[:, 16:].reshape(-1, 4, 32)
            u = np.stack([qs & 0x0F, qs >> 4], 2)
            return _codes(u.reshape(-1, 256), a, off, 4, rows)
        qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
        low = np.stack([qs & 0x0F, qs >> 4], 2).reshape(-1, 8, 32)
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        return _codes((low | (high << 4)).reshape(-1, 256), a, off, 8, rows)
    if qt in REQUANTIZED:
        return requantize8(dequantize(raw.data, qt).reshape(rows, cols))
    raise UnsupportedQuantization(f"{raw.name}: GGUF type {qt.name} has no native layout"
                                  f" (supported: {sorted(t.name for t in SUPPORTED)}); use --recipe exact")


def _codes(u: np.ndarray, a: np.ndarray, b: np.ndarray, bits: int, rows: int) -> Codes:
    return Codes(u.reshape(rows, -1), a.reshape(rows, -1).astype(np.float32),
                 b.reshape(rows, -1).astype(np.float32), bits)


def requantize8(w: np.ndarray) -> Codes:
    """Symmetric 8-bit codes per 32-wide group (absmax / 127) of a float32 [N, K] matrix."""
    g = w.reshape(w.shape[0], -1, GROUP)
    scale = np.abs(g).max(axis=-1) / 127.0
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(g / safe[..., None]), -127, 127).astype(np.int16)
    return Codes((q + 128).astype(np.uint8).reshape(w.shape), scale.astype(np.float32),
                 (-128 * scale).astype(np.float32), 8)


@dataclass
class Int4Weight:
    """A weight in torch's int4 CPU layout; `dual` weights take the activations repeated twice."""

    packed: torch.Tensor  # uint8, the kernel's own layout
    scales_zeros: torch.Tensor  # [groups, rows (padded to 16), 2]
    out_features: int
    in_features: int
    dual: bool

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def act_dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in the weight's activation dtype."""
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if self.dual:
            x = torch.cat([x, x], dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]


def _halves(codes: Codes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit codes for the kernel, with its scale and zero per group (see the module rule)."""
    u, a, b = codes.u, codes.a, codes.b
    if codes.bits == 4:
        return u, a, 8 * a + b
    # u = 16 * hi + lo: hi carries 16a per step, lo carries a and the offset
    return (np.concatenate([u >> 4, u & 0x0F], axis=1), np.concatenate([16 * a, a], axis=1),
            np.concatenate([128 * a, 8 * a + b], axis=1))


def pack(raw: RawTensor, dtype: torch.dtype) -> Int4Weight:
    """A quantized GGUF matrix in the int4 kernel's layout, scales and zeros in `dtype` (the
    activations' dtype). Decoded and packed PACK_ROWS rows at a time."""
    rows, cols = raw.shape
    padded = -(-rows // 16) * 16  # the kernel wants whole 16-row tiles
    packed = sz = None
    for r in range(0, padded, PACK_ROWS):
        n = min(PACK_ROWS, padded - r)
        part = raw.data[r:r + n]
        u, scale, zero = _halves(decode(RawTensor(raw.name, raw.qtype, (len(part), cols), part)))
        if packed is None:
            dual = u.shape[1] != cols
            packed = torch.empty(padded, u.shape[1] // 2, dtype=torch.uint8)
            sz = torch.zeros(scale.shape[1], padded, 2, dtype=dtype)
        staging = np.zeros((n, u.shape[1]), np.int32)
        staging[:len(u)] = u
        packed[r:r + n] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(staging), 1)
        sz[:, r:r + len(u), 0] = torch.from_numpy(scale.T)
        sz[:, r:r + len(u), 1] = torch.from_numpy(zero.T)
    return Int4Weight(packed, sz, rows, cols, dual)


def native_bytes(qtype: QT, shape: tuple[int, ...], act_itemsize: int = 2) -> int:
    """Resident bytes of a GGUF tensor in the native lane: packed int4 for quantized matrices,
    the stored bytes for everything kept as stored (float tensors, vectors)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) if shape else 1
    if qtype not in (LOSSLESS | REQUANTIZED) or len(shape) < 2:
        return n // block * size
    rows = -(-(n // shape[-1]) // 16) * 16  # experts stacked in 3-D count as rows too
    cols = shape[-1] * (1 if qtype in (QT.Q4_0, QT.Q4_1, QT.Q4_K) else 2)
    return rows * cols // 2 + (cols // GROUP) * rows * 2 * act_itemsize


class QuantRows:
    """An embedding table kept as its GGUF bytes; looked-up rows are dequantized on the way out."""

    def __init__(self, raw: RawTensor) -> None:
        self.qtype, self.shape = raw.qtype, raw.shape
        self.data = torch.from_numpy(np.ascontiguousarray(raw.data))
        self.tiled = False  # its bytes in the block kernel's tiles (a tied LM head's), rows read back from them

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def retile(self) -> None:
        """Keep the bytes in tiles of eight rows from now on (no copy kept in rows: the same size)."""
        from meshd.shard import blocks

        if not self.tiled:
            self.data = torch.from_numpy(blocks.tile(self.qtype, self.data.numpy()))
            self.tiled = True

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [..., n] -> float32 [..., n, cols]."""
        if self.tiled:
            from meshd.shard import blocks

            rows = blocks.untile_rows(self.qtype, self.data.numpy(), ids.reshape(-1).numpy())
        else:
            rows = self.data[ids.reshape(-1)].numpy()
        out = dequantize(rows, self.qtype).reshape(*ids.shape, self.shape[1])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
