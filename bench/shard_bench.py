"""Shard runtime speed against transformers, in one run on one machine.

Measures, for SmolLM2-135M (all 30 layers, one process, same threads):
  - decode tok/s: transformers `generate` (float32) vs meshd exact (float32) vs meshd compact (bfloat16)
  - prefill tok/s for a 512-token prompt
  - load seconds: a third of the layers and the whole model, vs transformers from_pretrained(gguf_file=...)
  - drift of the compact recipe: how many of 32 greedy tokens match the exact lane, per prompt
Usage: python bench/shard_bench.py [--tokens 64] [--repeat 3]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import COMPACT, EXACT
from meshd.shard.reference import load_reference
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Explain why the sky is blue in simple terms."]


def meshd_greedy(shard: Shard, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """Tokens, time to first token, decode seconds for n-1 further tokens."""
    key = object()
    shard.open_session(key, len(ids) + n)
    t0 = time.perf_counter()
    logits = shard.forward(key, torch.tensor([ids]), 0)
    out = [int(logits.argmax())]
    t1 = time.perf_counter()
    pos = len(ids)
    for _ in range(n - 1):
        logits = shard.decode_step(key, torch.tensor([[out[-1]]]), pos)
        out.append(int(logits.argmax()))
        pos += 1
    t2 = time.perf_counter()
    shard.release(key)
    return out, t1 - t0, t2 - t1


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], float]:
    model.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def hf_prefill(model, ids: list[int]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([ids]))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    art = open_artifact("smollm2")
    tok = load_tokenizer(art)
    res: dict = {"threads": torch.get_num_threads(), "tokens": args.tokens}

    t0 = time.perf_counter()
    ref = load_reference(art)
    res["load_s"] = {"transformers_whole": time.perf_counter() - t0}
    t0 = time.perf_counter()
    third = Shard(art, 10, 20, progress=False)
    res["load_s"]["meshd_third"] = time.perf_counter() - t0
    del third
    t0 = time.perf_counter()
    exact = Shard(art, 0, 30, EXACT, progress=False)
    res["load_s"]["meshd_whole"] = time.perf_counter() - t0
    compact = Shard(art, 0, 30, COMPACT, progress=False)

    n = args.tokens
    rates = {"transformers": [], "meshd_exact": [], "meshd_compact": []}
    matches, same_as_ref = [], []
    for _ in range(args.repeat):
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            ref_tokens, s = hf_greedy(ref, ids, n)
            rates["transformers"].append(n / s)
            ex, ttft, dec = meshd_greedy(exact, ids, n)
            rates["meshd_exact"].append(n / (ttft + dec))
            same_as_ref.append(ex == ref_tokens)
            cp, ttft, dec = meshd_greedy(compact, ids, n)
            rates["meshd_compact"].append(n / (ttft + dec))
            matches.append(sum(a == b for a, b in zip(ex[:32], cp[:32])))
    res["decode_tok_s"] = {k: statistics.median(v) for k, v in rates.items()}
    res["ratio_vs_transformers"] = {k: v / res["decode_tok_s"]["transformers"] for k, v in res["decode_tok_s"].items()}
    res["exact_equals_transformers"] = all(same_as_ref)
    res["compact_drift_matching_of_32"] = matches[:len(PROMPTS)]

    long_ids = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    pre = {"transformers": [], "meshd_exact": [], "meshd_compact": []}
    for _ in range(args.repeat):
        pre["transformers"].append(512 / hf_prefill(ref, long_ids))
        for name, shard in (("meshd_exact", exact), ("meshd_compact", compact)):
            _, ttft, _ = meshd_greedy(shard, long_ids, 1)
            pre[name].append(512 / ttft)
    res["prefill512_tok_s"] = {k: statistics.median(v) for k, v in pre.items()}

    print(f"threads={res['threads']}  new tokens={n}  repeat={args.repeat}")
    print(f"{'lane':16} {'decode tok/s':>12} {'x transformers':>15} {'prefill512 tok/s':>17}")
    for k in rates:
        print(f"{k:16} {res['decode_tok_s'][k]:>12.1f} {res['ratio_vs_transformers'][k]:>15.2f} "
              f"{res['prefill512_tok_s'][k]:>17.0f}")
    print("load seconds:", {k: round(v, 2) for k, v in res["load_s"].items()})
    print("exact lane equals transformers greedy:", res["exact_equals_transformers"])
    print("compact drift (tokens of 32 matching exact):", res["compact_drift_matching_of_32"])
    print(json.dumps({"bench": "shard", **res}))


if __name__ == "__main__":
    main()
