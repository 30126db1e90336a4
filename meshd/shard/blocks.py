"""GGUF blocks multiplied as they are stored: the native lane's kernels for Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K and Q6_K, its RMSNorm and its attention over bfloat16 KV.

Rule: a `BlockWeight` holds the GGUF tensor's own bytes (memory follows the file, byte for byte; Q4_0
and Q4_1, and Q8_0 on AVX-512, reordered into tiles of eight rows where they pay, `tiles_pay`) and
multiplies them with integer dot products against float32 activations quantized to 8 bits per
32-wide block (for a K type, per 256-wide super-block, whose sub-block scales, mins and Q6_K's code
offset are then applied in integers, one float step per super-block), in meshd's C extension (`_blocks.c`, built with the package). Every output is summed in
one fixed order whatever the row count, batch, thread count or CPU (AVX-512, AVX2 or the portable C path), so
a row's bits never depend on its neighbours or on the peer. Where the extension did not build, `KERNEL`
is None, the lane falls back to torch's int4 layout, and its recipe layout says so.
RMSNorm and attention run per row in the same way: a query row attends as a decode step would, so a
pass of many positions gives each the bits one-position steps give (prefill, replay, verification).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

try:
    from meshd.shard import _blocks as KERNEL
except ImportError:  # the extension did not build here
    KERNEL = None

TYPES = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K}
_threads = len(os.sched_getaffinity(0))


def set_threads(n: int) -> None:
    """How many threads the kernel splits a matmul over (its own pool: the results do not depend on it)."""
    global _threads
    _threads = max(1, int(n))


def _pool_threads() -> int:
    """The kernel's threads for a call: beside a torch pool of several threads (divide_threads not
    called), one, so the two pools never spin against each other."""
    return _threads if torch.get_num_threads() == 1 else 1


def divide_threads(threads: int, recipe) -> None:
    """Give tensor work `threads` threads, called on the thread that computes. Where this recipe's
    matmuls run in the block kernel, its pool takes them and torch's ops (norms, attention, small
    elementwise work) run on one: two pools spinning on the same cores slowed a SmolLM2 decode step
    from 28 to 61-70 ms on 2 cores (measured). A matmul the kernel does not run still gets them all
    (`torch_matmul_threads`). Otherwise torch keeps them all."""
    global _lent
    if KERNEL is not None and recipe.weight_dtype == "stored":
        set_threads(threads)
        torch.set_num_threads(1)
        _lent = max(1, int(threads))
    else:
        _lent = 0
        torch.set_num_threads(threads)


_lent = 0  # the threads divide_threads gave the pool, lent back to torch for its own matmuls
LEND_ELEMENTS = 1 << 18  # a smaller weight is not worth waking torch's pool for (576 x 576 is 331 K)


@contextmanager
def torch_matmul_threads(weight_elements: int):
    """Around a torch matmul beside the kernel's pool (a float weight, torch's int4 layout): torch gets
    the pool's threads for it, the pool being idle meanwhile, then one again. Decided by the weight's
    size alone, so a weight always runs on the same threads whatever the rows (a batch, a row alone)."""
    if _lent <= 1 or weight_elements < LEND_ELEMENTS or torch.get_num_threads() != 1:
        yield
        return
    torch.set_num_threads(_lent)
    try:
        yield
    finally:
        torch.set_num_threads(1)


# v2: Q5_0, Q5_1, Q4_K, Q5_K and Q6_K joined the kernel (v1 ran them in torch's int4 layout)
# v3: K types' activations quantized per 256-wide super-block (with per-16 sums), not per 32
# v4: a 32-wide block is one exact integer sum (its code offset folded in) and one fused multiply-add,
#     not eight lanes of four elements each reduced at the end: half the float work a block
LAYOUT = (f"gguf-blocks ({','.join(sorted(t.name for t in TYPES))}) x q8-g32 activations (K types: q8-g256"
          " with per-16 sums, integer super-block sums), one integer sum and fma a 32-wide block;"
          " rms-norm, rope, silu and attention per row in _blocks.c; v4")


def available(qtype: QT) -> bool:
    """Whether tensors of this GGUF type run in this kernel here."""
    return KERNEL is not None and qtype in TYPES


ISAS = ("portable", "avx2", "avx512")  # each a superset of the one before; all give the same bits


def isa() -> str:
    """The instruction set the kernel runs on ("avx512", "avx2", "portable"), or "absent"."""
    return KERNEL.isa() if KERNEL is not None else "absent"


# Process-wide by nature: the instruction set is the C extension's own state, chosen once for the process
# (every weight runs on the one kernel this CPU and this cap allow; the bits are the same on each).
def limit_isa(name: str) -> None:
    """Run this process's kernels on at most `name` (one of ISAS) and what the CPU has, from now on
    (`limit_isa("avx512")` lifts an earlier limit): benches compare the instruction sets of one CPU
    with it, an operator can pin one (the bits are the same)."""
    if name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}: one of {', '.join(ISAS)}")
    if KERNEL is not None:
        KERNEL.limit_isa(name)


def _cap(portable: bool, at_most: str) -> int:
    """The kernel's argument for a call's instruction set: 0 the best, 1 + i ISAS[i] at most."""
    if portable:
        return 1
    return ISAS.index(at_most) + 1 if at_most else 0


TILE = 8  # rows a tile holds (_blocks_tiles.c)
TILED = 0x100  # or-ed into the kernel's qtype argument where the weight is in tiles
TILE_TYPES = {QT.Q4_0, QT.Q4_1, QT.Q8_0}


# auto: tiles where they pay (tiles_pay); rows: the file's order always; tiles: wherever the type allows
LAYOUTS = ("auto", "rows", "tiles")
# Process-wide until the shard's loaders (llama.py, linear.py) take the layout as a value: it is read where
# a weight is packed, several calls below the runtime that knows the settings; set once at start.
_layout = "auto"


def set_layout(name: str) -> None:
    """How weights loaded from now on are laid out, one of LAYOUTS (the bits are the same; benches
    compare them with it, an operator may pin one)."""
    global _layout
    if name not in LAYOUTS:
        raise ValueError(f"unknown weight layout {name!r}: one of {', '.join(LAYOUTS)}")
    _layout = name


def tiles_pay(qtype: QT) -> bool:
    """Whether this process keeps weights of this type in tiles: Q4_0 and Q4_1 where the kernel runs on
    AVX2 or AVX-512, Q8_0 on AVX-512 (the portable path reads tiles too, and gives the same bits). On
    AVX2, Q8_0 stays in rows: its tiles took 1.13x the time of its rows for one x row of a 49152 x 576
    LM head (0.92-0.94x on other shapes), though 0.5-0.6x for eight (recipe v4, median of five rounds,
    kernel time of one thread, CPU avx2 avx512f held to AVX2); on AVX-512 they took 0.73x, 0.33x and
    0.45x for one, eight and 128 x rows."""
    if _layout != "auto":
        return _layout == "tiles" and qtype in TILE_TYPES
    here = isa()
    return (qtype in (QT.Q4_0, QT.Q4_1) and here in ("avx2", "avx512")) or (qtype == QT.Q8_0 and here == "avx512")


def tile(qtype: QT, rows: np.ndarray) -> np.ndarray:
    """A [n, row bytes] matrix of GGUF blocks (n a multiple of TILE) as tiles: the same bytes, the
    same shape, reordered as _blocks_tiles.c lays them out (per tile of eight rows and per block: the
    rows' d halves, Q4_1's m halves, then each group of four code bytes, row after row)."""
    n, row_bytes = rows.shape
    _, size = GGML_QUANT_SIZES[qtype]
    if qtype not in TILE_TYPES or n % TILE or row_bytes % size:
        raise ValueError(f"{qtype.name} [{n}, {row_bytes}] bytes cannot be tiled")
    # in C, one pass (numpy's transposes took 1.4 s of a 663 MB load; the tests keep them as the reference)
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    out = np.empty_like(rows)
    KERNEL.tile(int(qtype), rows.ctypes.data, out.ctypes.data, n, row_bytes)
    return out


@functools.cache
def _lane_bytes(qtype: QT) -> np.ndarray:
    """[TILE, block bytes]: where each byte of lane r's block sits in its tile-block."""
    _, size = GGML_QUANT_SIZES[qtype]
    halves = 2 if qtype == QT.Q4_1 else 1
    head, skip = 16 * halves, 2 * halves
    at = np.empty((TILE, size), np.int64)
    for r in range(TILE):
        for h in range(halves):
            at[r, 2 * h:2 * h + 2] = 16 * h + 2 * r + np.arange(2)
        j = np.arange(size - skip)
        at[r, skip:] = head + 32 * (j // 4) + 4 * r + j % 4
    return at


def untile_rows(qtype: QT, tiled: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a matrix kept in tiles, back as the file's rows of blocks ([len(ids), row bytes]):
    an embedding table whose bytes the tied LM head multiplies in tiles looks its rows up here."""
    n, row_bytes = tiled.shape
    _, size = GGML_QUANT_SIZES[qtype]
    ids = np.asarray(ids, np.int64)
    blk = tiled.reshape(n // TILE, row_bytes // size, TILE * size)[ids // TILE]
    where = _lane_bytes(qtype)[ids % TILE][:, None, :]
    return np.take_along_axis(blk, np.broadcast_to(where, (len(ids), blk.shape[1], size)), axis=2).reshape(len(ids), row_bytes)


@dataclass
class BlockWeight:
    """A [out, in] matrix as GGUF blocks: `data` is uint8 [out, bytes per row], the file's bytes,
    in rows or (`tiled`) reordered into tiles of eight rows: the same bytes and the same bits out."""

    qtype: QT
    data: torch.Tensor
    out_features: int
    in_features: int
    portable: bool = False  # force the portable C path (tests compare it with AVX2)
    at_most: str = ""  # an instruction set (ISAS) to stay within; "" the best this CPU has
    tiled: bool = False

    @classmethod
    def from_raw(cls, qtype: QT, rows: np.ndarray, cols: int, tiles: bool | None = None) -> "BlockWeight":
        """The matrix from its GGUF rows; in tiles where `tiles` (None: where they pay here and the
        type and row count allow; pass False for bytes shared with something that reads rows)."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        block, size = GGML_QUANT_SIZES[qtype]
        if rows.ndim != 2 or cols % block or rows.shape[1] != cols // block * size:
            raise ValueError(f"{qtype.name}: {tuple(rows.shape)} bytes do not hold rows of {cols}")
        if tiles is None:
            tiles = tiles_pay(qtype) and rows.shape[0] % TILE == 0
        data = torch.from_numpy(tile(qtype, rows) if tiles else rows)
        return cls(qtype, data, data.shape[0], cols, tiled=bool(tiles))

    @property
    def kernel_type(self) -> int:
        """The block type as the kernel takes it (TILED or-ed in for tiles)."""
        return int(self.qtype) | (TILED if self.tiled else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def mm(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> float32 [M, N]; with `add_to` (float32 [M, N], contiguous) the product is
        added into it, each element once, as `add_to + x @ W.T` rounds."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        m = x.shape[0]
        if x.shape[1] != self.in_features:
            raise ValueError(f"matmul of [{m}, {x.shape[1]}] with a [{self.out_features}, {self.in_features}] weight")
        if add_to is None:
            y = torch.empty(m, self.out_features, dtype=torch.float32)
        elif add_to.shape != (m, self.out_features) or add_to.dtype != torch.float32 or not add_to.is_contiguous():
            raise ValueError(f"cannot add a [{m}, {self.out_features}] product into {tuple(add_to.shape)} {add_to.dtype}")
        else:
            y = add_to
        KERNEL.matmul(self.kernel_type, self.data.data_ptr(), self.data.shape[1], self.out_features,
                      self.in_features, x.data_ptr(), m, y.data_ptr(), _pool_threads(), _cap(self.portable, self.at_most),
                      int(add_to is not None))
        return y


@dataclass
class Norm:
    """An RMSNorm weight (float32) whose norm runs in the kernel (`llama.rms_norm` dispatches on it)."""

    weight: torch.Tensor
    portable: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def apply(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over x's last dimension, in float32, returned in x's dtype."""
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        y = torch.empty_like(x2)
        KERNEL.rms_norm(x2.data_ptr(), self.weight.data_ptr(), x2.shape[0], x2.shape[1], float(eps),
                        y.data_ptr(), int(self.portable))
        y = y.view(shape)
        return y if dtype == torch.float32 else y.to(dtype)


def norm_weight(w: torch.Tensor, recipe):
    """A norm weight as the recipe runs it: a `Norm` where the native lane has the kernel."""
    w = w.float().contiguous()
    return Norm(w) if KERNEL is not None and recipe.weight_dtype == "stored" else w


def attends(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `attention` runs this in the kernel: float32 queries over bfloat16 KV (the native lane)."""
    return KERNEL is not None and q.dtype == torch.float32 and keys.dtype == torch.bfloat16


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, portable: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [1, heads, n, hd] (positions pos..) over keys and values [1, kv heads,
    pos + n, hd]: [1, heads, n, hd] float32, every row as a decode step computes it (written into
    `out`, a contiguous float32 [n, heads * hd], when given)."""
    _, heads, n, hd = q.shape
    kv_heads = keys.shape[1]
    if q.stride(3) != 1:
        q = q.contiguous()
    if keys.stride(3) != 1 or values.stride(3) != 1 or keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    if keys.shape[2] < pos + n:
        raise ValueError(f"attention at positions {pos}..{pos + n - 1} over {keys.shape[2]} cached")
    if out is None:
        out = torch.empty(1, n, heads, hd, dtype=torch.float32)
    elif out.shape != (n, heads * hd) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"attention output must be float32 [{n}, {heads * hd}], not {tuple(out.shape)}")
    KERNEL.attend(q.data_ptr(), q.stride(2), q.stride(1), keys.data_ptr(), values.data_ptr(), keys.stride(1),
                  keys.stride(2), heads, kv_heads, hd, pos, n, out.data_ptr(), int(portable), _pool_threads())
    return out.view(1, n, heads, hd).transpose(1, 2)


def rope_kv(qkv: torch.Tensor, pos: int, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, kv_heads: int,
            keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One session's rows of a fused QKV output (float32 [n, (heads + 2 kv heads) * hd], contiguous
    rows) at positions pos..: its keys (rotated) and values go into the layer's caches `keys` and
    `values` (bfloat16 [1, kv heads, capacity, hd]); its queries come back rotated, [1, heads, n, hd].
    The rotation is `Rotary`'s tables' (x cos + roll(x) signed sin)."""
    n, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or width != (heads + 2 * kv_heads) * hd:
        raise ValueError(f"rope_kv: float32 rows of (heads + 2 kv heads) * head dim expected, not {tuple(qkv.shape)}")
    if pos + n > min(cos.shape[0], keys.shape[2]) or keys.dtype != torch.bfloat16 or keys.stride() != values.stride():
        raise ValueError(f"rope_kv: positions {pos}..{pos + n - 1} do not fit the tables or the cache")
    q = torch.empty(n, heads, hd, dtype=torch.float32)
    KERNEL.rope_kv(qkv.data_ptr(), qkv.stride(0), pos, n, cos.data_ptr(), signed_sin.data_ptr(), heads, kv_heads, hd,
                   q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(1), keys.stride(2))
    return q.view(1, n, heads, hd).transpose(1, 2)


def silu_mul(gate_up: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """SwiGLU's middle: float32 [M, 2F] (gate, then up) -> silu(gate) * up, [M, F]."""
    if gate_up.dtype != torch.float32 or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        raise ValueError("silu_mul: contiguous float32 [M, 2F] expected")
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, f, dtype=torch.float32)
    KERNEL.silu_mul(gate_up.data_ptr(), m, f, out.data_ptr(), int(portable))
    return out


def layer_args(p) -> tuple:
    """A Llama layer's weights as `layer` takes them (each: block type, data, row bytes, out features)."""
    def ref(w: BlockWeight) -> tuple:
        return (w.kernel_type, w.data.data_ptr(), w.data.shape[1], w.out_features)

    return (p.attn_norm.weight.data_ptr(), p.ffn_norm.weight.data_ptr(),
            *ref(p.wqkv), *ref(p.wo), *ref(p.w_gate_up), *ref(p.w_down))


def layer(y: torch.Tensor, weights: tuple, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
          kv_heads: int, head_dim: int, segments: list[tuple[int, int, int, torch.Tensor, torch.Tensor]],
          portable: bool = False) -> torch.Tensor:
    """A whole Llama decoder layer in place on y (float32 [R, hidden], contiguous): the bits of its
    steps one by one (norm, qkv, RoPE into each session's cache, attention, o + residual, norm,
    gate/up, silu * up, down + residual). `weights` from `layer_args`; `segments` per session:
    (first row, rows, first position, its layer's keys, its layer's values) with the caches
    bfloat16 [1, kv heads, capacity, hd] and room for the positions."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.ndim != 2:
        raise ValueError("layer: y must be contiguous float32 [rows, hidden]")
    seg = np.array(_segment_table(segments, cos), dtype=np.int64)
    KERNEL.layer(y.data_ptr(), y.shape[0], y.shape[1], float(eps), *weights, cos.data_ptr(), signed_sin.data_ptr(),
                 heads, kv_heads, head_dim, seg.ctypes.data, len(seg), _pool_threads(), int(portable))
    return y


def _segment_table(segments, cos: torch.Tensor) -> list[tuple]:
    """`segments` as the kernel reads them: (row, n, position, keys, values, head stride, position stride)."""
    table = []
    for row, n, pos, keys, values in segments:
        if pos + n > min(keys.shape[2], cos.shape[0]) or keys.dtype != torch.bfloat16 or keys.stride() != values.stride():
            raise ValueError(f"layer: positions {pos}..{pos + n - 1} do not fit the tables or the cache")
        table.append((row, n, pos, keys.data_ptr(), values.data_ptr(), keys.stride(1), keys.stride(2)))
    return table


def layers(y: torch.Tensor, weights: list[tuple], eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
           heads: int, kv_heads: int, head_dim: int, segments: list[list[tuple]], portable: bool = False) -> torch.Tensor:
    """`layer` for several layers one after another in one kernel call: weights[i] and segments[i] are
    layer i's (each session's segments in the same order in every layer). The bits are those of the
    calls one by one; what it saves is Python between the layers."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.ndim != 2:
        raise ValueError("layers: y must be contiguous float32 [rows, hidden]")
    if len(weights) != len(segments) or len({len(s) for s in segments}) > 1:
        raise ValueError("layers: one weight tuple and one equal list of segments a layer")
    w = np.array(weights, dtype=np.int64).reshape(len(weights), 18)
    seg = np.array([_segment_table(s, cos) for s in segments], dtype=np.int64).reshape(len(segments), -1, 7)
    KERNEL.layers(y.data_ptr(), y.shape[0], y.shape[1], float(eps), len(weights), w.ctypes.data, cos.data_ptr(),
                  signed_sin.data_ptr(), heads, kv_heads, head_dim, seg.ctypes.data, seg.shape[1], _pool_threads(),
                  int(portable))
    return y
