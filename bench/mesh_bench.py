"""Generation speed: transformers whole model vs one meshd daemon vs three daemons on loopback.

All in one run on one machine, same prompts, greedy, a fixed number of new tokens (past
end-of-text), the daemons in the recipe asked (default native). Reports decode tok/s and time to
first token per setup (medians over prompts and repeats) and the ratios.
Usage: python bench/mesh_bench.py [--tokens 64] [--repeat 2] [--recipe native|exact|compact]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshd.cli.localmesh import Mesh, ctl
from meshd.shard.artifact import open_artifact
from meshd.shard.reference import load_reference
from meshd.shard.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Explain why the sky is blue in simple terms."]


def bench_transformers(n: int, repeat: int) -> dict:
    art = open_artifact("smollm2")
    tok = load_tokenizer(art)
    model = load_reference(art)
    model.generation_config.eos_token_id = None
    decode, ttft = [], []
    for _ in range(repeat):
        for p in PROMPTS:
            x = torch.tensor([tok(p).input_ids])
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
                t1 = time.perf_counter()
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
                t2 = time.perf_counter()
            ttft.append(t1 - t0)
            decode.append((n - 1) / max(1e-9, (t2 - t1) - (t1 - t0)))
    return {"decode_tok_s": statistics.median(decode), "ttft_s": statistics.median(ttft)}


def bench_mesh(ranges: list[tuple[int, int]], n: int, repeat: int, recipe: str) -> dict:
    mesh = Mesh()
    try:
        entry = mesh.start_chain(ranges, extra=["--recipe", recipe])[0]
        decode, ttft = [], []
        ctl(entry.socket, ["generate", "--max-tokens", "4", "warm up"])
        for _ in range(repeat):
            for p in PROMPTS:
                out = ctl(entry.socket, ["generate", "--max-tokens", str(n), "--ignore-eos", "--stats", p])
                if out.returncode != 0:
                    raise RuntimeError(out.stderr)
                stats = json.loads(out.stderr.strip().splitlines()[-1])
                decode.append(stats["decode_tok_per_s"])
                ttft.append(stats["ttft_s"])
        return {"decode_tok_s": statistics.median(decode), "ttft_s": statistics.median(ttft)}
    finally:
        mesh.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--recipe", default="native", choices=["native", "exact", "compact"])
    args = ap.parse_args()
    res = {
        "transformers": bench_transformers(args.tokens, args.repeat),
        "meshd_1_daemon": bench_mesh([(0, 30)], args.tokens, args.repeat, args.recipe),
        "meshd_3_daemons": bench_mesh([(0, 10), (10, 20), (20, 30)], args.tokens, args.repeat, args.recipe),
    }
    base, one = res["transformers"]["decode_tok_s"], res["meshd_1_daemon"]["decode_tok_s"]
    print(f"new tokens={args.tokens} repeat={args.repeat} prompts={len(PROMPTS)} ({args.recipe} recipe, greedy;"
          " transformers float32)")
    print(f"{'setup':18} {'decode tok/s':>12} {'x transformers':>15} {'x one daemon':>13} {'TTFT s':>8}")
    for k, v in res.items():
        v["x_transformers"] = v["decode_tok_s"] / base
        v["x_one_daemon"] = v["decode_tok_s"] / one
        print(f"{k:18} {v['decode_tok_s']:>12.1f} {v['x_transformers']:>15.2f} {v['x_one_daemon']:>13.2f}"
              f" {v['ttft_s']:>8.3f}")
    print(json.dumps({"bench": "mesh", "tokens": args.tokens, "repeat": args.repeat, "recipe": args.recipe, **res}))


if __name__ == "__main__":
    main()
