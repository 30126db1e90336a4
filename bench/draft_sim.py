"""Offline: how many tokens a trip the entry's drafting rule returns, without a network.

Generates the greedy text of bench/spec_bench.py's prompts once, in one process (SmolLM2 Q4_1, the
whole model, `--chat`, past end-of-text as the bench does), then replays meshd/entry/drafts.py's rule
over it: each step proposes drafts after the accepted text, the tail would accept the prefix that
equals the greedy text, and a step costs a modelled trip plus a row a draft (`--trip-ms`, `--row-ms`;
a 170 ms trip is three 25 ms links each way beside the compute, a row of SmolLM2 about 2.5 ms on a
2-core Xeon). Reports per prompt the tokens a trip, the modelled ratio to plain decoding and the
acceptance, and as a bound what a lookup that knew which of its proposals stand would return (at
most 64 drafts a step). Usage: python bench/draft_sim.py [--tokens 128] [--draft-max 8,16,32]
"""

from __future__ import annotations

import argparse
import random
import sys

from meshd.entry.drafts import Drafts, PromptLookup, StepCosts


def greedy_texts(tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prompt ids, generated ids) for spec_bench's prompts."""
    from meshd.entry.local import LocalPipeline
    from meshd.entry.state import stop_ids
    from meshd.shard import blocks
    from meshd.shard.sampler import SamplingParams
    from meshd.shard.tokenizer import encode_prompt, load_tokenizer
    from spec_bench import WORKLOADS  # beside this script

    pipe = LocalPipeline("smollm2", "", "native")
    blocks.divide_threads(1, pipe.recipe)
    tok = load_tokenizer(pipe.artifact)
    out = {}
    for workload, prompts in WORKLOADS.items():
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(tok, prompt, True)
            gen = pipe.start(ids, tokens, stop_ids(pipe.artifact.config, tok, True))
            out[f"{workload}{i}"] = (ids, list(pipe.generate(ids, tokens, SamplingParams(), generation=gen)))
    return out


def replay(prompt: list[int], new: list[int], most: int, trip: float, row: float, jitter: float = 0.1) -> dict:
    """The greedy rule (with measured costs) over a known greedy text; the first token is the prefill's."""
    rnd = random.Random(1)
    drafts = Drafts(most, None, StepCosts())
    at, seconds, trips, drafted, accepted = 1, 0.0, 0, 0, 0
    while at < len(new):
        proposed = drafts.propose(prompt + new[:at], len(new) - at - 1)
        ok = 0
        while ok < len(proposed) and proposed[ok] == new[at + ok]:
            ok += 1
        took = (trip + row * len(proposed)) * (1 + rnd.uniform(-jitter, jitter))
        drafts.observe(1 + len(proposed), took)
        drafts.after(len(proposed), ok)
        seconds, trips, drafted, accepted = seconds + took, trips + 1, drafted + len(proposed), accepted + ok
        at += ok + 1
    n = len(new) - 1
    return {"tokens_a_trip": n / trips, "ratio": n * trip / seconds, "acceptance": accepted / max(1, drafted)}


def bound(prompt: list[int], new: list[int], most: int = 64) -> float:
    """Tokens a trip if exactly the lookup's proposals that stand were sent."""
    look, at, trips = PromptLookup(), 1, 0
    while at < len(new):
        proposed = look.propose(prompt + new[:at], most)
        ok = 0
        while ok < len(proposed) and at + ok < len(new) and proposed[ok] == new[at + ok]:
            ok += 1
        trips, at = trips + 1, at + ok + 1
    return (len(new) - 1) / trips


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--draft-max", default="8,16,32")
    p.add_argument("--trip-ms", type=float, default=170.0)
    p.add_argument("--row-ms", type=float, default=2.5)
    args = p.parse_args()
    texts = greedy_texts(args.tokens)
    print(f"trip {args.trip_ms} ms, row {args.row_ms} ms, {args.tokens} tokens")
    for name, (prompt, new) in texts.items():
        for most in (int(m) for m in args.draft_max.split(",")):
            r = replay(prompt, new, most, args.trip_ms / 1e3, args.row_ms / 1e3)
            print(f"{name:7} draft-max {most:3}: {r['tokens_a_trip']:.2f} tokens a trip, x{r['ratio']:.2f},"
                  f" acceptance {r['acceptance']:.2f}")
        print(f"{name:7} bound (the proposals that stand, up to 64): {bound(prompt, new):.2f} tokens a trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
