"""`meshd demo`: three daemons on loopback split SmolLM2, then a streamed generation through them.

Rule: the demo is what a newcomer runs first, so it uses only the public commands (`meshd join`,
the control socket as `meshctl` speaks it), shows what happens, and stops every process it
started, by PID, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPLIT = [(0, 10), (10, 20), (20, 30)]


def _ctl(sock: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.ctl", "--socket", str(sock), *args],
                          capture_output=True, text=True, timeout=timeout)


def _status(sock: Path) -> dict | None:
    if not sock.exists():
        return None
    out = _ctl(sock, "status", "--json")
    return json.loads(out.stdout) if out.returncode == 0 else None


def _wait(procs, sock: Path, predicate, what: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p, log in procs:
            if p.poll() is not None:
                raise RuntimeError(f"daemon {name} exited early; its log:\n{Path(log).read_text()[-3000:]}")
        st = _status(sock)
        if st and predicate(st):
            return st
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def say(text: str) -> None:
    print(f"\033[1m==> {text}\033[0m" if sys.stderr.isatty() else f"==> {text}", file=sys.stderr, flush=True)


def run_demo(args) -> int:
    root = Path(tempfile.mkdtemp(prefix="meshd-demo-", dir="/tmp"))
    procs: list[tuple[str, subprocess.Popen, str]] = []
    socks = {name: root / name / "s.sock" for name in "abc"}
    try:
        boot = None
        for name, (a, b) in zip("abc", SPLIT):
            (root / name).mkdir()
            cmd = [sys.executable, "-m", "meshd.cli", "join", "--layers", f"{a}:{b}", "--model", args.model,
                   "--listen", "/ip4/127.0.0.1/tcp/0", "--state-dir", str(root / name),
                   "--socket", str(socks[name])] + (["--bootstrap", boot] if boot else [])
            log = str(root / name / "log")
            with open(log, "wb") as fh:
                p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
            procs.append((name, p, log))
            say(f"daemon {name}: layers {a}:{b} (pid {p.pid})")
            if boot is None:
                st = _wait(procs, socks[name], lambda s: s["state"] == "serving", "the first daemon")
                boot = st["addrs"][0]
                say(f"mesh started at {boot}")
        say("waiting for the coverage map to fill")
        st = _wait(procs, socks["a"], lambda s: s["complete"], "complete coverage")
        print(_ctl(socks["a"], "status").stdout, file=sys.stderr)
        say(f"generating through the mesh: {args.prompt!r}")
        gen = subprocess.run([sys.executable, "-m", "meshd.ctl", "--socket", str(socks["a"]), "generate", "--chat",
                              "--stats", "--max-tokens", str(args.max_tokens), args.prompt],
                             stderr=subprocess.PIPE, text=True, timeout=600)
        if gen.returncode != 0:
            print(gen.stderr, file=sys.stderr)
            return gen.returncode
        stats = json.loads(gen.stderr.strip().splitlines()[-1])
        route = " -> ".join(f"{peer[-8:]}[{a}:{b})" for peer, a, b in stats["route"])
        say(f"route: {route}")
        say(f"{stats['tokens']} tokens, first after {stats['ttft_s']:.2f} s, {stats['decode_tok_per_s']} tok/s")
        return 0
    finally:
        say("stopping the daemons")
        for _, p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p, _ in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if os.environ.get("MESHD_DEMO_KEEP"):
            say(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
