"""The benches' PNG plots (bench/plots.py) from made-up results; matplotlib is the optional bench extra."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("plots", Path(__file__).resolve().parent.parent / "bench" / "plots.py")
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)
PNG = b"\x89PNG\r\n\x1a\n"


def levels(base: float) -> list[dict]:
    return [{"sessions": n, "aggregate_tok_s": base * n ** .5, "p95_ms": 20.0 * n} for n in (1, 4, 8, 16)]


def gate_run(started: str, score: float, mode: str = "full") -> dict:
    return {"bench": "gate", "mode": mode, "started": started, "machine": {"commit": "abc1234def", "meshd_kernel": "avx2"},
            "measures": [{"row": "decode_daemon", "kind": "speed", "score": score},
                         {"row": "rss_per_layer", "kind": "fit", "score": 1.1},
                         {"row": "output_drift", "kind": "correctness", "score": None}]}


def test_without_matplotlib_nothing_is_written_and_it_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plots.plot_sessions({"forward": {"levels": levels(20)}}, tmp_path / "b.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_sessions_sweep_and_a_gate_result_become_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    batch = {"bench": "batch", "cpu": "avx2", "forward 0:10,10:20,20:30 mb 2": {"levels": levels(25)},
             "relay 0:10,10:20,20:30 mb 2": {"levels": levels(18)}}
    assert plots.sweeps_of(batch).keys() == {"forward 0:10,10:20,20:30 mb 2", "relay 0:10,10:20,20:30 mb 2"}
    out = plots.plot_sessions(batch, tmp_path / "batch.png")
    assert out.read_bytes()[:8] == PNG
    gate = {"raw": {"one_daemon": {"levels": levels(60)},
                    "llamacpp_batched": {"levels": {str(lv["sessions"]): lv for lv in levels(70)}}}}
    assert list(plots.sweeps_of(gate)) == ["one_daemon", "llama.cpp, one batch"]
    assert plots.sweeps_of({"raw": {"three_daemons": None, "llamacpp_batched": None}}) == {}  # runs that failed
    assert plots.plot_sessions({"nothing": 1}, tmp_path / "none.png") is None


def test_a_speculation_result_becomes_a_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    row = lambda setup, workload, spec, plain: {"setup": setup, "workload": workload, "spec_tok_s": spec,  # noqa: E731
                                                "plain_tok_s": plain, "ratio": round(spec / plain, 2),
                                                "acceptance": 0.45}
    result = {"tokens": 128, "cpu": "avx2", "results": [row("loopback", "quote", 5.2, 5.0), row("relay", "quote", 2.8, 2.6),
                                                       row("loopback", "chat", 4.7, 4.7)]}
    assert plots.plot_speculation(result, tmp_path / "spec.png").read_bytes()[:8] == PNG
    assert plots.plot_speculation({"results": []}, tmp_path / "none.png") is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.plot_speculation(result, tmp_path / "no.png") is None and not (tmp_path / "no.png").exists()


def write_runs(folder: Path) -> None:
    for i, (score, mode) in enumerate([(0.9, "full"), (1.2, "smoke"), (1.05, "quick")]):
        (folder / f"gate-2026-12-0{i + 1}T10-00-00.json").write_text(json.dumps(
            gate_run(f"2026-12-0{i + 1}T10:00:00+00:00", score, mode)))


def test_the_gate_history_is_every_run_but_smoke_runs_in_order(tmp_path):
    write_runs(tmp_path)
    (tmp_path / "gate-2026-12-09T10-00-00.json").write_text('{"bench": "gate", "mode": "fu')  # cut short
    runs, rows = plots.history(tmp_path)
    assert [r["mode"] for r in runs] == ["full", "quick"]
    assert rows == {"decode_daemon": [(0, 0.9), (1, 1.05)], "rss_per_layer": [(0, 1.1), (1, 1.1)]}


def test_the_gate_history_plots_every_full_run_in_the_folder(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    assert plots.gate_history(tmp_path) is None  # no run yet
    write_runs(tmp_path)
    out = plots.gate_history(tmp_path)
    assert out == tmp_path / "gate-history.png" and out.read_bytes()[:8] == PNG


def test_batch_bench_writes_its_json_and_the_png_beside_it(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    monkeypatch.syspath_prepend(str(Path(plots.__file__).parent))  # batch_bench imports plots beside it
    spec = importlib.util.spec_from_file_location("batch_bench", Path(plots.__file__).parent / "batch_bench.py")
    batch_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(batch_bench)
    result = {"bench": "batch", "cpu": "avx2", "forward 0:30 mb 2": {"levels": levels(30)}}
    batch_bench.write_result(result, tmp_path / "runs" / "batch.json", "made up")
    assert json.loads((tmp_path / "runs" / "batch.json").read_text()) == result
    assert (tmp_path / "runs" / "batch.png").read_bytes()[:8] == PNG
