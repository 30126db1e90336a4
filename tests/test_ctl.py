"""meshctl starts at once: it imports neither trio, libp2p nor torch."""

import subprocess
import sys


def test_meshctl_imports_no_event_loop_no_libp2p_no_torch():
    code = ("import sys, meshd.ctl; heavy = [m for m in ('trio', 'libp2p', 'torch', 'transformers') if m in sys.modules];"
            " print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_meshctl_without_a_daemon_exits_3_quickly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshd.ctl", "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "no daemon socket" in out.stderr
