"""Speculation (prompt-lookup drafts verified in one pass down the route) against plain decoding.

Three daemons (0:10, 10:20, 20:30), SmolLM2 Q4_1 on the native lane, greedy, --tokens new tokens
past end-of-text, with and without drafts side by side (alternating, same prompts) in one run:
  loopback          the three daemons on 127.0.0.1
  direct<ms>        three homes behind NAT on network test hosts, <ms> one way per internet link,
                    hole punching on (hops go direct once punched); needs root, `ip` and `nft`
  relay<ms>         the same with hole punching off: every hop goes through a relay
Two workloads: `quote` (the answer quotes or edits a passage given in the prompt: drafts hit) and
`chat` (free chat: prompt lookup rarely hits). `--draft MODEL` gives the entry a draft model instead of
prompt lookup (`--draft smollm2`: the bundled model as its own draft, an upper bound on what a draft
model can earn; labelled so in the output), `--recipe` the mesh's lane. Reports per setup and workload the median decode tok/s with
and without speculation, their ratio, the acceptance (accepted / drafted) and whether the texts
were equal. Usage: python bench/spec_bench.py [--tokens 128] [--runs 2] [--setups loopback,direct25] [--draft smollm2]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

from meshd.shard import blocks
from meshd.cli.localmesh import Mesh, ctl

RANGES = [(0, 10), (10, 20), (20, 30)]
PASSAGE = ("Meshd runs a large language model split across ordinary machines. Each machine runs one daemon that "
           "serves a contiguous range of the model's transformer layers. Daemons find each other in a distributed "
           "hash table, where each advertises which layers it serves. Any daemon that serves the first layers can be "
           "the entry point for a generation: it tokenizes the prompt, runs its layers, and streams activations down a "
           "chain of daemons that together cover the rest, the last of which samples the next token. Activations "
           "travel over encrypted streams, or through a relay when a node cannot be dialled, in a compact binary "
           "framing.")
MISSPELT = PASSAGE.replace("machines", "machnies").replace("daemon", "deamon").replace("travel", "travle")
# quote: the answer writes the passage out again, edited (SmolLM2-135M paraphrases a plain "repeat this" after
# a few sentences; these two it follows furthest: 4.4 and 3.0 tokens a trip by prompt lookup, bench/draft_sim.py)
WORKLOADS = {
    "quote": [f"Fix the spelling mistakes in this text and write it out in full.\n\n{MISSPELT}",
              f"Copy this text exactly, without changes:\n\n{PASSAGE}"],
    "chat": ["Tell me about the history of Rome.", "What should I cook for dinner tonight?"],
}


def generate(entry, prompt: str, tokens: int, speculate: bool) -> tuple[str, dict]:
    out = ctl(entry.socket, ["generate", "--chat", "--max-tokens", str(tokens), "--ignore-eos", "--stats",
                             *([] if speculate else ["--no-speculate"]), prompt], timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout, json.loads(out.stderr.strip().splitlines()[-1])


@contextlib.contextmanager
def open_setup(name: str, extra: list[str]):
    """The entry daemon of a three-daemon mesh set up as `name` says (`extra`: every daemon's flags)."""
    mesh = Mesh(env={"MESHD_RECORD_TTL": "30"})  # records that outlast a loaded box's stalls
    try:
        if name == "loopback":
            yield mesh.start_chain(RANGES, extra=extra)[0]
            return
        kind, delay = re.fullmatch(r"(direct|relay)(\d+(?:\.\d+)?)", name).groups()
        from meshd.testing.natmesh import covered_through_relays, start_nat_mesh
        from meshd.testing.netns import open_testbed

        with open_testbed(public=1, homes=3, delay_ms=float(delay)) as bed:
            _, homes = start_nat_mesh(bed, mesh, RANGES, 1, ["--hole-punch", "1" if kind == "direct" else "0", *extra])
            for h in homes:
                h.wait_for(covered_through_relays(1, len(RANGES)), timeout=300, what="coverage through relays")
            if kind == "direct":
                for h in homes:
                    h.wait_for(lambda s: not s["relay"]["relayed_peers"], timeout=120, what="direct connections")
            yield homes[0]
    finally:
        mesh.close()


def warm_up(entry, tries: int = 12) -> None:
    """One short generation, retried while the entry's view of the mesh is still incomplete."""
    for i in range(tries):
        try:
            generate(entry, "warm up", 4, True)
            return
        except RuntimeError as exc:
            if "no_route" not in str(exc) or i == tries - 1:
                raise
            time.sleep(5)


def run_setup(name: str, args) -> list[dict]:
    rows = []
    extra = ["--recipe", args.recipe, *(["--draft", args.draft] if args.draft else [])]
    with open_setup(name, extra) as entry:
        warm_up(entry)
        for workload, prompts in WORKLOADS.items():
            rates = {True: [], False: []}
            drafted = accepted = 0
            same = True
            for _ in range(args.runs):
                for prompt in prompts:
                    texts = {}
                    for speculate in (True, False):
                        texts[speculate], stats = generate(entry, prompt, args.tokens, speculate)
                        rates[speculate].append(stats["decode_tok_per_s"])
                        if speculate:
                            drafted, accepted = drafted + stats["drafted"], accepted + stats["accepted"]
                    same = same and texts[True] == texts[False]
            spec, plain = statistics.median(rates[True]), statistics.median(rates[False])
            rows.append({"setup": name, "workload": workload, "drafts": args.draft or "prompt lookup",
                         "lane": args.recipe, "spec_tok_s": round(spec, 2),
                         "plain_tok_s": round(plain, 2), "ratio": round(spec / plain, 2),
                         "acceptance": round(accepted / drafted, 2) if drafted else None,
                         "drafted": drafted, "accepted": accepted, "same_text": same,
                         "spec_runs": rates[True], "plain_runs": rates[False]})
            print(f"  {json.dumps(rows[-1])}", file=sys.stderr)  # kept should a later setup fail
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2, help="repeats of each prompt per mode")
    p.add_argument("--setups", default="loopback")
    p.add_argument("--draft", default="", help="a draft model at the entry (e.g. smollm2) instead of prompt lookup")
    p.add_argument("--recipe", default="native", help="the mesh's lane (native or exact)")
    p.add_argument("--out", help="also write the JSON here, and beside it a PNG (with matplotlib)")
    args = p.parse_args()
    rows = [r for name in args.setups.split(",") for r in run_setup(name, args)]
    drafts = (f"draft model {args.draft}" + (" (the model itself: an upper bound)" if args.draft == "smollm2" else "")
              if args.draft else "prompt lookup")
    print(f"three daemons 0:10 10:20 20:30, SmolLM2 Q4_1 {args.recipe}, greedy, {args.tokens} tokens, median of"
          f" {args.runs} x {len(WORKLOADS['quote'])} prompts per mode; drafts: {drafts}; CPU: {blocks.isa()}")
    print(f"{'setup':10} {'workload':8} {'spec tok/s':>10} {'plain tok/s':>11} {'ratio':>6} {'accept':>7}  same text")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"{r['setup']:10} {r['workload']:8} {r['spec_tok_s']:>10} {r['plain_tok_s']:>11} {r['ratio']:>6}"
              f" {acc:>7}  {r['same_text']}")
    result = {"tokens": args.tokens, "runs": args.runs, "cpu": blocks.isa(), "drafts": args.draft or "prompt lookup",
              "lane": args.recipe, "results": rows}
    print(json.dumps(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        from plots import plot_speculation  # bench/plots.py, beside this script

        plot_speculation(result, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
