"""Prefix reuse in a multi-turn chat: time to first token per turn, with kept KV and without, in one run.

A chat's next turn sends the whole conversation again; with reuse each hop starts from the KV it kept
of the turn before, so only the new tokens are prefilled. The goal: from turn 2 on, the first token
at least 10x sooner with reuse than without.
Setup: three daemons on loopback each serving a third of the model (d0, d1, d2), and d3 serving d0's
third again with `--prefix-ttl 0` (keeps nothing, reuses nothing). Two lanes share d1 and d2: `reuse`
enters at d0, `plain` at d3; each turn is sent to both, the lane that goes first alternating turn by
turn, so the box's noise hits both. Each lane keeps its own conversation, as a chat client does:
the system prompt, the user's questions and the model's own greedy answers; the two lanes' texts
must be the same per turn (a difference is printed loudly and makes the exit status 1).
The system prompt is the opening of a real document not written for this bench (Python's own
LICENSE.txt, its history of the software and its licences; `--document` for another), cut to
`--system-tokens` with the model's tokenizer at a line's end. The questions are ordinary ones about it.
Models: `smollm2` (the bundled SmolLM2-135M), `synthetic` (the 1.17 B Q4_0 model of
meshd.testing.synthetic, written once to ~/.cache/meshd/bench/ if absent; its context is 2048
positions, so its system prompt is `--synthetic-system-tokens`), or `both`.
Reported per turn: TTFT (the entry's `ttft_s`) reuse / plain and their ratio, cached_tokens and
prompt_tokens; over turns 2..N the medians and the ratio of the medians.
Usage: python bench/chat_bench.py [--model smollm2|synthetic|both] [--turns 5] [--tokens 32]
       [--system-tokens 3000] [--synthetic-system-tokens 1500] [--out FILE.json]
Prints a table per model, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from common import cpu_flags

from meshd.cli.ctl import new_request_id, stream_answer
from meshd.core.settings import default_cache_dir
from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import load_tokenizer
from meshd.cli.localmesh import Mesh
from meshd.wire import GenerateRequest

DOCUMENT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
LEAD = "Answer the user's questions about the following document.\n\n"
QUESTIONS = ["Who created Python, and where?", "What happened to the Python team in 2000?",
             "Which Python releases are not GPL-compatible?", "What does the PSF license allow me to do?",
             "Summarise the history of Python in two sentences.", "What is the CNRI license agreement about?",
             "Can I sell software that includes Python?", "Thanks. Anything else I should know?"]
TIMEOUT = 900.0  # seconds one answer's events may be apart (a full prefill on the synthetic model takes long)
GOAL = 10.0
ROOM_A_TURN = 40  # positions a turn takes besides its answer: the question and the chat template's markers


def synthetic_model() -> Path:
    """The 1.17 B synthetic GGUF, written once into the cache directory."""
    path = default_cache_dir() / "bench" / "synthetic-1b.q4_0.gguf"
    if not path.exists():
        from meshd.testing.synthetic import write_synthetic

        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once)", file=sys.stderr)
        tmp = path.with_suffix(".partial")
        write_synthetic(tmp)
        tmp.rename(path)
    return path


def system_prompt(tok, document: Path, n_tokens: int) -> tuple[str, int]:
    """The lead line and the document's opening, cut at a line's end to at most `n_tokens` tokens in
    all; returns the text and its token count."""
    ids = tok(LEAD + document.read_text()).input_ids
    text = tok.decode(ids[:n_tokens])
    if len(ids) > n_tokens and "\n" in text:
        text = text[:text.rfind("\n")].rstrip()
    return text, len(tok(text).input_ids)


def thirds(n_layers: int) -> list[tuple[int, int]]:
    cuts = [0, n_layers // 3, 2 * n_layers // 3, n_layers]
    return list(zip(cuts, cuts[1:]))


class FirstText:
    """A sink for an answer's text that notes when its first piece came (the client's view of TTFT)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def write(self, piece: str) -> None:
        if piece and self.at is None:
            self.at = time.perf_counter()

    def flush(self) -> None:
        pass


def ask(entry, messages: list[dict] | None, tokens: int, prompt: str = "") -> dict:
    """One generation through `entry` (greedy): its text, the entry's stats and the client's times."""
    req = GenerateRequest(request_id=new_request_id(), prompt=prompt, max_tokens=tokens,
                          messages=json.dumps(messages) if messages else "")
    sink, t0 = FirstText(), time.perf_counter()
    code, stats, text = stream_answer(entry.socket, req, TIMEOUT, out=sink)
    if code != 0:
        raise RuntimeError(f"generation at {entry.name} failed ({code})\n{entry.tail(20)}")
    return {"text": text, "stats": stats, "client_first_text_s": round(sink.at - t0, 4) if sink.at else None,
            "client_total_s": round(time.perf_counter() - t0, 4)}


def open_lanes(mesh: Mesh, model: str, ranges: list[tuple[int, int]]) -> dict:
    """The entries of the two lanes: {"reuse": d0, "plain": d3}, every daemon serving and seeing the others."""
    d0, _, _ = mesh.start_chain(ranges, extra=["--model", model])
    a, b = ranges[0]
    d3 = mesh.start("d3", ["--model", model, "--layers", f"{a}:{b}", "--bootstrap", d0.addr, "--prefix-ttl", "0"])
    for d in (d0, d3):
        d.wait_for(lambda s: s["state"] == "serving" and s["complete"] and sum(p["serving"] for p in s["peers"]) == 3,
                   timeout=600, what="every daemon serving")
    return {"reuse": d0, "plain": d3}


def run_model(name: str, model: str, system_tokens: int, args) -> dict:
    art = open_artifact(model)
    tok = load_tokenizer(art)
    system, n_system = system_prompt(tok, args.document, system_tokens)
    need = n_system + args.turns * (args.tokens + ROOM_A_TURN)
    if need > art.config.max_positions:  # say so now, not as a daemon's refusal at turn N
        raise SystemExit(f"{name}: {n_system} system tokens and {args.turns} turns of up to {args.tokens} tokens need"
                         f" ~{need} positions, the model has {art.config.max_positions}: lower the system tokens,"
                         " --turns or --tokens")
    ranges = thirds(art.config.n_layers)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    mesh = Mesh(env={"MESHD_RECORD_TTL": "30"})  # records that outlast a loaded box's stalls (as spec_bench)
    rows = []
    try:
        lanes = open_lanes(mesh, model, ranges)
        for lane in lanes.values():  # streams, tables and threads warmed; shares no block with the chat
            ask(lane, None, 4, prompt="warm up")
        talks = {lane: [{"role": "system", "content": system}] for lane in lanes}
        for i, question in enumerate(questions):
            order = ("reuse", "plain") if i % 2 == 0 else ("plain", "reuse")
            got = {}
            for lane in order:
                talks[lane].append({"role": "user", "content": question})
                got[lane] = ask(lanes[lane], talks[lane], args.tokens)
                talks[lane].append({"role": "assistant", "content": got[lane]["text"]})
            row = turn_row(i + 1, order, got)
            rows.append(row)
            print(f"  {name} turn {row['turn']}: {json.dumps({k: v for k, v in row.items() if k != 'texts'})}",
                  file=sys.stderr)
            if not row["same_text"]:
                print(f"!!! MISMATCH {name} turn {row['turn']}: the lanes' answers differ\n"
                      f"  reuse: {got['reuse']['text']!r}\n  plain: {got['plain']['text']!r}", file=sys.stderr)
        caches = {d.name: (d.status() or {}).get("prefix_cache") for d in mesh.daemons}
    finally:
        mesh.close()
    return summarise(name, model, ranges, n_system, rows, caches, args)


def turn_row(turn: int, order: tuple[str, str], got: dict) -> dict:
    reuse, plain = got["reuse"]["stats"], got["plain"]["stats"]
    return {"turn": turn, "first": order[0], "prompt_tokens": reuse["prompt_tokens"],
            "prompt_tokens_plain": plain["prompt_tokens"], "cached_tokens": reuse["cached_tokens"],
            "cached_tokens_plain": plain["cached_tokens"], "ttft_reuse_s": reuse["ttft_s"],
            "ttft_plain_s": plain["ttft_s"], "ratio": round(plain["ttft_s"] / reuse["ttft_s"], 2),
            "client_first_text_reuse_s": got["reuse"]["client_first_text_s"],
            "client_first_text_plain_s": got["plain"]["client_first_text_s"],
            "tokens_reuse": reuse["tokens"], "tokens_plain": plain["tokens"],
            "same_text": got["reuse"]["text"] == got["plain"]["text"],
            "texts": {lane: got[lane]["text"] for lane in ("reuse", "plain")}}


def summarise(name: str, model: str, ranges, n_system: int, rows: list[dict], caches: dict, args) -> dict:
    later = rows[1:]
    reuse = statistics.median(r["ttft_reuse_s"] for r in later)
    plain = statistics.median(r["ttft_plain_s"] for r in later)
    return {"model": name, "model_path": model, "ranges": ranges, "document": str(args.document),
            "system_tokens": n_system, "turns": len(rows), "max_tokens": args.tokens,
            "median_ttft_reuse_s": reuse, "median_ttft_plain_s": plain,
            "ratio_of_medians": round(plain / reuse, 2), "min_ratio": min(r["ratio"] for r in later),
            "goal_met": all(r["ratio"] >= GOAL for r in later), "all_same_text": all(r["same_text"] for r in rows),
            "prefix_cache": caches, "rows": rows}


def print_table(res: dict) -> None:
    (a, b), (c, d), (e, f) = res["ranges"]
    print(f"\n{res['model']}: daemons {a}:{b} {c}:{d} {e}:{f} (+ {a}:{b} again, --prefix-ttl 0); system prompt"
          f" {res['system_tokens']} tokens from {res['document']}; {res['turns']} turns, <= {res['max_tokens']}"
          " tokens an answer, greedy")
    print(f"{'turn':>4} {'first':>5} {'prompt':>6} {'cached':>6} {'TTFT reuse s':>12} {'TTFT plain s':>12}"
          f" {'plain/reuse':>11}  same text")
    for r in res["rows"]:
        print(f"{r['turn']:>4} {r['first']:>5} {r['prompt_tokens']:>6} {r['cached_tokens']:>6}"
              f" {r['ttft_reuse_s']:>12.3f} {r['ttft_plain_s']:>12.3f} {r['ratio']:>11.2f}"
              f"  {'yes' if r['same_text'] else 'NO  <<< MISMATCH'}")
    print(f"median turns 2..{res['turns']}: reuse {res['median_ttft_reuse_s']:.3f} s, plain"
          f" {res['median_ttft_plain_s']:.3f} s: {res['ratio_of_medians']:.2f}x (lowest turn {res['min_ratio']:.2f}x);"
          f" goal >= {GOAL:.0f}x every turn from 2: {'met' if res['goal_met'] else 'NOT met'};"
          f" texts identical: {'yes' if res['all_same_text'] else 'NO'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["smollm2", "synthetic", "both"])
    p.add_argument("--turns", type=int, default=5, help="user turns (at least 2)")
    p.add_argument("--tokens", type=int, default=32, help="max tokens an answer")
    p.add_argument("--system-tokens", type=int, default=3000, help="system prompt tokens for smollm2")
    p.add_argument("--synthetic-system-tokens", type=int, default=1500,
                   help="system prompt tokens for synthetic (its context is 2048 positions: 1500 leaves room for"
                   " 7 turns of 32 tokens)")
    p.add_argument("--document", type=Path, default=DOCUMENT, help="the text the system prompt is cut from")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    if args.turns < 2:
        p.error("--turns must be at least 2 (the medians are over turns 2..N)")
    models = {"smollm2": ("smollm2", args.system_tokens), "synthetic": (None, args.synthetic_system_tokens)}
    names = ["smollm2", "synthetic"] if args.model == "both" else [args.model]
    flags = cpu_flags()
    t0 = time.monotonic()
    results = []
    for name in names:
        model, n = models[name]
        results.append(run_model(name, str(model or synthetic_model()), n, args))
    print(f"prefix reuse, multi-turn chat; CPU flags: {' '.join(flags)}; meshd kernel {blocks.isa()};"
          f" {len(os.sched_getaffinity(0))} cores; {time.monotonic() - t0:.0f} s in all")
    for res in results:
        print_table(res)
    result = {"bench": "chat", "argv": sys.argv[1:], "turns": args.turns, "tokens": args.tokens, "cpu_flags": flags,
              "isa": blocks.isa(), "cores": len(os.sched_getaffinity(0)), "seconds": round(time.monotonic() - t0),
              "goal_ratio": GOAL, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if all(r["all_same_text"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
