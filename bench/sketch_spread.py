"""The spread checked routes' sketches must allow, against what changes a greedy token.

SmolLM2 (bundled Q4_1 file) split 0:10, 10:20, 20:30, greedy, in the `native` and the `exact` lane, over
PROMPTS (code, prose, a question). Every sketch (meshd/hop/sketch.py) of a row at position p is drawn
with seed p, so two routes' rows of one position are compared as a checking entry compares them, by
the relative difference sketch.close uses (max abs difference / larger max magnitude):
  replica spread  a second, separately loaded 10:20 shard runs the same session (stacked in a pass
                  with another session)
  flip threshold  at every one of --flip-steps steps, 10:20's output is perturbed by noise of relative
                  size eps (eps times the row's mean magnitude, seeded) and the tail recomputes the
                  step: the smallest eps on a grid that changes the greedy token, and the relative
                  sketch difference that perturbation makes; shown for the step that flips first (a
                  near tie between two tokens: noise of any size, a peer's rounding too, may flip it)
                  and for the step at the 10th percentile
  windows         a route's --steps one-position decode steps against a second route (fresh sessions,
                  the prompt as the same one pass) that recomputes the generated tokens as windows of
                  16 or 32 positions, each ONE pass of kind STEPS or SCORE (meshd/shard/batch.py): each
                  row's sketch at every hop boundary (hidden states after layers 10 and 20, the tail's
                  logits: SCORE gives every row's, STEPS the window's last). Kind PASS (a prompt chunk,
                  which checks do not use) is shown as a control: a pass that rounds otherwise shows.
  instruction set the block kernel held to avx2 and to portable against the best this CPU has (in
                  the native lane: the exact lane never calls the kernel); and "avx2 cpu", in both
                  lanes: torch, MKL and oneDNN held to AVX2 as well, as a peer on an AVX2 CPU runs
  threads         torch.set_num_threads 1 against 2 (beside one torch thread the kernel's pool takes
                  every core, beside two it runs on one: meshd/shard/blocks.py _pool_threads)
Each setup of instruction set and threads runs in a process of its own (`--worker`, JSON out): the
kernel's instruction set can be lowered and lifted in one process, but weights are laid out for it as
they load (blocks.tiles_pay), and torch reads its own caps from the environment at import. Every
setup is fed the tokens the best setup chose, so rows of one position always see the same input;
what each setup would have chosen itself is counted ("own tokens differ").
The tolerance (sketch.TOLERANCE) must sit above every honest spread (recommended: a decade or more above
the largest, at least 1e-4) and well below the flip threshold (100x below the 10th percentile step's).
Usage: python bench/sketch_spread.py [--steps 200] [--flip-steps 24] [--lanes native,exact]
(6.5 minutes on 2 cores). A table, then one JSON object on the last line (with this CPU's flags).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from meshd.core.log import setup_logging
from meshd.hop import sketch
from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.batch import PASS, SCORE, STEPS
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import encode_prompt, load_tokenizer

PROMPTS = {
    "code": "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "prose": "The old lighthouse keeper climbed the spiral stairs every evening, and on the night of the storm",
    "question": "Question: Why does ice float on water?\nAnswer:",
}
SPLIT = ((0, 10), (10, 20), (20, 30))
WINDOWS = (16, 32)
CHECK_KINDS = (STEPS, SCORE)  # the kinds a check recomputes a window as; PASS is the control
GRID = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]
AVX2_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# what setups other than the best recompute besides decode steps: SCORE's rows are every position's at
# every boundary, and its longer window is the pass least like a decode step (the rest would double the time)
FOLLOWER_PASSES = ((SCORE, max(WINDOWS)),)
SETUPS = {  # name: (the kernel's instruction set cap, "" for the best; torch threads; environment)
    "best": ("", 1, {}),
    "avx2": ("avx2", 1, {}),
    "portable": ("portable", 1, {}),
    "avx2 cpu": ("avx2", 1, AVX2_CPU),
    "threads 2": ("", 2, {}),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), float(b.abs().max()), 1e-12)


# --- the flip threshold and the replica spread (in this process) ---

def lane_figures(artifact, lane: str, steps: int, prompt: str) -> dict:
    """The replica spread, and each step's smallest flipping eps with the sketch difference it makes
    (None: nothing on the grid flipped the step)."""
    recipe = get_recipe(lane, artifact)
    head, mid, tail, replica = (Shard(artifact, a, b, recipe, progress=False)
                                for a, b in ((0, 10), (10, 20), (20, 30), (10, 20)))
    for s in (head, mid, tail, replica):
        s.open_session("s", 256)
    replica.open_session("other", 256)
    ids = encode_prompt(load_tokenizer(artifact), prompt, False)
    x, position, spread, flips, small = torch.tensor([ids]), 0, 0.0, [], 0.0
    gen = torch.Generator().manual_seed(7)
    for step in range(steps + 1):
        h = head.forward("s", x, position)
        out = mid.forward("s", h, position)
        twin = replica.forward_batch([("s", h, position), ("other", h, position)])[0]
        spread = max(spread, rel(sketch.sketch(out, step + 1), sketch.sketch(twin, step + 1)))
        token = int(tail.forward("s", out, position).argmax())
        noise, honest = torch.randn(out.shape, generator=gen), sketch.sketch(out, 99)
        flips.append(None)
        for eps in GRID:
            bent = out + eps * out.abs().mean() * noise
            moved = rel(honest, sketch.sketch(bent, 99))
            if eps == 1e-4:  # the tolerance's own size of perturbation: what it makes of a sketch
                small = max(small, moved)
            if int(tail.forward("s", bent, position).argmax()) != token:
                flips[-1] = {"eps": eps, "step": step, "sketch_rel": moved}
                break
        tail.forward("s", out, position)  # the honest step back in the tail's KV (a pass truncates it there)
        position += x.shape[1]
        x = torch.tensor([[token]])
    return {"replica_sketch_spread": spread, "flips": flips, "sketch_rel_at_eps_1e-4": small}


def flip_figures(artifact, lane: str, steps: int) -> dict:
    """lane_figures over every prompt: the largest replica spread; the smallest flip (a near tie
    between two tokens), the flip of the step at the 10th percentile (None: past the grid), and how
    many steps noise of 1e-4 flips."""
    each = {name: lane_figures(artifact, lane, steps, text) for name, text in PROMPTS.items()}
    flips = [dict(f, prompt=name) if f else None for name, e in each.items() for f in e["flips"]]
    by_eps = sorted(flips, key=lambda f: (f["eps"], f["sketch_rel"]) if f else (math.inf, math.inf))
    low = by_eps[len(by_eps) // 10]
    return {"replica_sketch_spread": max(e["replica_sketch_spread"] for e in each.values()),
            "flip": by_eps[0],
            "flip_p10": low and {"eps": low["eps"], "sketch_rel": low["sketch_rel"]},
            "steps": len(flips), "steps_flipped_at_1e-4": sum(bool(f) and f["eps"] <= 1e-4 for f in flips),
            "sketch_rel_at_eps_1e-4": max(e["sketch_rel_at_eps_1e-4"] for e in each.values())}


# --- one setup's sketches (a worker process) ---

_sketches: dict[bytes, list[float]] = {}


def row_sketch(row: torch.Tensor, position: int) -> list[float]:
    """sketch.sketch(row, position), computed once for each distinct row and position in this process:
    a window row that equals its decode step's bits gets the very same sketch (drawing a logits row's
    directions took most of a worker's time)."""
    key = hashlib.blake2b(row.contiguous().numpy().tobytes(), key=position.to_bytes(8, "little")).digest()
    if key not in _sketches:
        _sketches[key] = sketch.sketch(row, position).tolist()
    return _sketches[key]


def run_route(shards, key: str, x: torch.Tensor, position: int, kind: str) -> list[torch.Tensor]:
    """Every hop's output for positions [position, position + n) of session `key`."""
    outs = []
    for shard in shards:
        x = shard.forward(key, x, position, kind)
        outs.append(x)
    return outs


def open_route(shards, key: str, ids: list[int], length: int) -> torch.Tensor:
    """Session `key` opened on every hop, the prompt run as one pass: the tail's logits."""
    for shard in shards:
        shard.open_session(key, length)
    return run_route(shards, key, torch.tensor([ids]), 0, PASS)[-1]


def decode_rows(shards, ids: list[int], steps: int, follow: list[int] | None) -> tuple[list, list, dict]:
    """One-position decode steps after the prompt: the tokens fed (greedy, or `follow`'s), the tokens
    this route would have chosen, and each step's row sketch at each boundary."""
    logits = open_route(shards, "route", ids, len(ids) + steps + 1)
    own = [int(logits.argmax())]
    tokens = [follow[0] if follow else own[0]]
    rows = {}
    for i in range(steps):
        position = len(ids) + i
        outs = run_route(shards, "route", torch.tensor([[tokens[i]]]), position, PASS)
        for (_, end), out in zip(SPLIT, outs):
            rows[f"decode|{end}|{position}"] = row_sketch(out.reshape(-1), position)
        own.append(int(outs[-1].argmax()))
        tokens.append(follow[i + 1] if follow else own[-1])
    for shard in shards:
        shard.release("route")
    return tokens, own, rows


def window_rows(shards, ids: list[int], inputs: list[int], kind: str, window: int) -> dict:
    """`inputs` (after the prompt) recomputed `window` positions a pass, as kind `kind`: each row's
    sketch at each boundary (at the tail, the rows it returns logits of)."""
    open_route(shards, "check", ids, len(ids) + len(inputs))
    rows = {}
    for start in range(0, len(inputs), window):
        chunk, position = inputs[start:start + window], len(ids) + start
        outs = run_route(shards, "check", torch.tensor([chunk]), position, kind)
        for (_, end), out in zip(SPLIT, outs):
            if out.dim() == 3:  # hidden states [1, n, hidden]
                picked = [(position + j, out[0, j]) for j in range(len(chunk))]
            elif out.dim() == 2:  # SCORE's logits, every row [n, vocab]
                picked = [(position + j, out[j]) for j in range(len(chunk))]
            else:  # the last row's logits
                picked = [(position + len(chunk) - 1, out)]
            for p, row in picked:
                rows[f"{kind}/{window}|{end}|{p}"] = row_sketch(row, p)
    for shard in shards:
        shard.release("check")
    return rows


def worker(setup: str, lane: str, steps: int, follow: dict | None) -> dict:
    """This setup's decode and window sketches of every prompt (`follow`: the tokens to feed)."""
    isa, threads, _ = SETUPS[setup]
    if isa:
        blocks.limit_isa(isa)  # before any weight loads: their layout follows it
    torch.set_num_threads(threads)
    artifact = open_artifact("smollm2")
    shards = [Shard(artifact, a, b, get_recipe(lane, artifact), progress=False) for a, b in SPLIT]
    tokenizer = load_tokenizer(artifact)
    prompts = {}
    for name, text in PROMPTS.items():
        ids = encode_prompt(tokenizer, text, False)
        tokens, own, rows = decode_rows(shards, ids, steps, follow[name] if follow else None)
        for kind, window in (FOLLOWER_PASSES if follow else [(k, w) for k in (*CHECK_KINDS, PASS) for w in WINDOWS]):
            rows |= window_rows(shards, ids, tokens[:steps], kind, window)
        prompts[name] = {"tokens": tokens, "own": own, "rows": rows}
    return {"kernel": blocks.isa(), "torch": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "prompts": prompts}


def run_worker(setup: str, lane: str, steps: int, follow: dict | None) -> dict:
    env = os.environ | SETUPS[setup][2]
    done = subprocess.run([sys.executable, __file__, "--worker", setup, "--lane", lane, "--steps", str(steps)],
                          input=json.dumps(follow), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {setup} ({lane}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# --- comparisons ---

def spread(pairs) -> dict:
    """Over (boundary end, sketch a, sketch b): rows compared, rows that differ at all, the largest
    relative difference and the boundary (layer end) it was at (None where none differ)."""
    n, differing, worst, at = 0, 0, 0.0, None
    for end, a, b in pairs:
        r = rel(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
        n += 1
        differing += r > 0
        if r > worst:
            worst, at = r, end
    return {"rows": n, "differing": differing, "max_rel": worst, "at": at}


def windows_vs_decode(result: dict, kind: str, window: int) -> dict:
    """Each window row against the decode step's row of its position and boundary."""
    def pairs():
        for p in result["prompts"].values():
            rows = p["rows"]
            for key, s in rows.items():
                source, end, position = key.split("|")
                if source == f"{kind}/{window}":
                    yield end, rows[f"decode|{end}|{position}"], s
    return spread(pairs())


def across(a: dict, b: dict) -> dict:
    """Every row both setups computed (decode steps and windows), one against the other."""
    def pairs():
        for name, p in b["prompts"].items():
            for key, s in p["rows"].items():
                yield key.split("|")[1], a["prompts"][name]["rows"][key], s
    figures = spread(pairs())
    figures["own_tokens_differ"] = sum(x != y for name, p in a["prompts"].items()
                                       for x, y in zip(p["own"], b["prompts"][name]["own"]))
    return figures


def followers(lane: str) -> list[str]:
    """The setups compared with the best in this lane: one that only caps the kernel's instruction set
    where the lane's weights run in the kernel (the exact lane's float32 weights and KV never reach
    it: blocks.norm_weight, blocks.attends; "avx2 cpu" caps it there too), the others in every lane."""
    in_kernel = blocks.KERNEL is not None and get_recipe(lane).weight_dtype == "stored"
    return [setup for setup, (isa, _, env) in SETUPS.items() if setup != "best" and (in_kernel or not isa or env)]


def lane_spreads(lane: str, steps: int) -> tuple[dict, dict]:
    """Every comparison of one lane, and the setups' instruction sets and threads as they ran."""
    results = {"best": run_worker("best", lane, steps, None)}
    follow = {name: p["tokens"] for name, p in results["best"]["prompts"].items()}
    names = followers(lane)
    with ThreadPoolExecutor(2) as pool:  # two processes at a time, on 2 cores: a third of the time off
        results |= zip(names, pool.map(lambda setup: run_worker(setup, lane, steps, follow), names))
    out = {}
    for kind in (*CHECK_KINDS, PASS):
        for window in WINDOWS:
            label = f"decode vs {kind}/{window}" + (" (control)" if kind == PASS else "")
            out[label] = windows_vs_decode(results["best"], kind, window)
    for setup in names:
        out[f"best vs {setup}"] = across(results["best"], results[setup])
    ran = {setup: {k: r[k] for k in ("kernel", "torch", "threads")} for setup, r in results.items()}
    return out, ran


def recommend(honest: float, flip: dict | None) -> dict:
    """A tolerance a decade or more above the largest honest spread (at least 1e-4), and how far below
    the 10th percentile step's flip (`flip`, None past the grid) it sits. No tolerance above the honest
    spread need sit below the smallest flip: that is a near tie between two tokens, which any noise,
    a peer's rounding included, may flip."""
    tol = max(1e-4, 10.0 ** math.ceil(math.log10(10 * honest))) if honest else 1e-4
    low = flip and flip["sketch_rel"]
    return {"tolerance": tol, "largest_honest_spread": honest, "p10_flip_sketch_rel": low,
            "p10_flip_over_tolerance": low / tol if low else None,
            "ok": 10 * honest <= tol and (low is None or low >= 100 * tol)}


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return sorted(set(re.findall(r"avx512[a-z_]*|avx2", f.read())))


def print_table(lane: str, comparisons: dict, flips: dict) -> None:
    pad, flip, low = " " * (len(lane) + 2), flips["flip"], flips["flip_p10"]
    print(f"\n{lane}: {'comparison':<32} {'rows':>6} {'differ':>6} {'max rel':>10}  at  own tokens differ")
    for label, c in comparisons.items():
        print(f"{pad}{label:<32} {c['rows']:>6} {c['differing']:>6} {c['max_rel']:>10.3g} {c['at'] or '-':>3}"
              f"  {c.get('own_tokens_differ', '')}")
    print(f"{pad}replica spread {flips['replica_sketch_spread']:.3g}; noise 1e-4 moves a sketch by"
          f" {flips['sketch_rel_at_eps_1e-4']:.3g} and flips {flips['steps_flipped_at_1e-4']} of {flips['steps']} steps")
    if flip:
        print(f"{pad}smallest flip: eps {flip['eps']} ({flip['prompt']}, step {flip['step']}),"
              f" sketch rel {flip['sketch_rel']:.3g}")
    print(f"{pad}10th percentile step's flip: "
          + (f"eps {low['eps']}, sketch rel {low['sketch_rel']:.3g}" if low else f"past the grid (eps > {GRID[-1]})"))
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200, help="decode steps a prompt (generated tokens: one more)")
    ap.add_argument("--flip-steps", type=int, default=24, help="steps a prompt for the flip threshold")
    ap.add_argument("--lanes", default="native,exact")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--lane", help=argparse.SUPPRESS)
    args = ap.parse_args()
    setup_logging("warning")  # no line a shard loaded: 24 of them would bury the table
    if args.worker:
        print(json.dumps(worker(args.worker, args.lane, args.steps, json.loads(sys.stdin.read()))))
        return 0
    t0 = time.perf_counter()
    artifact = open_artifact("smollm2")
    out = {"cpu": cpu_flags(), "steps": args.steps, "prompts": list(PROMPTS), "windows": list(WINDOWS),
           "tolerance_now": sketch.TOLERANCE}
    honest, low = 0.0, None
    for lane in args.lanes.split(","):
        comparisons, ran = lane_spreads(lane, args.steps)
        flips = flip_figures(artifact, lane, args.flip_steps)
        print_table(lane, comparisons, flips)
        out[lane] = {"setups": ran, "comparisons": comparisons, **flips}
        honest = max([honest, flips["replica_sketch_spread"],
                      *(c["max_rel"] for label, c in comparisons.items() if "control" not in label)])
        if flips["flip_p10"] and (low is None or flips["flip_p10"]["sketch_rel"] < low["sketch_rel"]):
            low = flips["flip_p10"]
    out["recommended"] = recommend(honest, low)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    rec = out["recommended"]
    moved = f"{low['sketch_rel']:.3g}" if low else "more than the grid's"
    print(f"\nrecommended tolerance {rec['tolerance']:g}: largest honest spread {honest:.3g}; the 10th percentile"
          f" step's flip moves a sketch by {moved} ({'ok' if rec['ok'] else 'NOT ok'}); {out['wall_s']} s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
