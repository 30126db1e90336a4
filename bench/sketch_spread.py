"""The spread checked routes' sketches must allow, against what changes a greedy token.

SmolLM2 (bundled Q4_1 file) split 0:10, 10:20, 20:30 in one process, greedy, --steps decode steps after
a prompt, in the `native` and the `exact` lane:
  replica spread  a second, separately loaded 10:20 shard runs the same session (stacked in a pass
                  with another session): the relative difference of their sketches (meshd/hop/sketch.py)
  flip threshold  at every step, 10:20's output is perturbed by noise of relative size eps (eps times
                  the row's mean magnitude, seeded) and the tail recomputes the step: the smallest eps
                  on a grid that changes the greedy token at some step, and the relative sketch
                  difference that perturbation makes
The tolerance (sketch.TOLERANCE) must sit above the replica spread and well below the flip threshold.
Usage: python bench/sketch_spread.py [--steps 24] [--lanes native,exact]. One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from meshd.hop import sketch
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import encode_prompt, load_tokenizer

PROMPT = "The capital of France is"
GRID = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), float(b.abs().max()), 1e-12)


def lane_figures(artifact, lane: str, steps: int) -> dict:
    recipe = get_recipe(lane, artifact)
    head, mid, tail, replica = (Shard(artifact, a, b, recipe) for a, b in ((0, 10), (10, 20), (20, 30), (10, 20)))
    for s in (head, mid, tail, replica):
        s.open_session("s", 256)
    replica.open_session("other", 256)
    ids = encode_prompt(load_tokenizer(artifact), PROMPT, False)
    x, position, spread, flip, small = torch.tensor([ids]), 0, 0.0, None, 0.0
    gen = torch.Generator().manual_seed(7)
    for step in range(steps + 1):
        h = head.forward("s", x, position)
        out = mid.forward("s", h, position)
        twin = replica.forward_batch([("s", h, position), ("other", h, position)])[0]
        spread = max(spread, rel(sketch.sketch(out, step + 1), sketch.sketch(twin, step + 1)))
        token = int(tail.forward("s", out, position).argmax())
        noise = torch.randn(out.shape, generator=gen)
        for eps in GRID:
            if flip is not None and eps >= flip["eps"]:
                break
            bent = out + eps * out.abs().mean() * noise
            if int(tail.forward("s", bent, position).argmax()) != token:
                flip = {"eps": eps, "step": step, "sketch_rel": rel(sketch.sketch(out, 99), sketch.sketch(bent, 99))}
                break
            if eps == 1e-4:  # the tolerance's own size of perturbation: what it makes of a sketch
                small = max(small, rel(sketch.sketch(out, 99), sketch.sketch(bent, 99)))
        tail.forward("s", out, position)  # the honest step back in the tail's KV
        position += x.shape[1]
        x = torch.tensor([[token]])
    return {"replica_sketch_spread": spread, "flip": flip, "sketch_rel_at_eps_1e-4": small}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--lanes", default="native,exact")
    args = ap.parse_args()
    artifact = open_artifact("smollm2")
    out = {"cpu": "avx2", "steps": args.steps, "tolerance": sketch.TOLERANCE}
    for lane in args.lanes.split(","):
        out[lane] = lane_figures(artifact, lane, args.steps)
        print(lane, out[lane], flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
