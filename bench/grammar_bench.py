"""Constrained decoding (issue 38): a schema-shaped answer against a free one of the same length, with and
without jump-forward drafts, and the cost of the grammar's mask per sampled position against a step's time.

Three daemons (0:10, 10:20, 20:30), SmolLM2 Q4_1 on the native lane, greedy, set up as bench/spec_bench.py
sets them up (`loopback`; `direct<ms>`: three homes behind NAT on network test hosts, <ms> one way per internet
link, needs root, `ip` and `nft`). For each schema and prompt, four lanes on the same mesh, alternating, one
after another (their order reversed every other run):
  schema+jf     `meshctl generate --json-schema FILE`: what the grammar forces goes as drafts (jump-forward),
                prompt lookup drafts the rest where it pays
  free+spec     the same prompt, no schema, --ignore-eos --max-tokens N (N: the schema answer's tokens),
                prompt lookup drafts where it pays
  free plain    the same with --no-speculate
  schema plain  the schema with --no-speculate: no drafts at all, the forced ones included
The schemas are not meshd's: the shapes of OpenAI's structured-outputs guide (a calendar event, a math tutor's
steps, a UI component with its recursion cut to two levels, content moderation) and a subset of JSON Schema
Store's package.json, their strings bounded (maxLength) so that answers end. Every schema answer is checked
with `jsonschema`. Then, in this process, llguidance's mask (`meshd.shard.grammar.Constraint.mask`, what the
sampling hop runs on each sampled position) is timed on logits of SmolLM2's vocabulary over the positions of
the answers the mesh gave, against the median decode step of the loopback lanes (1 / decode tok/s). In a
daemon, beside the model's weights, the same mask measured about twice as long (docs/structured-bench.md).
Usage: python bench/grammar_bench.py [--runs 2] [--setups loopback,direct25] [--schemas event,math,...]
Prints the CPU's flags, a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from spec_bench import open_setup, warm_up  # bench/spec_bench.py, beside this script

from meshd.shard import blocks
from meshd.cli.localmesh import ctl
from meshd.testing.netns import TestbedUnavailable

S = {"type": "string"}


def text(most: int) -> dict:
    return {"type": "string", "maxLength": most}


def closed(properties: dict, required: list[str] | None = None) -> dict:
    """An object of `properties` (all required unless said), no others: OpenAI's strict mode."""
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


# OpenAI, "Structured Outputs" guide (platform.openai.com/docs/guides/structured-outputs): its examples' schemas
# as written there (strict mode: every property required, no others), with maxLength / maxItems added so that a
# 135M model's answers end
EVENT = closed({"name": text(40), "date": text(20),
                "participants": {"type": "array", "items": text(20), "maxItems": 4}})
MATH = closed({"steps": {"type": "array", "maxItems": 3,
                         "items": closed({"explanation": text(60), "output": text(30)})},
               "final_answer": text(20)})
# the guide's UI component is recursive (children: components); a 135M model nests it until max_tokens, so
# here it is two levels deep: the children's children are empty
ENUM_TYPE = {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]}
ATTRIBUTES = {"type": "array", "maxItems": 2, "items": closed({"name": text(15), "value": text(20)})}
LEAF = closed({"type": ENUM_TYPE, "label": text(30), "children": {"type": "array", "maxItems": 0},
               "attributes": ATTRIBUTES})
UI = closed({"type": ENUM_TYPE, "label": text(30), "children": {"type": "array", "items": LEAF, "maxItems": 3},
             "attributes": ATTRIBUTES})
MODERATION = closed({"is_violating": {"type": "boolean"},
                     "category": {"anyOf": [{"type": "string", "enum": ["violence", "sexual", "self_harm"]},
                                            {"type": "null"}]},
                     "explanation_if_violating": {"anyOf": [text(60), {"type": "null"}]}})
# JSON Schema Store, package.json (json.schemastore.org/package.json): a subset of its properties, as written
# there (name's pattern and length; scripts a map of strings), descriptions bounded
PACKAGE = closed({
    "name": {"type": "string", "maxLength": 40, "minLength": 1,
             "pattern": "^(?:(?:@(?:[a-z0-9-*~][a-z0-9-*._~]*)?/[a-z0-9-._~])|[a-z0-9-~])[a-z0-9-._~]*$"},
    "version": text(12), "description": text(60), "keywords": {"type": "array", "items": text(15), "maxItems": 3},
    "license": text(12), "scripts": {"type": "object", "additionalProperties": text(30), "maxProperties": 2}},
    ["name", "version", "description", "keywords", "license", "scripts"])
SCHEMAS = {
    "event": (EVENT, ["Extract the event information as JSON: Alice and Bob are going to a science fair on Friday.",
                      "Extract the event information as JSON: the team lunch with Carol, Dan and Eve is on 12 May."]),
    "math": (MATH, ["How can I solve 8x + 7 = -23? Answer in JSON, step by step.",
                    "How can I solve 3x - 5 = 10? Answer in JSON, step by step."]),
    "ui": (UI, ["Make a user profile form, as a JSON UI component.",
                "Make a login form with a submit button, as a JSON UI component."]),
    "moderation": (MODERATION, ["Check this message against the content policy and answer in JSON: "
                                "'I will hurt you if you come here again.'",
                                "Check this message against the content policy and answer in JSON: "
                                "'Lovely weather for a picnic today!'"]),
    "package": (PACKAGE, ["Write the package.json of a small JavaScript library that formats dates.",
                          "Write the package.json of a command line tool that resizes images."]),
}
LANES = ["schema+jf", "free+spec", "free plain", "schema plain"]


def cpu_flags() -> dict:
    """Whether /proc/cpuinfo lists avx2 and avx512f, and the instruction set meshd's kernel runs on."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "kernel_isa": blocks.isa()}


def generate(entry, prompt: str, lane: str, schema_file: Path, tokens: int, most: int) -> tuple[str, dict]:
    """One generation of `lane`: the text (without meshctl's closing newline) and the stats."""
    schema = lane.startswith("schema")
    args = ["generate", "--chat", "--stats",
            *(["--json-schema", str(schema_file), "--max-tokens", str(most)] if schema
              else ["--ignore-eos", "--max-tokens", str(tokens)]),
            *(["--no-speculate"] if lane.endswith("plain") else []), prompt]
    out = ctl(entry.socket, args, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{lane}: {out.stderr[-2000:]}")
    return out.stdout.removesuffix("\n"), json.loads(out.stderr.strip().splitlines()[-1])


def valid(answer: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(answer), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_pair(entry, prompt: str, schema: dict, schema_file: Path, args, record: dict) -> None:
    """`args.runs` rounds of the four lanes for one prompt, appended to `record` (lane -> runs)."""
    tokens = None  # the schema answer's length, which the free lanes generate
    for r in range(args.runs):
        for lane in (LANES if r % 2 == 0 else LANES[::-1]):
            if tokens is None and not lane.startswith("schema"):
                raise AssertionError("a schema lane runs first")
            answer, stats = generate(entry, prompt, lane, schema_file, tokens or 0, args.max_tokens)
            if lane.startswith("schema"):
                tokens = tokens or stats["tokens"]
                record["answers"].append({"prompt": prompt, "lane": lane, "text": answer, "tokens": stats["tokens"],
                                          "finish": stats.get("finish"), "valid": valid(answer, schema)})
            record[lane].append(stats)


def paired(record: dict, lane: str, other: str) -> float:
    """The median over rounds of `lane`'s tok/s over `other`'s in the same round (same prompt, one after another)."""
    return round(statistics.median(a["decode_tok_per_s"] / b["decode_tok_per_s"]
                                   for a, b in zip(record[lane], record[other], strict=True)), 3)


RATIOS = {"constrained_vs_free_plain": ("schema plain", "free plain"),  # the grammar's cost, no drafts either side
          "constrained_vs_free_spec": ("schema+jf", "free+spec"),  # as a client gets them, drafts on
          "jf_vs_schema_plain": ("schema+jf", "schema plain"),  # what jump-forward (and lookup) drafts earn
          "spec_vs_free_plain": ("free+spec", "free plain")}


def summarize(setup: str, name: str, record: dict) -> dict:
    """Medians of a schema's (or all schemas') rounds per lane, and the lanes' ratios: the median of each
    round's ratio (paired), and the ratio of the medians."""
    med = {lane: statistics.median(s["decode_tok_per_s"] for s in record[lane]) for lane in LANES}
    jf = record["schema+jf"]
    texts = {}
    for a in record["answers"]:
        texts.setdefault((a["prompt"], a["lane"]), set()).add(a["text"])
    prompts = {p for p, _ in texts}
    return {"setup": setup, "schema": name, "rounds": len(jf),
            "tokens": statistics.median(s["tokens"] for s in jf),
            **{f"{lane}_tok_s": round(med[lane], 2) for lane in LANES},
            **{key: paired(record, a, b) for key, (a, b) in RATIOS.items()},
            "of_medians": {key: round(med[a] / med[b], 3) for key, (a, b) in RATIOS.items()},
            "jf_drafted": sum(s["drafted"] for s in jf), "jf_accepted": sum(s["accepted"] for s in jf),  # lookup's too
            "free_spec_drafted": sum(s["drafted"] for s in record["free+spec"]),
            "free_spec_accepted": sum(s["accepted"] for s in record["free+spec"]),
            "ttft_s": {lane: round(statistics.median(s["ttft_s"] for s in record[lane]), 3) for lane in LANES},
            "valid": f"{sum(a['valid'] for a in record['answers'])}/{len(record['answers'])}",
            "finish_length": sum(a["finish"] != "stop" for a in record["answers"]),
            "same_text": all(len(texts[(p, 'schema+jf')] | texts[(p, 'schema plain')]) == 1 for p in prompts),
            "runs_tok_s": {lane: [s["decode_tok_per_s"] for s in record[lane]] for lane in LANES}}


def run_setup(setup: str, args, files: dict) -> tuple[list[dict], dict]:
    """Rows per schema and for all of them, and the records (the answers, for the mask's timing)."""
    rows, records = [], {}
    with open_setup(setup, ["--recipe", args.recipe]) as entry:
        warm_up(entry)
        # the first grammar a daemon meets builds llguidance's view of the tokenizer (entry and tail): not timed
        generate(entry, "warm up", "schema+jf", files[args.schemas[0]], 0, 8)
        for name in args.schemas:
            schema, prompts = SCHEMAS[name]
            record = records[name] = {lane: [] for lane in LANES} | {"answers": []}
            for prompt in prompts:
                run_pair(entry, prompt, schema, files[name], args, record)
            rows.append(summarize(setup, name, record))
            print(f"  {json.dumps(rows[-1])}", file=sys.stderr)  # kept should a later setup fail
    every = {lane: [s for rec in records.values() for s in rec[lane]] for lane in LANES}
    rows.append(summarize(setup, "all", every | {"answers": [a for rec in records.values() for a in rec["answers"]]}))
    return rows, records


def time_answer(new_constraint, ids: list[int], logits, bits, greedy) -> dict[str, list[float]]:
    """µs a position of one answer (`ids`, fed one by one to a fresh grammar each pass): Constraint.mask, then
    the entry's forced and take; llguidance's bitmask alone; the tail's greedy sample with the grammar (and
    the take that follows it), and without."""
    import llguidance.numpy as lln

    us = {key: [] for key in ("mask", "forced", "take", "fill", "sample", "free")}
    c = new_constraint()
    for token in ids:
        t0 = time.perf_counter()
        c.mask(logits)
        t1 = time.perf_counter()
        c.forced()
        t2 = time.perf_counter()
        c.take(token)
        us["mask"].append((t1 - t0) * 1e6)
        us["forced"].append((t2 - t1) * 1e6)
        us["take"].append((time.perf_counter() - t2) * 1e6)
    c = new_constraint()
    for token in ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(c.matcher, bits, 0)
        us["fill"].append((time.perf_counter() - t0) * 1e6)
        c.take(token)
    c = new_constraint()
    for token in ids:
        t0 = time.perf_counter()
        greedy.sample(logits, 0, c)
        c.take(token)  # as `feed` does with the next frame's id
        t1 = time.perf_counter()
        greedy.sample(logits, 0)
        us["sample"].append((t1 - t0) * 1e6)
        us["free"].append((time.perf_counter() - t1) * 1e6)
    return us


def time_masks(schemas: list[str], answers: dict, passes: int) -> dict:
    """Per schema, over the positions of the mesh's answers (`answers`: schema -> [(text, ended with stop)]):
    Constraint.mask (the sampling hop's, per sampled position; median, mean, p90), llguidance's bitmask alone,
    the tail's sample with and without the grammar (mean), what the entry runs per token (take, forced), and
    the tokens a trip that forced drafts alone would give, on SmolLM2's tokenizer and logits."""
    import llguidance.numpy as lln
    import torch

    from meshd.api import structured
    from meshd.shard import artifact, grammar, tokenizer
    from meshd.shard.sampler import Sampler, SamplingParams

    torch.set_num_threads(1)  # as a daemon on the native lane runs torch's ops (meshd.shard.blocks.divide_threads)
    hf = tokenizer.load_tokenizer(artifact.open_artifact("smollm2"))
    lltok = grammar.ll_tokenizer(hf)
    logits, bits = torch.randn(49152), lln.allocate_token_bitmask(1, lltok.vocab_size)
    greedy = Sampler(SamplingParams(temperature=0.0))
    per, every, extra = {}, [], []
    for name in schemas:
        g = structured.schema_grammar(SCHEMAS[name][0])
        us = {key: [] for key in ("mask", "forced", "take", "fill", "sample", "free")}
        tokens = trips = 0
        for text, stopped in answers.get(name, []):
            # the text's tokens as the tokenizer splits it (the mesh's own ids are not in meshctl's output;
            # greedy answers are nearly always split so), then the end of sequence where the answer had it
            ids = [*hf.encode(text, add_special_tokens=False), *([hf.eos_token_id] if stopped else [])]
            for _ in range(passes):
                for key, values in time_answer(lambda: grammar.Constraint(g, lltok, 0), ids, logits, bits,
                                               greedy).items():
                    us[key] += values
            tokens, trips = tokens + len(ids), trips + jump_forward_trips(grammar.Constraint(g, lltok, 0), ids)
        if not us["mask"]:
            continue
        every += us["mask"]
        extra += [a - b for a, b in zip(us["sample"], us["free"])]
        per[name] = {"positions": len(us["mask"]), "mask_us": round(statistics.median(us["mask"]), 1),
                     "mask_p90_us": round(statistics.quantiles(us["mask"], n=10)[-1], 1),
                     "mask_mean_us": round(statistics.fmean(us["mask"]), 1),
                     "tail_sample_mean_us": round(statistics.fmean(us["sample"]), 1),
                     "tail_sample_free_mean_us": round(statistics.fmean(us["free"]), 1),
                     **{f"{key}_us": round(statistics.median(us[key]), 1) for key in ("fill", "take", "forced")},
                     "tokens_per_trip_jf": round(tokens / trips, 2)}
    return {"schemas": per, "mask_us": round(statistics.median(every), 1) if every else None,
            "mask_mean_us": round(statistics.fmean(every), 1) if every else None,
            "tail_extra_mean_us": round(statistics.fmean(extra), 1) if extra else None, "positions": len(every)}


def jump_forward_trips(constraint, ids: list[int]) -> int:
    """The trips down the route a greedy answer of `ids` takes with the grammar's forced tokens as its only
    drafts (the entry's rule: each trip sends what is forced after the tokens so far; the first token comes
    with the prompt's trip). Plain decoding takes one a token."""
    constraint.take(ids[0])
    i, trips = 1, 1
    while i < len(ids):
        forced = constraint.forced()
        k = 0
        while k < len(forced) and i + k < len(ids) and forced[k] == ids[i + k]:
            k += 1
        for token in ids[i:i + k + 1]:
            constraint.take(token)
        i, trips = i + k + 1, trips + 1
    return trips


def print_tables(rows: list[dict], masks: dict, step_us: dict, args, cpu: dict) -> None:
    print(f"CPU flags: avx2 {'yes' if cpu['avx2'] else 'no'}, avx512f {'yes' if cpu['avx512f'] else 'no'};"
          f" meshd kernel: {cpu['kernel_isa']}")
    print(f"three daemons 0:10 10:20 20:30, SmolLM2 Q4_1 {args.recipe}, greedy; median decode tok/s of {args.runs}"
          f" runs x 2 prompts per schema and lane; free answers as long as the schema's (--ignore-eos);"
          f" ratios: the median of each round's ratio (same prompt, lanes one after another)")
    head = (f"{'setup':9} {'schema':10} {'tok':>4} {'schema+jf':>9} {'free+spec':>9} {'schema pl':>9} {'free pl':>8}"
            f" {'con/free pl':>11} {'con/free sp':>11} {'jf/plain':>8} {'drafts acc':>10} {'valid':>6} same")
    print(head)
    for r in rows:
        print(f"{r['setup']:9} {r['schema']:10} {r['tokens']:>4g} {r['schema+jf_tok_s']:>9} {r['free+spec_tok_s']:>9}"
              f" {r['schema plain_tok_s']:>9} {r['free plain_tok_s']:>8} {r['constrained_vs_free_plain']:>11}"
              f" {r['constrained_vs_free_spec']:>11} {r['jf_vs_schema_plain']:>8}"
              f" {str(r['jf_accepted']) + '/' + str(r['jf_drafted']):>10} {r['valid']:>6} {r['same_text']}")
    print("con/free pl: schema plain / free plain (the grammar's cost, no drafts); con/free sp: schema+jf / free+spec"
          " (as a client gets them); jf/plain: schema+jf / schema plain; "
          "drafts acc: drafts accepted/sent in schema+jf (forced ones and prompt lookup's)")
    print(f"mask per sampled position (in-process, logits of 49152, the mesh's answers, torch on 1 thread):"
          f" median {masks['mask_us']} µs, mean {masks['mask_mean_us']} µs over {masks['positions']} positions;"
          f" the sampling hop's whole extra work a token (mask, sample, take), mean {masks['tail_extra_mean_us']} µs")
    print(f"{'schema':10} {'positions':>9} {'mask µs':>8} {'mean µs':>8} {'p90 µs':>7} {'fill µs':>8}"
          f" {'sample µs':>9} {'free µs':>8} {'take µs':>8} {'forced µs':>9} {'tok/trip jf':>11}")
    for name, m in masks["schemas"].items():
        print(f"{name:10} {m['positions']:>9} {m['mask_us']:>8} {m['mask_mean_us']:>8} {m['mask_p90_us']:>7}"
              f" {m['fill_us']:>8} {m['tail_sample_mean_us']:>9} {m['tail_sample_free_mean_us']:>8} {m['take_us']:>8}"
              f" {m['forced_us']:>9} {m['tokens_per_trip_jf']:>11}")
    print("mask: Constraint.mask (median, mean, p90); fill: llguidance's bitmask alone, median (the rest of mask:"
          " unpacking it and masking the logits in torch); sample / free: the tail's greedy sample with the grammar"
          " (and take) / without, mean; take, forced: the entry's per token, median; tok/trip jf: the answers'"
          " tokens a trip with forced drafts alone (plain: 1)")
    for lane, us in step_us.items():
        share, extra = 100 * masks["mask_us"] / us, 100 * masks["tail_extra_mean_us"] / us
        print(f"loopback decode step, {lane}: median {us:.0f} µs; the mask's median is {share:.1f}% of it,"
              f" the tail's mean extra work {extra:.1f}%")


def measure(args) -> tuple[list[dict], dict, dict]:
    """Every setup's rows, the schema answers (schema -> [(text, ended with stop)]) and the setups skipped."""
    rows, answers, skipped = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: Path(tmp, f"{name}.json") for name in args.schemas}
        for name, path in files.items():
            path.write_text(json.dumps(SCHEMAS[name][0]))
        for setup in args.setups.split(","):
            try:
                setup_rows, records = run_setup(setup, args, files)
            except TestbedUnavailable as exc:  # not root, or no `ip` / `nft` here: the other setups still run
                skipped[setup] = str(exc)
                print(f"{setup}: the network test bed cannot be built here: {exc}", file=sys.stderr)
                continue
            rows += setup_rows
            for name, rec in records.items():
                answers.setdefault(name, sorted({(a["text"], a["finish"] == "stop") for a in rec["answers"]}))
    return rows, answers, skipped


def goals(rows: list[dict]) -> dict:
    """Issue 38's goals against the rows over all schemas: on loopback a constrained token costs at most 5%
    more (schema plain against free plain); over slow links schema-shaped answers come faster than free text
    (schema+jf against free+spec, each as a client gets it by default)."""
    out = {}
    for r in rows:
        if r["schema"] != "all":
            continue
        if r["setup"] == "loopback":
            cost = round(1 - r["constrained_vs_free_plain"], 3)
            out["loopback"] = {"cost_per_token": cost, "met": cost <= 0.05}
        else:
            ratio = r["constrained_vs_free_spec"]
            out[r["setup"]] = {"schema_vs_free": ratio, "met": ratio > 1}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="rounds of the four lanes per prompt")
    p.add_argument("--setups", default="loopback")
    p.add_argument("--schemas", default=",".join(SCHEMAS), help=f"of {', '.join(SCHEMAS)}")
    p.add_argument("--max-tokens", type=int, default=160, help="the most a schema answer may take")
    p.add_argument("--mask-passes", type=int, default=5, help="times each answer's positions are masked")
    p.add_argument("--recipe", default="native", help="the mesh's lane (native or exact)")
    args = p.parse_args()
    args.schemas = args.schemas.split(",")
    cpu = cpu_flags()
    load = [round(os.getloadavg()[0], 2)]  # another process's work on the cores shows in every number here
    rows, answers, skipped = measure(args)
    load.append(round(os.getloadavg()[0], 2))
    masks = time_masks(args.schemas, answers, args.mask_passes)
    loop = next((r for r in rows if r["setup"] == "loopback" and r["schema"] == "all"), None)
    step_us = {lane: 1e6 / loop[f"{lane}_tok_s"] for lane in ("free plain", "schema plain")} if loop else {}
    print_tables(rows, masks, step_us, args, cpu)
    for setup, reason in skipped.items():
        print(f"{setup}: not run, the network test bed cannot be built here ({reason})")
    print(f"load average (1 min) at the start and the end of the mesh runs: {load[0]}, {load[1]}")
    met = goals(rows)
    print("goals: " + "; ".join(f"{k} {v}" for k, v in met.items()))
    print(json.dumps({"runs": args.runs, "lane": args.recipe, "cpu": cpu, "load_1min": load, "skipped": skipped,
                      "goals": met, "results": rows, "mask": masks,
                      "loopback_step_us": {k: round(v, 1) for k, v in step_us.items()},
                      "mask_share_of_step": {k: round(masks["mask_us"] / v, 4) for k, v in step_us.items()}
                      if masks["mask_us"] else {},
                      "tail_extra_share_of_step": {k: round(masks["tail_extra_mean_us"] / v, 4)
                                                   for k, v in step_us.items()} if masks["mask_us"] else {}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
