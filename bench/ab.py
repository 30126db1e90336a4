"""Two revisions side by side: run one bench script from each, alternated, in one run on one box.

Why: this box drifts a lot between runs (llama.cpp's own decode ranged 51-98 tok/s in one day), so a
change is measured against its parent only within one run, the two interleaved, and compared by
median. Each revision runs from its own git worktree (its own bench script and its own meshd,
C kernel built in place), so "old" is exactly what that revision shipped.

Usage: python bench/ab.py --old REV [--new REV] [--rounds 2] -- bench/mesh_bench.py --tokens 32
Prints a table of every numeric field of the scripts' JSON (their last stdout line), the medians per
revision and new/old, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, base: Path) -> Path:
    """A detached worktree of `rev` with its C kernel built in place."""
    path = base / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=False,
                   capture_output=True)
    return path


def flatten(obj, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list):  # rows of a table: named by their "sessions" (or similar) field if any
        for i, v in enumerate(obj):
            name = next((f"{k}={v[k]}" for k in ("sessions", "name", "mode") if isinstance(v, dict) and k in v), i)
            out.update(flatten(v, f"{prefix}{name}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    return out


def run_once(tree: Path, cmd: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, *cmd], cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({out.returncode}): {out.stderr[-2000:]}")
    return flatten(json.loads(lines[-1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the bench script and its arguments")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    with tempfile.TemporaryDirectory(prefix="meshd-ab-") as tmp:
        trees = {"old": worktree(args.old, Path(tmp)), "new": worktree(args.new, Path(tmp))}
        try:
            runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    runs[side].append(run_once(trees[side], cmd))
                    print(f"round {r + 1} {side}: done", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    keys = sorted(set(runs["old"][0]) & set(runs["new"][0]))
    result = {"old": args.old, "new": args.new, "rounds": args.rounds, "cmd": cmd, "fields": {}}
    print(f"{'field':60s} {'old':>12s} {'new':>12s} {'new/old':>8s}")
    for k in keys:
        old = statistics.median(run[k] for run in runs["old"])
        new = statistics.median(run[k] for run in runs["new"])
        ratio = new / old if old else None
        result["fields"][k] = {"old": old, "new": new, "ratio": round(ratio, 3) if ratio else None}
        print(f"{k:60s} {old:12.4g} {new:12.4g} {ratio if ratio is not None else float('nan'):8.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
