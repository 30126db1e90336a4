"""Wire codec benchmark: encode+decode time and bytes per frame, raw vs zstd vs base64-in-JSON.

Usage: python bench/wire_bench.py [--repeat N] [--real]   (--real uses SmolLM2 hidden states)
Prints a readable table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time

import numpy as np
import torch

import meshd.wire as w

SID = bytes(16)


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def json_b64_frame(x: torch.Tensor) -> bytes:
    raw = w.Tensor.from_torch("hidden", x).data
    return json.dumps({"type": "forward", "session": SID.hex(), "epoch": 0, "step": 0, "position": 0,
                       "shape": list(x.shape), "dtype": str(x.dtype), "data": base64.b64encode(raw).decode()}).encode()


def json_b64_decode(data: bytes) -> bytes:
    return base64.b64decode(json.loads(data)["data"])


def activations(shape, real: bool) -> torch.Tensor:
    if real:
        from meshd.shard.hidden import real_hidden_states
        return real_hidden_states(shape[1], shape[2])
    return torch.randn(shape) * 0.5


def run(repeat: int, real: bool) -> list[dict]:
    rows = []
    cases = [("decode 1x1x576", (1, 1, 576)), ("prefill 1x128x576", (1, 128, 576)),
             ("prefill 1x128x4096", (1, 128, 4096))]
    for label, shape in cases:
        source = "smollm2" if real and shape[2] == 576 else "normal noise"
        base = activations(shape, real and shape[2] == 576)
        for dtype in (torch.float32, torch.bfloat16):
            x = base.to(dtype)
            msg = w.Forward(session_id=SID, epoch=0, step=0, phase=w.Phase.PREFILL, position=0,
                            tensors=(w.Tensor.from_torch("hidden", x),))
            for enc in ("raw", "zstd"):
                frame = w.encode(msg, enc)

                def roundtrip():
                    w.Decoder().feed(w.encode(msg, enc))[0].tensors[0].to_torch()

                rows.append({"case": label, "source": source, "dtype": str(dtype).split(".")[1],
                             "format": f"meshd-{enc}", "bytes": len(frame),
                             "enc_dec_us": median_us(roundtrip, repeat)})
            js = json_b64_frame(x)
            rows.append({"case": label, "source": source, "dtype": str(dtype).split(".")[1],
                         "format": "base64-json", "bytes": len(js),
                         "enc_dec_us": median_us(lambda: json_b64_decode(json_b64_frame(x)), repeat)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--real", action="store_true", help="use real SmolLM2 hidden states for hidden=576")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = run(args.repeat, args.real)
    raw = {(r["case"], r["dtype"]): r for r in rows if r["format"] == "meshd-raw"}
    print(f"{'case':20} {'source':13} {'dtype':9} {'format':12} {'bytes':>10} {'vs raw':>7} {'enc+dec us':>11}")
    for r in rows:
        ref = raw[(r["case"], r["dtype"])]
        r["bytes_vs_raw"] = round(r["bytes"] / ref["bytes"], 3)
        r["time_vs_raw"] = round(r["enc_dec_us"] / ref["enc_dec_us"], 2)
        print(f"{r['case']:20} {r['source']:13} {r['dtype']:9} {r['format']:12} {r['bytes']:>10} "
              f"{r['bytes_vs_raw']:>7.3f} {r['enc_dec_us']:>11.1f}")
    print(json.dumps({"bench": "wire", "repeat": args.repeat, "rows": rows}))


if __name__ == "__main__":
    main()
