"""Leaving well (real daemons, SmolLM2): SIGTERM drains a hop (running generations move to a replica with their
KV, or finish on it where none is; new ones go elsewhere), a second SIGTERM exits at once, and `meshctl drain`
drains without exiting."""

import json
import signal
import subprocess
import sys
import time

import pytest

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time"


def start_generation(socket, tokens: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(socket), "generate", "--max-tokens",
                             str(tokens), "--ignore-eos", "--stats", PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def in_use(*daemons):
    return next(d for d in daemons if d.status()["sessions"] >= 1)


def test_sigterm_drains_a_hop_then_a_second_one_exits_at_once():
    m = Mesh(env={"MESHD_RECORD_TTL": "8", "MESHD_DRAIN_TIMEOUT": "60"})
    try:
        a, b1, b2, c = m.start_chain([(0, 10), (10, 20), (10, 20), (20, 30)], extra=["--threads", "1"])
        solo = ctl(a.socket, ["generate", "--max-tokens", "600", "--ignore-eos", PROMPT], timeout=300)
        assert solo.returncode == 0, solo.stderr
        running = start_generation(a.socket, 600)  # long enough to be moved before it ends
        first = running.stdout.read(1)
        assert first
        leaving = in_use(b1, b2)
        staying = b2 if leaving is b1 else b1
        leaving_id = leaving.status()["peer_id"]
        leaving.proc.send_signal(signal.SIGTERM)
        # the running generation's session is handed over to the other 10:20 daemon (tests/test_handover.py),
        # so the hop leaves in seconds, and the generation goes on there without a replay
        assert leaving.proc.wait(30) == 0
        rest, err = running.stdout.read(), running.stderr.read()
        assert running.wait(120) == 0, err
        stats = json.loads(err.strip().splitlines()[-1])
        assert stats["reroutes"] == 0 and stats["handovers"] == 1
        assert first + rest == solo.stdout
        # new generations route around it
        out = ctl(a.socket, ["generate", "--max-tokens", "8", "--stats", PROMPT], timeout=120)
        assert out.returncode == 0, out.stderr
        route = [hop[0] for hop in json.loads(out.stderr.strip().splitlines()[-1])["route"]]
        assert staying.status()["peer_id"] in route and leaving_id not in route
        # a second SIGTERM does not wait for the sessions to finish
        running = start_generation(a.socket, 400)
        assert running.stdout.read(1)
        assert staying.status()["sessions"] == 1
        staying.proc.send_signal(signal.SIGTERM)
        staying.wait_for(lambda s: s["state"] == "draining", timeout=10, what="draining")
        t0 = time.monotonic()
        staying.proc.send_signal(signal.SIGTERM)
        assert staying.proc.wait(15) == 0
        print(f"the second SIGTERM: the daemon exited after {time.monotonic() - t0:.2f} s")
        running.stdout.read()
        # the generation did not finish first: nobody serves 10:20 any more, and the client is told, not hung
        assert running.wait(120) != 0
    finally:
        m.close()


def test_meshctl_drain_stays_up_and_shows_draining():
    m = Mesh()
    try:
        a, b, c = m.start_chain([(0, 10), (10, 20), (20, 30)], extra=["--threads", "1"])
        out = ctl(b.socket, ["drain"], timeout=60)
        assert out.returncode == 0 and "drained" in out.stdout, out.stderr
        st = b.status()
        assert st["state"] == "draining" and st["drain_reason"] == "meshctl drain" and b.proc.poll() is None
        shown = ctl(b.socket, ["status"])
        assert "state     draining (meshctl drain)" in shown.stdout
        # its layers are no longer offered: the entry says which are uncovered
        a.wait_for(lambda s: [10, 20] in s["gaps"], timeout=20, what="10:20 withdrawn")
        out = ctl(a.socket, ["generate", "--max-tokens", "4", PROMPT])
        assert out.returncode == 4 and "[10, 20)" in out.stderr
    finally:
        m.close()
