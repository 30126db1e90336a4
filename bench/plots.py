"""PNG plots of bench results, written next to their JSON: the sessions sweep, speculation per link
setup, and the gate's history.

matplotlib is optional (`pip install -e '.[bench]'`): without it every function here says so on
stderr and writes nothing, and the benches run as before. Plots read the JSON the benches already
write; nothing here measures anything.
Usage: python bench/plots.py gate [RESULTS_DIR]     the history of bench/results/gate-*.json
       python bench/plots.py batch RESULT.json      a batch_bench.py result (or a gate result's raw runs)
       python bench/plots.py spec RESULT.json       a spec_bench.py result (speculation per setup)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LINES = ("-", "--", ":")


def pyplot():
    """matplotlib's pyplot without a display, or None (said on stderr) where it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("plots: matplotlib is not installed (pip install -e '.[bench]'); no PNG written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def sweeps_of(result: dict) -> dict[str, list[dict]]:
    """The sessions sweeps in a result: batch_bench's runs ({name: {"levels": [...]}}), or a gate
    result's raw one- and three-daemon runs and its llama.cpp batch."""
    raw = result.get("raw", result)
    out = {name: run["levels"] for name, run in raw.items()
           if isinstance(run, dict) and isinstance(run.get("levels"), list)}
    llama = (raw.get("llamacpp_batched") or {}).get("levels")
    if isinstance(llama, dict):
        out["llama.cpp, one batch"] = sorted(llama.values(), key=lambda lv: lv["sessions"])
    return out


def plot_sessions(result: dict, png: Path, title: str = "") -> Path | None:
    """Aggregate tok/s and p95 time between tokens against concurrent sessions, one line a run."""
    plt, sweeps = pyplot(), sweeps_of(result)
    if plt is None or not sweeps:
        return None
    fig, (tps, p95) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, levels) in enumerate(sweeps.items()):
        n, style = [lv["sessions"] for lv in levels], dict(marker="o", label=name, linestyle=LINES[k // 10 % 3])
        tps.plot(n, [lv["aggregate_tok_s"] for lv in levels], **style)
        p95.plot(n, [lv["p95_ms"] for lv in levels], **style)
    for ax, label in ((tps, "aggregate decode tok/s"), (p95, "p95 ms between tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({lv["sessions"] for levels in sweeps.values() for lv in levels}))
        ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(label)
        ax.grid(alpha=.3)
    tps.legend(fontsize=8)
    cpu = result.get("machine", {}).get("meshd_kernel") or result.get("cpu") or "?"
    fig.suptitle(f"{title or 'meshd under many users (SmolLM2-135M Q4_1)'} (CPU: {cpu})")
    return _save(plt, fig, png)


def gate_history(results: Path = RESULTS, png: Path | None = None) -> Path | None:
    """Each speed and fit measure of every gate run in `results`, as its score (value against its
    threshold: 1 is the bar), run after run."""
    runs, rows = history(results)
    plt = pyplot() if runs else None
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for k, (row, points) in enumerate(sorted(rows.items())):  # ten colours, then the next line style
        ax.plot([i for i, _ in points], [s for _, s in points], marker="o", label=row, linestyle=LINES[k // 10 % 3])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="threshold")
    ax.set_xticks(range(len(runs)), [f"{r['started'][5:16]}\n{r['machine'].get('commit', '')[:7]}" for r in runs],
                  fontsize=8)
    ax.set_ylabel("score (value against threshold)")
    ax.set_title(f"release gate, {len(runs)} runs (CPU: {runs[-1]['machine'].get('meshd_kernel', '?')})")
    ax.grid(alpha=.3)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, .5))
    return _save(plt, fig, png or results / "gate-history.png")


def history(results: Path) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    """The gate runs in `results` (smoke runs left out: they bind nothing), oldest first, and each
    speed or fit row's (run index, score)."""
    runs = [r for r in map(_read, sorted(results.glob("gate-*.json")))
            if isinstance(r, dict) and r.get("bench") == "gate" and r.get("mode") != "smoke"]
    rows: dict[str, list] = {}
    for i, run in enumerate(runs):
        for m in run["measures"]:
            if m.get("kind") in ("speed", "fit") and isinstance(m.get("score"), (int, float)):
                rows.setdefault(m["row"], []).append((i, m["score"]))
    return runs, rows


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"plots: {path} left out: {exc}", file=sys.stderr)
        return None


def plot_speculation(result: dict, png: Path) -> Path | None:
    """spec_bench's rows: decode tok/s with drafts and without, per setup (loopback, the test bed's
    links), one panel a workload, the ratio and acceptance over each pair of bars."""
    plt, rows = pyplot(), [r for r in result.get("results", []) if isinstance(r, dict) and "setup" in r]
    if plt is None or not rows:
        return None
    workloads = sorted({r["workload"] for r in rows})
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        by = {r["setup"]: r for r in rows if r["workload"] == workload}
        xs = range(len(setups))
        for dx, key, label in ((-0.2, "spec_tok_s", "with drafts"), (0.2, "plain_tok_s", "plain")):
            ax.bar([x + dx for x in xs], [by.get(s, {}).get(key, 0) for s in setups], width=0.4, label=label)
        for x, s in zip(xs, setups):
            if s in by:
                acc = by[s].get("acceptance")
                ax.annotate(f"{by[s]['ratio']}x" + (f", {acc:.0%} kept" if acc is not None else ""),
                            (x, max(by[s]["spec_tok_s"], by[s]["plain_tok_s"])), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), setups)
        ax.set_ylabel("decode tok/s (median)")
        ax.set_title(f"{workload}")
        ax.grid(axis="y", alpha=.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"speculation against plain decoding, {result.get('tokens', '?')} tokens"
                 f" (CPU: {result.get('cpu', '?')})")
    return _save(plt, fig, png)


def _save(plt, fig, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"plots: wrote {png}", file=sys.stderr)
    return png


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("gate", "batch", "spec"):
        raise SystemExit(__doc__.split("Usage: ")[1])
    if sys.argv[1] == "gate":
        gate_history(Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS)
    else:
        src = Path(sys.argv[2])
        draw = plot_sessions if sys.argv[1] == "batch" else plot_speculation
        draw(json.loads(src.read_text()), src.with_suffix(".png"))


if __name__ == "__main__":
    main()
