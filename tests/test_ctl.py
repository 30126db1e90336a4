"""meshctl starts at once: it imports neither trio, libp2p nor torch."""

import subprocess
import sys

from meshd.cli.render import draft_line, load_line


def test_meshctl_imports_no_event_loop_no_libp2p_no_torch():
    code = ("import sys, meshd.cli.ctl; heavy = [m for m in ('trio', 'libp2p', 'torch', 'transformers') if m in sys.modules];"
            " print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_meshctl_without_a_daemon_exits_3_quickly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "no daemon socket" in out.stderr


def test_the_load_line_shows_an_entrys_generations_per_microbatch():
    st = {"queue": 3, "batches": {"mean_batch": 2.5, "largest_batch": 4, "passes": 10}, "busy_refusals": 1,
          "max_sessions": 64, "microbatches": [4, 3]}
    line = load_line(st)
    assert line.startswith("load      3 frames queued, batches of 2.5 on average (largest 4, 10 passes)")
    assert line.endswith("1 refused busy, limit 64 sessions, generations per microbatch 4/3")
    assert load_line({**st, "microbatches": []}).endswith("limit 64 sessions")


def test_the_drafts_line_shows_the_setting_and_how_many_drafts_stood():
    line = draft_line({"mode": "auto", "draft_max": 8, "drafted": 40, "accepted": 30})
    assert line == "drafts    speculate auto (at most 8 a step): 40 sent, 30 accepted (75%)"
    assert draft_line({"mode": "off", "draft_max": 8, "drafted": 0, "accepted": 0}).endswith("0 sent, 0 accepted")
    assert draft_line(None) == "drafts    unknown"
    with_model = {"mode": "auto", "draft_max": 4, "drafted": 8, "accepted": 6,
                  "source": {"model": "small.gguf", "recipe": "native", "layers": 30}}
    assert draft_line(with_model) == ("drafts    speculate auto (at most 4 a step, draft model small.gguf (native)):"
                                      " 8 sent, 6 accepted (75%)")
