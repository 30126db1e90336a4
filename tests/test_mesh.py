"""Daemons as real processes on loopback: joining, signed coverage, auto layers, failure, shutdown."""

import signal
import subprocess
import sys
import time

import pytest

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
GAP_BOUND_S = 8 + 1 + 3.5 + 3.5  # record TTL (8 s in tests) + coverage interval + round timeout + slack


@pytest.fixture
def mesh():
    m = Mesh()
    yield m
    m.close()


def test_auto_join_completes_coverage_then_a_killed_daemon_shows_as_a_gap(mesh):
    a = mesh.start("a", ["--layers", "0:12"])
    st = a.wait_serving()
    assert st["range"] == [0, 12] and st["addrs"][0].endswith("/p2p/" + st["peer_id"])
    assert st["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(st["coverage"]) == 30
    assert st["gaps"] == [[12, 30]] and not st["complete"]
    b = mesh.start("b", ["--bootstrap", st["addrs"][0], "--layers", "auto", "--num-layers", "10"])
    b_st = b.wait_serving()
    assert b_st["range"] == [12, 22]
    c = mesh.start("c", ["--bootstrap", st["addrs"][0], "--layers", "auto", "--num-layers", "10"])
    c_st = c.wait_serving()
    assert c_st["range"] == [20, 30]  # the gap [22, 30) is 8 long: it comes with the 2 layers before it
    full = a.wait_for(lambda s: s["complete"], timeout=60, what="complete coverage")
    served = [1] * 20 + [2] * 2 + [1] * 8
    assert full["coverage"] == served
    assert {p["peer_id"] for p in full["peers"]} == {b_st["peer_id"], c_st["peer_id"]}
    # the human view shows the same map
    text = ctl(a.socket, ["status"]).stdout
    assert "coverage  complete" in text and "servers  " + "".join(map(str, served)) in text
    # a daemon killed without warning shows as a gap once its record lapses (how soon: bench/idle_bench.py)
    c.kill()
    t0 = time.monotonic()
    gap = a.wait_for(lambda s: s["gaps"] == [[22, 30]], timeout=GAP_BOUND_S + 10, what="the gap")
    print(f"the killed daemon's layers showed as a gap after {time.monotonic() - t0:.1f} s (bound {GAP_BOUND_S} s)")
    assert "INCOMPLETE" in ctl(a.socket, ["status"]).stdout and gap["coverage"][25] == 0
    # asking for text now is a clear no-route error naming the layers
    out = ctl(a.socket, ["generate", "--max-tokens", "4", "hello"])
    assert out.returncode == 4 and "[22, 30)" in out.stderr and out.stdout == ""


def test_a_generation_waits_for_a_live_hop_whose_record_lapsed(mesh):
    """A hop's republish can come late (a loaded box, a slow link): a generation that finds its layers
    uncovered while their record lapsed only lately waits for it instead of failing with "no route"."""
    a, b, _ = mesh.start_chain([(0, 10), (10, 20), (20, 30)])
    reference = ctl(a.socket, ["generate", "--max-tokens", "8", "--ignore-eos", "hello"])
    assert reference.returncode == 0, reference.stderr
    b.proc.send_signal(signal.SIGSTOP)  # frozen: it republishes nothing, its connections stay open
    try:
        a.wait_for(lambda s: s["gaps"] == [[10, 20]], timeout=GAP_BOUND_S + 10, what="b's record lapsed")
        late = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(a.socket), "generate",
                                 "--max-tokens", "8", "--ignore-eos", "hello"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)  # the generation is waiting for b: it has not failed
        assert late.poll() is None, late.communicate()
    finally:
        b.proc.send_signal(signal.SIGCONT)
    out, err = late.communicate(timeout=120)
    assert late.returncode == 0 and out == reference.stdout, err + a.tail()
    assert "waiting for its republish" in a.log_path.read_text()


def test_sigterm_stops_cleanly_and_leaves_no_socket(mesh):
    a = mesh.start("a", ["--layers", "0:5"])
    a.wait_serving()
    assert a.socket.exists()
    assert a.terminate() == 0
    assert not a.socket.exists()
    assert "withdrawing record" in a.log_path.read_text()


def test_meshctl_without_a_daemon_says_so(tmp_path):
    out = ctl(tmp_path / "none.sock", ["status"])
    assert out.returncode == 3 and "is meshd running" in out.stderr
    stale = tmp_path / "stale.sock"
    import socket as s

    sock = s.socket(s.AF_UNIX, s.SOCK_STREAM)
    sock.bind(str(stale))
    sock.close()  # a socket file nobody listens on
    out = ctl(stale, ["generate", "hi"])
    assert out.returncode == 3 and "not running" in out.stderr
