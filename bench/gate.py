"""The release gate: run the performance contract (bench/contract.toml) and say promote, optimise or stop.

Reads the contract (versioned; thresholds are written there, never here), records the machine the
result belongs to (CPU model and flags, cores, load, torch, llama-cpp-python, meshd's kernel ISA,
commit), then runs each measure in its own subprocess:
  - bench/native_bench.py: decode and prefill, one process and one daemon via meshctl, against
    llama.cpp; teacher-forced drift of native from exact next to llama.cpp's; exact vs transformers
  - bench/batch_bench.py, twice: N sessions on one daemon holding 0:30, and on three daemons
    0:10,10:20,20:30 sharing the box (aggregate tok/s, TTFT, p50/p95 time between tokens)
  - its own llama.cpp worker: N sequences decoded together in one batch (llama-cpp-python's
    low-level API, greedy argmax per sequence, n_seq_max = N), the bar for N sessions
  - its own RSS worker: resident memory a native shard of layers 10:20 adds, against the file's bytes
Prints the measures (value, llama.cpp or reference, ratio, threshold, pass/fail), a breakdown that
keeps apart what quantization gains (native vs exact) from what the runtime, the daemon and the
mesh cost (one process, one daemon, three daemons: a column each), and a verdict: `promote` (all
pass), `optimise` (names the bottleneck: the measure furthest below its threshold) or `stop` (a
run failed or a correctness measure failed). Exit code 0 promote, 1 optimise, 2 stop; `--smoke`
(4 tokens, 1 prompt, 2 sessions) checks the plumbing only: 0 unless something failed to run.
Usage: python bench/gate.py [--quick | --smoke] [--contract bench/contract.toml] [--out PATH]
Prints a table, then one JSON object on the last line (also written to bench/results/gate-<date>.json,
and to --out PATH when given), and with matplotlib (the bench extra) two PNGs beside the JSON: this
run's sessions sweeps (gate-<date>.png) and every gate run's scores so far (gate-history.png).
Run it on an idle box: the result says when it was not (`box_busy`).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SPEED, FIT, CORRECTNESS, FAILURES = "speed", "fit", "correctness", "failures"
BUSY = 0.1  # share of the box's CPU busy with other work, at start or end, past which the result is suspect


def log(msg: str) -> None:
    print(f"[gate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_constant(script: str, name: str):
    """A literal assigned at the top of a bench script (its PROMPTS), read without importing it."""
    for node in ast.parse((BENCH / script).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{script} has no {name}")


def model_file(package: str) -> Path:
    """The .gguf in the model package's folder, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the model package {package} is not installed")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf in {Path(spec.origin).parent}")
    return found[0]


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- machine facts ----

def cpu_busy(seconds: float = 1.0) -> float:
    """Share of the box's CPU time that was not idle over `seconds` (from /proc/stat). Measured when
    the gate runs nothing, it is other people's work: llama.cpp's threads wait for each other by
    spinning, so on a box where something else runs its decode can be tens of times slower."""
    def sample():
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(f), f[3] + f[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
        return round(1 - (i1 - i0) / max(1, t1 - t0), 3)
    except OSError:
        return float("nan")


def machine_facts() -> dict:
    facts: dict = {"python": platform.python_version(), "cores": os.cpu_count(),
                   "cores_usable": len(os.sched_getaffinity(0)), "loadavg_at_start": list(os.getloadavg()),
                   "cpu_busy_at_start": cpu_busy()}
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
        flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
        facts["cpu"] = model
        facts["flags"] = {f: f in flags for f in ("avx2", "avx512f", "fma", "f16c")}
    except OSError:
        facts["cpu"], facts["flags"] = platform.processor(), {}
    try:
        total = next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
        facts["mem_total_mb"] = int(total.split()[1]) // 1024
    except (OSError, StopIteration):
        pass
    for key, mod in (("torch", "torch"), ("llama_cpp", "llama_cpp")):
        try:
            facts[key] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a fact we could not get is recorded as such
            facts[key] = f"unavailable: {e}"
    try:
        from meshd.shard import blocks

        if os.environ.get("MESHD_KERNEL_ISA"):  # the daemons and workers below honour it too
            blocks.limit_isa(os.environ["MESHD_KERNEL_ISA"])
        facts["meshd_kernel"] = blocks.isa()
    except Exception as e:  # noqa: BLE001
        facts["meshd_kernel"] = f"unavailable: {e}"
    try:
        facts["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                         timeout=10).stdout.strip()
        facts["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                             capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


# ---- workers (run as `gate.py --worker NAME --job FILE`, each prints one JSON object) ----

def worker_llamacpp_batched(job: dict) -> dict:
    """S sequences, each its own prompt, prefilled in one batch and then decoded together, one token
    each per llama_decode; greedy argmax of each sequence's logits. Per S: aggregate tok/s over the
    whole run (as batch_bench counts it: S x tokens / wall), decode-only tok/s, TTFT, step p50/p95."""
    import numpy as np
    import llama_cpp as L

    n, threads, prompts = job["tokens"], job["threads"], job["prompts"]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers, mp.load_mode = 0, 1  # as llama_cpp.Llama sets them (native_bench's llama.cpp lane)
    model = L.llama_model_load_from_file(job["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['model']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    per_seq = -(-(max(len(p) for p in prompts) + n + 8) // 256) * 256
    out: dict = {"n_ctx_per_sequence": per_seq, "levels": {}}
    for S in job["sessions"]:
        seqs = [prompts[i % len(prompts)] for i in range(S)]
        cp = L.llama_context_default_params()
        cp.n_ctx = S * per_seq
        cp.n_batch = cp.n_ubatch = max(512, sum(len(p) for p in seqs))
        cp.n_seq_max = S
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 0  # llama_cpp.Llama's default (flash_attn=False), as native_bench runs it
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {S} sequences")
        batch = L.llama_batch_init(cp.n_batch, 0, 1)

        def submit(items):  # (token, position, sequence, logits wanted)
            batch.n_tokens = len(items)
            for i, (t, p, s, w) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, w
                batch.seq_id[i][0] = s
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        def argmax(i: int) -> int:
            return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

        def generate(count: int) -> dict:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            t0 = time.perf_counter()
            items, last = [], []
            for s, ids in enumerate(seqs):
                items += [(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)]
                last.append(len(items) - 1)
            submit(items)
            toks = [[argmax(i)] for i in last]
            ttft = time.perf_counter() - t0
            steps = []
            for k in range(count - 1):
                t1 = time.perf_counter()
                submit([(toks[s][-1], len(seqs[s]) + k, s, True) for s in range(S)])
                for s in range(S):
                    toks[s].append(argmax(s))
                steps.append(time.perf_counter() - t1)
            return {"wall": time.perf_counter() - t0, "ttft": ttft, "steps": steps, "tokens": toks}

        generate(8)  # warm up, as batch_bench does before it measures
        r = generate(n)
        steps = sorted(r["steps"]) or [float("nan")]
        out["levels"][str(S)] = {
            "sessions": S, "aggregate_tok_s": S * n / r["wall"], "wall_s": r["wall"],
            "decode_tok_s": S * (n - 1) / sum(r["steps"]) if r["steps"] else None, "ttft_s": r["ttft"],
            "p50_ms": 1000 * statistics.median(steps), "p95_ms": 1000 * steps[int(0.95 * (len(steps) - 1))],
            "first_tokens": r["tokens"][0][:8]}
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)
    return out


def worker_rss(job: dict) -> dict:
    """Resident memory a native shard of `layers` adds, against the GGUF bytes of those layers (a
    one-layer shard is loaded first, so torch's and the kernel's one-time allocations are not counted)."""
    import gc

    import torch

    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    torch.set_num_threads(job["threads"])
    a, b = job["layers"]
    art = open_artifact(job["model"])
    recipe = get_recipe("native")
    warm = Shard(art, a - 1, a, recipe, progress=False)  # noqa: F841 - kept alive on purpose
    gc.collect()
    before = rss_bytes()
    shard = Shard(art, a, b, recipe, progress=False)
    gc.collect()
    after = rss_bytes()
    names = art.tensor_names()
    file_bytes = sum(art.stored_bytes(x) for x in names for i in range(a, b) if x.startswith(f"blk.{i}."))
    return {"layers": [a, b], "rss_added_bytes": after - before, "file_bytes": file_bytes,
            "weight_bytes": shard.weight_bytes, "rss_per_layer_mb": (after - before) / (b - a) / 1e6,
            "file_per_layer_mb": file_bytes / (b - a) / 1e6}


WORKERS = {"llamacpp_batched": worker_llamacpp_batched, "rss": worker_rss}


# ---- running the benches ----

class Runner:
    """Runs each bench as a subprocess, keeps its command line, and counts what failed."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.commands: list[str] = []
        self.failures: list[str] = []
        self.jobs: dict[str, dict] = {}  # what each of the gate's own workers was given (its --job file)
        self.env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}

    def run(self, what: str, argv: list[str]) -> dict | None:
        """The JSON object on the command's last stdout line, or None (a failure, recorded)."""
        self.commands.append(shlex.join(argv))
        log(f"{what}: {shlex.join(argv)}")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=self.env, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.failures.append(f"{what}: timed out after {self.timeout:.0f} s")
            return None
        log(f"{what}: exit {r.returncode} after {time.perf_counter() - t0:.1f} s")
        for line in r.stderr.splitlines():  # a bench that lost a system says so on stderr and goes on
            if line.startswith("[") and "] failed" in line:
                self.failures.append(f"{what}: {line.strip()}")
        if r.returncode != 0:
            self.failures.append(f"{what}: exit {r.returncode}: {r.stderr.strip()[-1500:]}")
            return None
        lines = r.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            self.failures.append(f"{what}: no JSON object on the last stdout line")
            return None

    def worker(self, name: str, job: dict) -> dict | None:
        self.jobs[name] = job
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"gate-{name}-", delete=False) as f:
            json.dump(job, f)
        try:
            return self.run(name, [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--job", f.name])
        finally:
            os.unlink(f.name)


def plan(contract: dict, mode: str) -> dict:
    """Sizes and measures for this mode: the workload, with [quick] or [smoke] over it."""
    w = contract["workload"]
    cfg = {k: w[k] for k in ("prompts", "tokens", "sessions")}
    names = list(contract["measures"])
    if mode in ("quick", "smoke"):
        cfg.update({k: contract[mode][k] for k in ("prompts", "tokens", "sessions") if k in contract[mode]})
        names = [m for m in contract[mode].get("measures", names) if m in contract["measures"]]
    cfg["measures"] = names
    # the concurrency levels run (a per-session measure is taken at those of its own among them)
    cfg["levels"] = sorted(set(cfg["sessions"]))
    return cfg


def sessions_of(spec: dict, cfg: dict, mode: str) -> list[int]:
    if "sessions" not in spec:
        return []
    if mode == "smoke":
        return list(cfg["sessions"])
    return [s for s in spec["sessions"] if s in cfg["sessions"]]


def collect(contract: dict, cfg: dict, mode: str, runner: Runner) -> dict:
    w, m = contract["workload"], contract["model"]
    gguf = model_file(m["package"])
    n_prompts = len(bench_constant("native_bench.py", "PROMPTS"))
    if cfg["prompts"] > n_prompts:
        raise SystemExit(f"the contract asks for {cfg['prompts']} prompts; native_bench has {n_prompts}")
    wanted = set(cfg["measures"])
    py = sys.executable
    raw: dict = {"model_file": str(gguf)}

    # native_bench: one process, one daemon, llama.cpp one process, drift, exact vs transformers
    skip = []
    if "exact_equals_transformers" not in wanted:
        skip.append("transformers")
    if "split_equals_one_process" not in wanted:
        skip.append("native_split")
    if not wanted & {"decode_daemon", "daemon_equals_one_process"}:
        skip.append("daemon")
    argv = [py, "bench/native_bench.py", "--tokens", str(cfg["tokens"]), "--prompts", str(cfg["prompts"])]
    raw["native"] = runner.run("native_bench", argv + (["--skip", ",".join(skip)] if skip else []))
    if raw["native"]:
        expected = {"exact", "native", "native_split", "llamacpp", "transformers", "daemon"} - set(skip)
        missing = expected - set(raw["native"].get("systems", {}))
        if missing:
            runner.failures.append(f"native_bench: systems missing from its result: {sorted(missing)}")

    if "rss_per_layer" in wanted:
        raw["rss"] = runner.worker("rss", {"model": m["name"], "layers": [10, 20], "threads": w["threads"]})

    levels = cfg["levels"]
    prompts = bench_constant("batch_bench.py", "PROMPTS")  # session i gets prompt i mod 8, as in batch_bench
    if wanted & {"batch_one_daemon", "three_daemons", "ttft", "token_latency_p50", "token_latency_p95"}:
        from meshd.shard.artifact import open_artifact
        from meshd.shard.tokenizer import load_tokenizer

        tok = load_tokenizer(open_artifact(m["name"]))
        ids = [tok(p).input_ids for p in prompts]
        raw["llamacpp_batched"] = runner.worker("llamacpp_batched", {
            "model": str(gguf), "prompts": ids, "tokens": cfg["tokens"], "sessions": levels, "threads": w["threads"]})
        sess = ",".join(map(str, levels))
        for key, split, threads, used in (
                ("one_daemon", w["one_daemon_split"], w["threads"],
                 {"batch_one_daemon", "ttft", "token_latency_p50", "token_latency_p95"}),
                ("three_daemons", w["three_daemon_split"], w["threads_per_daemon_of_three"], {"three_daemons"})):
            if not wanted & used:
                continue
            res = runner.run(f"batch_bench {key}", [py, "bench/batch_bench.py", "--tokens", str(cfg["tokens"]),
                                                    "--sessions", sess, "--modes", "forward", "--splits", split,
                                                    "--threads", str(threads)])
            runs = [v for v in (res or {}).values() if isinstance(v, dict) and "levels" in v]
            raw[key] = runs[0] if runs else None
            if res is not None and not runs:
                runner.failures.append(f"batch_bench {key}: no run in its result")
    return raw


# ---- judging ----

def level(run: dict | None, s: int) -> dict | None:
    if not run:
        return None
    levels = run["levels"].values() if isinstance(run["levels"], dict) else run["levels"]
    return next((lv for lv in levels if lv["sessions"] == s), None)


def get(d: dict | None, *path):
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def judge(contract: dict, cfg: dict, mode: str, raw: dict, runner: Runner) -> list[dict]:
    nb = raw.get("native") or {}
    sys_ = nb.get("systems", {})
    lb, one, three = raw.get("llamacpp_batched"), raw.get("one_daemon"), raw.get("three_daemons")
    rows: list[dict] = []

    def row(measure, label, value, ref, judged, unit=""):
        spec = contract["measures"][measure]
        rows.append({"measure": measure, "row": label, "kind": spec["kind"], "value": value, "reference": ref,
                     "ratio": judged, "unit": unit, "min": spec.get("min"), "max": spec.get("max")})

    llama1 = get(sys_, "llamacpp")
    for measure in cfg["measures"]:
        spec = contract["measures"][measure]
        at = sessions_of(spec, cfg, mode)
        if measure == "decode_one_process":
            v, ref = get(sys_, "native", "decode_tok_s"), get(llama1, "decode_tok_s")
            row(measure, measure, v, ref, ratio(v, ref), "tok/s")
        elif measure == "decode_daemon":
            v, ref = get(sys_, "daemon", "decode_tok_s"), get(llama1, "decode_tok_s")
            row(measure, measure, v, ref, ratio(v, ref), "tok/s")
        elif measure == "prefill_one_process":
            v, ref = get(sys_, "native", "prefill_tok_s"), get(llama1, "prefill_tok_s")
            row(measure, measure, v, ref, ratio(v, ref), "tok/s")
        elif measure in ("batch_one_daemon", "three_daemons"):
            run = one if measure == "batch_one_daemon" else three
            for s in at:
                v, ref = get(level(run, s), "aggregate_tok_s"), get(level(lb, s), "aggregate_tok_s")
                row(measure, f"{measure}@{s}", v, ref, ratio(v, ref), "tok/s")
        elif measure in ("ttft", "token_latency_p50", "token_latency_p95"):
            key, scale, unit = {"ttft": ("ttft_s", 1000, "ms"), "token_latency_p50": ("p50_ms", 1, "ms"),
                                "token_latency_p95": ("p95_ms", 1, "ms")}[measure]
            for s in at:
                v, ref = get(level(one, s), key), get(level(lb, s), key)
                v, ref = (v * scale if v is not None else None), (ref * scale if ref is not None else None)
                row(measure, f"{measure}@{s}", v, ref, ratio(ref, v), unit)  # latency: llama.cpp / meshd
        elif measure == "rss_per_layer":
            r = raw.get("rss")
            v, ref = get(r, "rss_per_layer_mb"), get(r, "file_per_layer_mb")
            row(measure, measure, v, ref, ratio(v, ref), "MB")
        elif measure == "output_drift":
            v, ref = get(nb, "teacher_forced_top1", "native~exact"), get(nb, "teacher_forced_top1", "llamacpp~exact")
            row(measure, measure, v, ref, v - ref if v is not None and ref is not None else None)
        elif measure == "exact_equals_transformers":
            a = get(nb, "greedy_agreement", "transformers~exact")
            v = ratio(get(a, "positions_equal"), get(a, "of"))
            row(measure, measure, v, None, v)
        elif measure == "split_equals_one_process":
            v = nb.get("split_equals_one_process")
            row(measure, measure, None if v is None else float(v), None, None if v is None else float(v))
        elif measure == "daemon_equals_one_process":
            v = nb.get("daemon_text_equals_one_process")  # "k/n"
            v = ratio(*map(int, v.split("/"))) if v else None
            row(measure, measure, v, None, v)
    # a measure the run could not take cannot pass: it counts as a failure
    for r in rows:
        if r["ratio"] is None and r["kind"] != FAILURES:
            runner.failures.append(f"{r['row']}: not measured")
    if "failures" in cfg["measures"]:
        row("failures", "failures", len(runner.failures), None, len(runner.failures))
    for r in rows:
        x = r["ratio"]
        r["pass"] = x is not None and (r["min"] is None or x >= r["min"]) and (r["max"] is None or x <= r["max"])
        # how far from its bar, as a factor (< 1 below it): the bottleneck is the smallest
        if x is None or r["kind"] in (CORRECTNESS, FAILURES):
            r["score"] = None
        elif r["min"] is not None:
            r["score"] = x / r["min"] if r["min"] > 0 else None
        else:
            r["score"] = r["max"] / x if x > 0 else None
    return rows


def verdict(rows: list[dict]) -> tuple[str, str | None]:
    failed = [r for r in rows if not r["pass"]]
    if any(r["kind"] in (CORRECTNESS, FAILURES) for r in failed):
        return "stop", None
    if not failed:
        return "promote", None
    worst = min(failed, key=lambda r: r["score"] if r["score"] is not None else float("-inf"))
    return "optimise", worst["row"]


def breakdown(raw: dict, cfg: dict) -> list[dict]:
    """Per workload row: llama.cpp, exact and native in one process, one daemon, three daemons; and the
    factors between them: quantization (native / exact), runtime (native one process / llama.cpp),
    daemon (one daemon / one process), mesh (three daemons / one daemon)."""
    sys_ = get(raw, "native", "systems") or {}
    lb, one, three = raw.get("llamacpp_batched"), raw.get("one_daemon"), raw.get("three_daemons")
    out = []
    three1 = get(level(three, 1), "p50_ms")
    out.append({"row": "decode tok/s, 1 sequence", "llamacpp": get(sys_, "llamacpp", "decode_tok_s"),
                "exact": get(sys_, "exact", "decode_tok_s"), "native": get(sys_, "native", "decode_tok_s"),
                "one_daemon": get(sys_, "daemon", "decode_tok_s"),
                "three_daemons": 1000 / three1 if three1 else None})  # 1 / p50 gap: steady decode, as the others
    out.append({"row": "prefill tok/s, 512 tokens", "llamacpp": get(sys_, "llamacpp", "prefill_tok_s"),
                "exact": get(sys_, "exact", "prefill_tok_s"), "native": get(sys_, "native", "prefill_tok_s"),
                "one_daemon": get(sys_, "daemon", "prefill_tok_s"), "three_daemons": None})
    for s in cfg["levels"]:
        out.append({"row": f"aggregate tok/s, {s} sessions", "llamacpp": get(level(lb, s), "aggregate_tok_s"),
                    "exact": None, "native": None, "one_daemon": get(level(one, s), "aggregate_tok_s"),
                    "three_daemons": get(level(three, s), "aggregate_tok_s")})
    for r in out:
        r["quantization"] = ratio(r["native"], r["exact"])
        # with no one-process column (N sessions), the runtime factor is one daemon against llama.cpp
        r["runtime"] = ratio(r["native"], r["llamacpp"]) if r["native"] else ratio(r["one_daemon"], r["llamacpp"])
        r["daemon"] = ratio(r["one_daemon"], r["native"])
        r["mesh"] = ratio(r["three_daemons"], r["one_daemon"])
    return out


def fmt(x, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "nan"
    return format(x, spec)


def report(result: dict) -> None:
    c, facts = result["config"], result["machine"]
    print(f"meshd release gate, contract v{result['contract_version']}, {result['mode']}: {c['prompts']} prompt(s) x"
          f" {c['tokens']} greedy tokens, sessions {','.join(map(str, c['levels']))}")
    print(f"machine: {facts.get('cpu')}, {facts.get('cores')} cores, flags"
          f" {' '.join(f for f, on in facts.get('flags', {}).items() if on)}, load {fmt(facts['loadavg_at_start'][0])}"
          f" (CPU busy before/after {fmt(facts.get('cpu_busy_at_start'))}/{fmt(facts.get('cpu_busy_at_end'))}),"
          f" torch {facts.get('torch')}, llama_cpp {facts.get('llama_cpp')}, meshd kernel {facts.get('meshd_kernel')}")
    busy = max(facts.get("cpu_busy_at_start", 0), facts.get("cpu_busy_at_end", 0))
    if busy > BUSY:
        print(f"WARNING: the box was busy with other work ({busy:.0%} of its CPU when the gate ran nothing);"
              " llama.cpp's spinning threads slow down many times over when they share cores: ratios are suspect")
    print()
    print(f"{'measure':28} {'value':>10} {'llama.cpp|ref':>13} {'unit':>5} {'ratio':>8} {'threshold':>10}"
          f" {'result':>6}")
    for r in result["measures"]:
        bar = f">= {r['min']:g}" if r["min"] is not None else f"<= {r['max']:g}"
        spec = "d" if r["kind"] == FAILURES else ".3f"
        val_spec = "d" if r["kind"] == FAILURES else (".3f" if r["kind"] == CORRECTNESS else ".1f")
        print(f"{r['row']:28} {fmt(r['value'], val_spec):>10} {fmt(r['reference'], val_spec):>13} {r['unit']:>5}"
              f" {fmt(r['ratio'], spec):>8} {bar:>10} {'pass' if r['pass'] else 'FAIL':>6}")
    print("ratio: meshd / llama.cpp for rates, llama.cpp / meshd for latencies, RSS / file bytes per layer,"
          " native's agreement minus llama.cpp's for drift")
    print()
    print(f"{'where the speed goes':28} {'llama.cpp':>9} {'exact 1p':>9} {'native 1p':>9} {'1 daemon':>9}"
          f" {'3 daemons':>9} | {'quant':>6} {'runtime':>7} {'daemon':>6} {'mesh':>6}")
    for r in result["breakdown"]:
        print(f"{r['row']:28} {fmt(r['llamacpp'], '.1f'):>9} {fmt(r['exact'], '.1f'):>9} {fmt(r['native'], '.1f'):>9}"
              f" {fmt(r['one_daemon'], '.1f'):>9} {fmt(r['three_daemons'], '.1f'):>9} | {fmt(r['quantization']):>6}"
              f" {fmt(r['runtime']):>7} {fmt(r['daemon']):>6} {fmt(r['mesh']):>6}")
    print("quant: native / exact (what quantization gains); runtime: native one process / llama.cpp (one daemon"
          " where no one-process row); daemon: one daemon / one process; mesh: three daemons / one daemon")
    print()
    for f in result["failures"]:
        print(f"failure: {f}")
    for cmd in result["commands"]:
        print(f"ran: {cmd}")
    v = result["verdict"]
    tail = f": bottleneck {result['bottleneck']}" if result["bottleneck"] else ""
    smoke = "  (smoke run: checks the plumbing, binds nothing)" if result["mode"] == "smoke" else ""
    print(f"verdict: {v}{tail}{smoke}")


def write_plots(result: dict, out: Path) -> None:
    """PNGs next to the JSON (matplotlib, the bench extra; skipped with a message without it): this
    run's sessions sweeps, and the history of every gate run in the results folder."""
    from plots import gate_history, plot_sessions  # bench/plots.py, beside this script

    plot_sessions(result, out.with_suffix(".png"), f"gate {result['mode']} run {result['started'][:16]}")
    gate_history(out.parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the contract's [quick] subset and sizes (~10 min, 2 cores)")
    size.add_argument("--smoke", action="store_true", help="4 tokens, 1 prompt, 2 sessions: the plumbing only")
    ap.add_argument("--contract", default=str(BENCH / "contract.toml"))
    ap.add_argument("--out", help="a second place for the JSON result (it always goes to"
                    " bench/results/gate-<date>.json)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.load(open(args.job)))))
        return

    with open(args.contract, "rb") as f:
        contract = tomllib.load(f)
    if contract.get("version") != 1:
        raise SystemExit(f"{args.contract}: contract version {contract.get('version')!r}; this gate reads version 1")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = plan(contract, mode)
    started = datetime.datetime.now(datetime.timezone.utc)
    facts = machine_facts()
    runner = Runner(contract["workload"].get("timeout_s", 1800))
    t0 = time.perf_counter()
    raw = collect(contract, cfg, mode, runner)
    rows = judge(contract, cfg, mode, raw, runner)
    v, bottleneck = verdict(rows)
    facts["loadavg_at_end"], facts["cpu_busy_at_end"] = list(os.getloadavg()), cpu_busy()
    busy = max(facts["cpu_busy_at_start"], facts["cpu_busy_at_end"])
    result = {"bench": "gate", "contract_version": contract["version"], "contract": str(Path(args.contract).resolve()),
              "mode": mode, "started": started.isoformat(timespec="seconds"),
              "wall_s": round(time.perf_counter() - t0, 1),
              "machine": facts, "config": cfg, "commands": runner.commands,
              "worker_jobs": runner.jobs, "measures": rows,
              "breakdown": breakdown(raw, cfg), "failures": runner.failures, "verdict": v, "bottleneck": bottleneck,
              "box_busy": busy > BUSY, "raw": raw}
    report(result)
    outs = [BENCH / "results" / f"gate-{started.strftime('%Y-%m-%dT%H-%M-%S')}.json"] + (
        [Path(args.out)] if args.out else [])
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        log(f"result written to {out}")
    try:
        write_plots(result, outs[0])
    except Exception as e:  # noqa: BLE001 - a plot that fails costs the picture, not the verdict
        log(f"plots failed: {type(e).__name__}: {e}")
    print(json.dumps(result))
    if mode == "smoke":
        sys.exit(2 if runner.failures else 0)
    sys.exit({"promote": 0, "optimise": 1, "stop": 2}[v])


if __name__ == "__main__":
    main()
