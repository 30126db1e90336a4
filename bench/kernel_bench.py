"""The native lane's matmul kernels against ggml's on the same GGUF blocks, side by side in one run.

For SmolLM2's matrix shapes (and an 8B MLP's; or Gemma 3 270M's with `--shapes gemma`) in any of the
kernel's types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; a K type only where K is a multiple of
256), and for 1, 4, 8 and 128 rows of activations, times y = x @ W.T three ways on the same bytes, 2
threads each:
  - meshd: the block kernel (`meshd.shard.blocks`, meshd/shard/_blocks.c)
  - ggml: `ggml_mul_mat` from the libggml that llama-cpp-python ships (called through ctypes, one
    graph built per shape and reused; optional: `bash scripts/bench-extra.sh` builds it)
  - torch: torch's int4 kernel on the layout the lane used before (`quant.pack`, bfloat16 activations)
  - on a CPU with AVX-512 VNNI, also meshd's kernel held to its AVX2 path (the same bits)
  - where meshd keeps the type in tiles of eight rows (blocks.tiles_pay), also the file's row layout
Each is timed "hot" (one matrix, in cache) and "cold" (cycling through enough copies to exceed the
last-level cache, as a decode step meets its weights). Medians of repeated calls; the ratio column
is ggml's time over meshd's (above 1: meshd is faster).
K-type weights are random blocks (gguf cannot quantize to them): the same bytes for all three.
`--single` runs each on one thread and takes the median thread CPU time of a call instead of wall
clock: on a shared, oversubscribed box the time a call waited for a core then does not count.
Usage: python bench/kernel_bench.py [--rows 1,4,8,128] [--types Q4_1,Q8_0] [--shapes smollm2|gemma] [--big]
       [--single]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import quantize

from meshd.shard import blocks, quant

THREADS = 2
SHAPES = [(960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate+up"), (576, 1536, "down"), (49152, 576, "lm head")]
GEMMA = [(1536, 640, "qkv"), (640, 1024, "o"), (4096, 640, "gate+up"), (640, 2048, "down"), (262144, 640, "lm head")]
BIG = [(14336, 4096, "8B up")]
K_HALVES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}  # where a super-block keeps its f16 scales
COLD_BYTES = 96 << 20  # copies enough to leave a 32 MiB last-level cache behind


class Ggml:
    """The few ggml calls a matmul needs: a context, two tensors, one mul_mat graph."""

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self, libdir: Path) -> None:
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=mode)
        b, c = self.base, self.cpu
        b.ggml_init.restype = ctypes.c_void_p
        b.ggml_init.argtypes = [self.InitParams]
        b.ggml_new_tensor_2d.restype = ctypes.c_void_p
        b.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        b.ggml_mul_mat.restype = ctypes.c_void_p
        b.ggml_mul_mat.argtypes = [ctypes.c_void_p] * 3
        b.ggml_new_graph.restype = ctypes.c_void_p
        b.ggml_new_graph.argtypes = [ctypes.c_void_p]
        b.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_get_data.restype = ctypes.c_void_p
        b.ggml_get_data.argtypes = [ctypes.c_void_p]
        b.ggml_free.argtypes = [ctypes.c_void_p]
        c.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        c.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        c.ggml_cpu_init()

    def matmul(self, qtype: QT, raw: np.ndarray, n: int, k: int, m: int, copies: int):
        """A callable that computes x @ W.T in ggml over one of `copies` weight copies in turn."""
        # weights, activations, outputs, a graph per copy and the work buffer the compute takes from ctx
        # (K types quantize x to Q8_K, a larger work buffer: 64 MiB of slack fell 0.4 MiB short)
        size = copies * (raw.nbytes + m * n * 4 + (1 << 20)) + m * k * 4 + (1 << 30)
        ctx = self.base.ggml_init(self.InitParams(size, None, False))
        x = self.base.ggml_new_tensor_2d(ctx, 0, k, m)  # GGML_TYPE_F32 = 0; ne0 is the row length
        ctypes.memmove(self.base.ggml_get_data(x), np.random.default_rng(1).standard_normal((m, k)).astype(np.float32).ctypes.data, m * k * 4)
        graphs = []
        for _ in range(copies):
            w = self.base.ggml_new_tensor_2d(ctx, int(qtype), k, n)
            ctypes.memmove(self.base.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
            g = self.base.ggml_new_graph(ctx)
            self.base.ggml_build_forward_expand(g, self.base.ggml_mul_mat(ctx, w, x))
            graphs.append(g)
        state = {"i": 0}

        def run() -> None:
            g = graphs[state["i"] % copies]
            state["i"] += 1
            self.cpu.ggml_graph_compute_with_ctx(ctx, g, THREADS)

        return run, lambda: self.base.ggml_free(ctx)


def find_ggml() -> Ggml | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    libdir = Path(spec.origin).parent / "lib"
    return Ggml(libdir) if (libdir / "libggml-cpu.so").exists() else None


def weight_bytes(qtype: QT, n: int, k: int, rng) -> np.ndarray | None:
    """A [n, k] matrix in `qtype`, as GGUF stores it; None where k does not fill its blocks."""
    elems, size = GGML_QUANT_SIZES[qtype]
    if k % elems:
        return None
    if qtype not in K_HALVES:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for at in K_HALVES[qtype]:
        raw[:, :, at:at + 2] = (rng.uniform(0.5, 2.0, (n, k // elems, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


CLOCK = time.perf_counter  # time.thread_time with --single


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times) * 1e3


def cycling(items: list, call):
    state = {"i": 0}

    def run():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        call(item)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,128")
    ap.add_argument("--types", default="Q4_1,Q4_0,Q8_0")
    ap.add_argument("--shapes", choices=["smollm2", "gemma"], default="smollm2", help="whose matrix shapes")
    ap.add_argument("--big", action="store_true", help="also an 8B model's MLP matrix (14336 x 4096)")
    ap.add_argument("--single", action="store_true", help="one thread each, median thread CPU time")
    args = ap.parse_args()
    global THREADS, CLOCK
    if args.single:
        THREADS, CLOCK = 1, time.thread_time
    torch.set_num_threads(1)
    blocks.set_threads(THREADS)
    ggml = find_ggml()
    rng = np.random.default_rng(0)
    results = []
    shapes = (GEMMA if args.shapes == "gemma" else SHAPES) + (BIG if args.big else [])
    for qname in args.types.split(","):
        qtype = QT[qname]
        for n, k, label in shapes:
            raw = weight_bytes(qtype, n, k, rng)
            if raw is None:
                continue
            copies = max(1, min(64, COLD_BYTES // raw.nbytes))
            ours = [blocks.BlockWeight.from_raw(qtype, raw.copy(), k) for _ in range(copies)]
            rows_too = ours[0].tiled  # then the file's row layout as well, side by side (the same bits)
            in_rows = [blocks.BlockWeight.from_raw(qtype, raw.copy(), k, tiles=False) for _ in range(copies)] if rows_too else []
            theirs_int4 = quant.pack(quant.RawTensor(label, qtype, (n, k), raw), torch.bfloat16)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                calls = max(5, min(200, int(2e8 // (n * k * max(m, 8)))))
                row = {"type": qname, "shape": [n, k], "what": label, "rows": m}
                row["meshd_hot_ms"] = median_ms(lambda: ours[0].mm(x), calls)
                row["meshd_cold_ms"] = median_ms(cycling(ours, lambda w: w.mm(x)), calls)
                row["layout"] = "tiles" if rows_too else "rows"
                if rows_too:
                    row["meshd_rows_hot_ms"] = median_ms(lambda: in_rows[0].mm(x), calls)
                    row["meshd_rows_cold_ms"] = median_ms(cycling(in_rows, lambda w: w.mm(x)), calls)
                if blocks.isa() == "avx512":  # the same kernel held to AVX2, as most desktops run it
                    avx2 = [dataclasses.replace(w, at_most="avx2") for w in ours]
                    row["meshd_avx2_hot_ms"] = median_ms(lambda: avx2[0].mm(x), calls)
                    row["meshd_avx2_cold_ms"] = median_ms(cycling(avx2, lambda w: w.mm(x)), calls)
                torch.set_num_threads(THREADS)
                xb = x.bfloat16()
                row["torch_int4_hot_ms"] = median_ms(lambda: theirs_int4.mm(xb), calls)
                torch.set_num_threads(1)
                if ggml is not None:
                    hot, free_hot = ggml.matmul(qtype, raw, n, k, m, 1)
                    row["ggml_hot_ms"] = median_ms(hot, calls)
                    free_hot()
                    cold, free_cold = ggml.matmul(qtype, raw, n, k, m, copies)
                    row["ggml_cold_ms"] = median_ms(cold, calls)
                    free_cold()
                    row["ggml_over_meshd_hot"] = row["ggml_hot_ms"] / row["meshd_hot_ms"]
                    row["ggml_over_meshd_cold"] = row["ggml_cold_ms"] / row["meshd_cold_ms"]
                results.append(row)
                print(f"{qname:5} {label:8} {n:6}x{k:<5} rows {m:4}  meshd {row['meshd_hot_ms']:8.3f} /"
                      f" {row['meshd_cold_ms']:8.3f}   ggml {row.get('ggml_hot_ms', float('nan')):8.3f} /"
                      f" {row.get('ggml_cold_ms', float('nan')):8.3f}   torch-int4 {row['torch_int4_hot_ms']:8.3f}"
                      f"   ggml/meshd {row.get('ggml_over_meshd_hot', float('nan')):5.2f} /"
                      f" {row.get('ggml_over_meshd_cold', float('nan')):5.2f}"
                      + (f"   meshd-avx2 {row['meshd_avx2_hot_ms']:8.3f} / {row['meshd_avx2_cold_ms']:8.3f}"
                         if "meshd_avx2_hot_ms" in row else "")
                      + (f"   meshd-rows {row['meshd_rows_hot_ms']:8.3f} / {row['meshd_rows_cold_ms']:8.3f}"
                         if rows_too else ""), flush=True)
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split() if f in ("avx2", "avx512f", "avx512_vnni", "avx512vnni", "fma", "f16c")})
    summary = {}
    for key in ("ggml_over_meshd_hot", "ggml_over_meshd_cold"):
        vals = [r[key] for r in results if key in r]
        if vals:
            summary[key + "_median"] = statistics.median(vals)
            summary[key + "_min"] = min(vals)
    print("times in ms (hot / cold); ggml/meshd above 1: meshd faster")
    print(json.dumps({"bench": "kernel", "shapes": args.shapes, "threads": THREADS,
                      "clock": "thread" if args.single else "wall", "cpu_flags": flags, "isa": blocks.isa(),
                      "ggml": ggml is not None, "torch": torch.__version__, "summary": summary, "results": results}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
