"""A rolling restart (real daemons, SmolLM2): every daemon of a redundant mesh is stopped with SIGTERM and
started again, one after another, while a client generates without pause through daemons that are up;
no generation fails and every output equals the one the untouched mesh gave. Each daemon comes back on
its own port, as a restarted service does (`--listen` of its unit)."""

import socket
import threading
import time

import pytest

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time"
TOKENS = "24"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rolling_restart_under_load_loses_no_generation():
    m = Mesh(env={"MESHD_RECORD_TTL": "8", "MESHD_DRAIN_TIMEOUT": "60"})
    ranges = [(0, 10), (0, 10), (10, 20), (10, 20), (20, 30), (20, 30)]
    try:
        listen = {f"d{i}": f"/ip4/127.0.0.1/tcp/{free_port()}" for i in range(len(ranges))}
        args = {f"d{i}": ["--layers", f"{a}:{b}", "--threads", "1"] for i, (a, b) in enumerate(ranges)}
        daemons = [m.start("d0", args["d0"], listen=listen["d0"])]
        boot = daemons[0].wait_serving()["addrs"][0]
        daemons += [m.start(f"d{i}", [*args[f"d{i}"], "--bootstrap", boot], listen=listen[f"d{i}"])
                    for i in range(1, len(ranges))]
        for d in daemons:
            d.wait_for(lambda s: s["state"] == "serving" and s["coverage"] == [2] * 30, what="every daemon serving")
        reference = ctl(daemons[0].socket, ["generate", "--max-tokens", TOKENS, "--ignore-eos", PROMPT], timeout=120)
        assert reference.returncode == 0 and reference.stdout.strip(), reference.stderr
        up = {d.name: d for d in daemons}
        lock, stop = threading.Lock(), threading.Event()
        results: list[tuple[str, int, str, str]] = []
        using: dict[str, str | None] = {"name": None}

        def client() -> None:
            i = 0
            while not stop.is_set():
                with lock:
                    names = sorted(up)
                    name = names[i % len(names)]
                    using["name"] = name
                    sock = up[name].socket
                out = ctl(sock, ["generate", "--max-tokens", TOKENS, "--ignore-eos", PROMPT], timeout=180)
                with lock:
                    using["name"] = None
                results.append((name, out.returncode, out.stdout, out.stderr))
                i += 1

        worker = threading.Thread(target=client, daemon=True)
        worker.start()
        for i, d in enumerate(list(daemons)):
            while True:  # take it out of the client's choice, and do not stop it under the client's feet
                with lock:
                    if using["name"] != d.name:
                        up.pop(d.name)
                        break
                time.sleep(0.05)
            boot = next(iter(up.values())).addr  # any daemon that stays up
            assert d.terminate(timeout=90) == 0, d.tail()
            fresh = m.start(d.name, [*args[d.name], "--bootstrap", boot], listen=listen[d.name])
            fresh.wait_for(lambda s: s["state"] == "serving" and s["coverage"] == [2] * 30, what="back in the mesh")
            for other in up.values():
                other.wait_for(lambda s: s["coverage"] == [2] * 30, timeout=60, what="sees it back")
            with lock:
                up[d.name] = fresh
            daemons[i] = fresh
        time.sleep(2)
        stop.set()
        worker.join(200)
        assert not worker.is_alive()
        assert len(results) >= len(ranges), results
        failed = [r for r in results if r[1] != 0 or r[2] != reference.stdout]
        assert not failed, "\n".join(f"through {n}: exit {rc}, {err.strip()}" for n, rc, _, err in failed)
        print(f"rolling restart: {len(results)} generations, all equal to the reference")
    finally:
        m.close()
