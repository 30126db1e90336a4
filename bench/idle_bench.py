"""Idle cost: CPU and log lines of serving daemons while nothing generates.

Starts real daemons on loopback (a chain covering the bundled model, or any ranges), waits until
every one serves and sees the others, lets them settle, then samples each daemon's CPU time
(utime + stime from /proc/PID/stat, all threads) over a window of idleness, plus the log lines
each wrote meanwhile. The goal (issue 11) is an idle daemon under 0.5% of one core. Then it kills
the last daemon (SIGKILL) and times how long the first takes to show its layers as a gap (goal:
within 10 s).
Usage: python bench/idle_bench.py [--daemons 3] [--window 30] [--settle 10] [--threads 1]
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from meshd.cli.localmesh import Mesh

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


def log_lines(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except OSError:
        return 0


def time_to_gap(watcher, victim, timeout: float = 30.0) -> float | None:
    """Seconds from SIGKILLing `victim` until `watcher` reports a gap (None: not within timeout)."""
    victim.kill()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = watcher.status(timeout=5.0)
        if st is not None and st["gaps"]:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None


def split_ranges(n_daemons: int, n_layers: int = 30) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / n_daemons) for i in range(n_daemons + 1)]
    return list(zip(bounds, bounds[1:]))


def measure(n_daemons: int, window: float, settle: float, threads: int) -> dict:
    mesh = Mesh(env={k: os.environ[k] for k in ("MESHD_RECORD_TTL",) if k in os.environ})
    try:
        daemons = mesh.start_chain(split_ranges(n_daemons), extra=["--threads", str(threads)])
        time.sleep(settle)
        before = [(cpu_seconds(d.proc.pid), log_lines(d.log_path)) for d in daemons]
        t0 = time.monotonic()
        time.sleep(window)
        elapsed = time.monotonic() - t0
        rows = []
        for d, (cpu0, lines0) in zip(daemons, before):
            rows.append({"daemon": d.name, "pid": d.proc.pid,
                         "cpu_pct": round(100 * (cpu_seconds(d.proc.pid) - cpu0) / elapsed, 3),
                         "log_lines": log_lines(d.log_path) - lines0})
        alive = [d.status() is not None for d in daemons]
        return {"window_s": round(elapsed, 1), "settle_s": settle, "daemons": rows, "all_alive": all(alive),
                "dead_peer_gap_s": time_to_gap(daemons[0], daemons[-1])}
    finally:
        mesh.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    res = measure(args.daemons, args.window, args.settle, args.threads)
    print(f"{args.daemons} idle serving daemons, {res['window_s']} s window after {args.settle} s settling "
          f"(goal: under 0.5% of a core each)")
    print(f"{'daemon':8} {'cpu % core':>10} {'log lines':>10}")
    for r in res["daemons"]:
        print(f"{r['daemon']:8} {r['cpu_pct']:>10.2f} {r['log_lines']:>10}")
    print(f"a killed daemon's layers became a gap after {res['dead_peer_gap_s']} s (goal: within 10 s)")
    print(json.dumps({"bench": "idle", **res}))


if __name__ == "__main__":
    main()
