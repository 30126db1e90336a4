"""Throughput under many users: three daemons on loopback (SmolLM2, native lane), N concurrent sessions.

For 1, 4, 8 and 16 concurrent generations of --tokens new tokens each (greedy, past end-of-text):
aggregate decode tok/s over the run, p50/p95 time between streamed tokens, the daemons' CPU per token,
the hops' mean batch size and how busy each compute thread was; side by side for hop-to-hop
forwarding (default) and the entry relaying every hop's output, for several layer splits and
several `--microbatches`. Also the mesh's own per-token cost: a solo decode step seen at the entry minus
the hops' compute per step, per transfer. On a box with a core or more per daemon, `--pin` keeps
each daemon on its own cores; `--cpu-share` caps each daemon at a share of the box's cores (its own
cpu cgroup), standing in for one small machine per daemon.
Usage: python bench/batch_bench.py [--tokens 64] [--sessions 1,4,8,16] [--modes forward,relay]
       [--splits "0:10,10:20,20:30;0:13,13:26,26:30"] [--microbatches 1,2] [--pin "0-3;4-7;8-11"]
       [--cpu-share 0.6] [--out RESULT.json]
Prints a table, then one JSON object on the last line; with --out, also that JSON in a file and, with
matplotlib (the bench extra), a PNG beside it: aggregate tok/s and p95 against sessions, a line a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path

from meshd.cli.ctl import Connection, fetch_status, new_request_id
from meshd.cli.localmesh import Mesh
from meshd.testing.cgroup import open_cpu_cgroup
from meshd.wire import GenerateRequest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The best way to learn", "In 1969, the first", "import numpy as np\n", "Dear Sir or Madam,"]


EVEN = [(0, 10), (10, 20), (20, 30)]


def parse_split(text: str) -> list[tuple[int, int]]:
    """"0:13,13:26,26:30" -> [(0, 13), (13, 26), (26, 30)]."""
    return [tuple(int(v) for v in part.split(":")) for part in text.split(",")]


def parse_cpus(text: str) -> set[int]:
    """"0-3" or "0,2,5" -> {0, 1, 2, 3} or {0, 2, 5}."""
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Keep every thread of a running process on `cpus` (one machine's cores, on a box with many)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def one(socket, prompt: str, tokens: int, out: list) -> None:
    """Run one generation; append (start, [arrival time of each text event], stats)."""
    conn = Connection(socket)
    t0 = time.perf_counter()
    arrivals, stats = [], {}
    try:
        conn.send(GenerateRequest(request_id=new_request_id(), prompt=prompt, max_tokens=tokens, ignore_eos=True))
        while True:
            event = conn.receive(600)
            if event.kind == "text":  # the tokens its text holds so far (a token may add no text)
                arrivals.append((time.perf_counter(), event.stats.get("tokens", len(arrivals) + 1)))
            elif event.kind == "done":
                stats = dict(event.stats)
                break
            elif event.kind == "error":
                raise RuntimeError(event.text)
    finally:
        conn.close()
    out.append((t0, arrivals, stats))


def per_token_gaps(streams: list[list[tuple[float, int]]]) -> list[float]:
    """The time between tokens, sorted, from each stream's (arrival, tokens so far) text events: a text
    that brings k tokens (those before it added none) counts k gaps of a k-th of its wait each, as
    llama.cpp's column times each token's step."""
    gaps = []
    for arr in streams:
        for (t0, n0), (t1, n1) in zip(arr, arr[1:]):
            k = max(1, n1 - n0)
            gaps += [(t1 - t0) / k] * k
    return sorted(gaps)


def run_level(entry, n: int, tokens: int) -> dict:
    results: list = []
    threads = [threading.Thread(target=one, args=(entry.socket, PROMPTS[i % len(PROMPTS)], tokens, results))
               for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(results) != n:
        raise RuntimeError(f"{n - len(results)} generations failed")
    gaps = per_token_gaps([arr for _, arr, _ in results])
    produced = sum(s["tokens"] for _, _, s in results)
    return {"sessions": n, "aggregate_tok_s": produced / wall, "wall_s": wall,
            "p50_ms": 1000 * statistics.median(gaps), "p95_ms": 1000 * gaps[int(0.95 * (len(gaps) - 1))],
            "ttft_s": statistics.median(s["ttft_s"] for _, _, s in results)}


def cpu_s(daemons) -> float:
    """CPU seconds the daemons' processes have used (every thread: compute and event loop)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in daemons:
        with open(f"/proc/{d.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def snapshot(daemons) -> list[dict]:
    """Each daemon's status: `compute_s` (its passes as the event loop saw them, the hand-offs to the
    compute thread included), `compute_busy_s` (its compute thread's time), `steps` (passes), `batches`."""
    return [fetch_status(d.socket) for d in daemons]


def bench_mode(levels: list[int], tokens: int, threads: int, forwarding: bool, gather_ms: float = 0.0,
               split: list[tuple[int, int]] = EVEN, cpus: list[set[int]] | None = None, microbatches: int = 2,
               cpu_share: float = 0.0, speculate: str = "auto") -> dict:
    with contextlib.ExitStack() as stack:
        # each daemon in its own cpu cgroup: a machine of `cpu_share` cores each, on one box
        groups = [stack.enter_context(open_cpu_cgroup(cpu_share)) for _ in split] if cpu_share else []
        mesh = Mesh(env={"MESHD_RECORD_TTL": "30", "MESHD_FORWARDING": "1" if forwarding else "0",
                         "MESHD_GATHER_MS": str(gather_ms)})
        try:
            daemons = mesh.start_chain(split, extra=["--threads", str(threads), "--microbatches", str(microbatches),
                                                       "--speculate", speculate])
            for d, where in zip(daemons, cpus or []):
                pin(d.proc.pid, where)
            for d, group in zip(daemons, groups):
                group.add(d.proc.pid)
            return measure(daemons, levels, tokens, forwarding)
        finally:
            mesh.close()


def measure(daemons, levels: list[int], tokens: int, forwarding: bool) -> dict:
    """Solo step and the mesh's own cost per transfer, then each level of concurrent sessions."""
    entry = daemons[0]
    run_level(entry, 1, 8)  # warm up
    out = {"levels": []}
    # the mesh's own cost per token: a solo run's step time minus what the hops computed
    before = snapshot(daemons)
    solo = run_level(entry, 1, tokens)
    after = snapshot(daemons)
    passes = [max(1, a["steps"] - b["steps"]) for a, b in zip(after, before)]
    per_pass = [(a["compute_s"] - b["compute_s"]) / n for a, b, n in zip(after, before, passes)]
    per_pass_thread = [(a["compute_busy_s"] - b["compute_busy_s"]) / n for a, b, n in zip(after, before, passes)]
    step = solo["p50_ms"] / 1000
    out["solo_step_ms"] = 1000 * step
    out["hop_compute_ms"] = [1000 * p for p in per_pass]
    out["hop_compute_thread_ms"] = [1000 * p for p in per_pass_thread]
    transfers = len(daemons) if forwarding else 2 * (len(daemons) - 1)  # relaying: out and back per hop
    out["transfers_per_token"] = transfers
    out["overhead_per_transfer_ms"] = 1000 * (step - sum(per_pass)) / transfers
    # the same, counting the hand-offs between a daemon's event loop and its compute thread as mesh
    out["overhead_per_transfer_thread_ms"] = 1000 * (step - sum(per_pass_thread)) / transfers
    for n in levels:
        before = snapshot(daemons)
        cpu0, own0 = cpu_s(daemons), time.process_time()
        level = run_level(entry, n, tokens)
        level["cpu_ms_per_token"] = 1000 * (cpu_s(daemons) - cpu0) / (n * tokens)
        level["client_cpu_ms_per_token"] = 1000 * (time.process_time() - own0) / (n * tokens)
        after = snapshot(daemons)
        # how much of the run each daemon's compute thread was busy with passes
        level["compute_busy"] = [round((a["compute_s"] - b["compute_s"]) / level["wall_s"], 2)
                                 for a, b in zip(after, before)]
        level["mean_batch"] = [round((a["batches"]["rows"] - b["batches"]["rows"])
                                     / max(1, a["batches"]["passes"] - b["batches"]["passes"]), 2)
                               for a, b in zip(after, before)]
        out["levels"].append(level)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sessions", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=0, help="threads for tensor work per daemon (0, default: the"
                    " daemon's own default, one per core; the kernel's threads take each other's share when preempted)")
    ap.add_argument("--modes", default="forward,relay", help="forward, relay, gather (forward, waiting"
                    " --gather-ms before a pass when other sessions' frames are due)")
    ap.add_argument("--gather-ms", type=float, default=2.0)
    ap.add_argument("--splits", default="0:10,10:20,20:30", help="layer ranges of the three daemons; several"
                    " splits separated by ';' run side by side (the tail also runs the LM head: an even split"
                    " of the layers is not an even split of the work)")
    ap.add_argument("--pin", default="", help="cores of each daemon, e.g. '0-3;4-7;8-11' (a box with a core or"
                    " more per daemon, standing in for one machine each); default: all share every core")
    ap.add_argument("--cpu-share", type=float, default=0.0, help="cores each daemon may use, each in its own cpu"
                    " cgroup (root): e.g. 0.6 stands in for three machines of 0.6 cores on a 2-core box; 0: all"
                    " share the box")
    ap.add_argument("--microbatches", default="2", help="the entry's --microbatches; several values separated by ','"
                    " run side by side (1: every generation in one, as before they existed; 0: one per daemon on"
                    " the route)")
    ap.add_argument("--speculate", default="auto", help="the entry's --speculate (auto, off); 'auto,off' runs both"
                    " side by side")
    ap.add_argument("--out", help="also write the JSON result there, and its PNG plot beside it")
    args = ap.parse_args()
    cpus = [parse_cpus(c) for c in args.pin.split(";")] if args.pin else None
    levels = [int(x) for x in args.sessions.split(",")]
    res = {}
    for split in args.splits.split(";"):
        for mode in args.modes.split(","):
            for microbatches in args.microbatches.split(","):
                for spec in args.speculate.split(","):
                    name = f"{mode} {split} mb {microbatches}" + (f" spec {spec}" if "," in args.speculate else "")
                    res[name] = bench_mode(
                        levels, args.tokens, args.threads, mode != "relay", args.gather_ms if mode == "gather" else 0,
                        parse_split(split), cpus, int(microbatches), args.cpu_share, spec)
    where = f" pinned {args.pin}" if cpus else " shared"
    print(f"3 daemons on loopback, SmolLM2 native, {args.tokens} new tokens a session,"
          f" {f'{args.threads} thread(s)' if args.threads else 'threads one per core'} each, {os.cpu_count()} cores{where}"
          + (f", each daemon capped at {args.cpu_share:g} cores" if args.cpu_share else ""))
    print(f"{'mode, split, microbatches (mb)':36} {'sessions':>8} {'agg tok/s':>10} {'x 1 session':>11} {'p50 ms':>8}"
          f" {'p95 ms':>8} {'p95 x solo':>10} {'TTFT s':>7} {'CPU ms/tok':>10} {'clients':>7}"
          "  mean rows/pass per daemon, compute busy")
    for name, r in res.items():
        base = r["levels"][0]
        for lv in r["levels"]:
            lv["x_one_session"] = lv["aggregate_tok_s"] / base["aggregate_tok_s"]
            lv["p95_x_one_session"] = lv["p95_ms"] / base["p95_ms"]
            print(f"{name:36} {lv['sessions']:>8} {lv['aggregate_tok_s']:>10.1f} {lv['x_one_session']:>11.2f}"
                  f" {lv['p50_ms']:>8.1f} {lv['p95_ms']:>8.1f} {lv['p95_x_one_session']:>10.2f}"
                  f" {lv['ttft_s']:>7.3f} {lv['cpu_ms_per_token']:>10.1f} {lv['client_cpu_ms_per_token']:>7.2f}"
                  f"  {lv['mean_batch']} {lv['compute_busy']}")
        print(f"{name:36} solo step {r['solo_step_ms']:.1f} ms = hops' compute"
              f" {' + '.join(f'{c:.1f}' for c in r['hop_compute_ms'])} ms + mesh"
              f" {r['overhead_per_transfer_ms']:.2f} ms per transfer x {r['transfers_per_token']}"
              f" ({r['overhead_per_transfer_thread_ms']:.2f} ms counting the hand-offs to each compute thread)")
    result = {"bench": "batch", "tokens": args.tokens, "threads": args.threads, "cpu": kernel_isa(), **res}
    print(json.dumps(result))
    if args.out:
        write_result(result, Path(args.out), f"3 daemons, {args.tokens} tokens a session")


def kernel_isa() -> str:
    from meshd.shard import blocks

    try:
        if os.environ.get("MESHD_KERNEL_ISA"):  # what the daemons' settings read too
            blocks.limit_isa(os.environ["MESHD_KERNEL_ISA"])
        return blocks.isa()
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"unavailable: {e}"


def write_result(result: dict, out: Path, title: str) -> None:
    """The JSON in `out` and, where matplotlib is installed, its plot beside it (`out` as .png)."""
    from plots import plot_sessions  # bench/plots.py, beside this script

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot_sessions(result, out.with_suffix(".png"), title)


if __name__ == "__main__":
    main()
