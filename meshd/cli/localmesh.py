"""Real daemon processes on loopback (tests, benchmarks): start, query, stop by PID.

Every wait is bounded; every process a test starts is stopped by its own PID when the test ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT = 120.0


class DaemonProc:
    def __init__(self, root: Path, name: str, args: list[str], env: dict | None = None, preexec_fn=None,
                 listen: str = "/ip4/127.0.0.1/tcp/0", wrap: list[str] = ()) -> None:
        """`wrap` prefixes the command (e.g. `ip netns exec NS`, which keeps the PID)."""
        self.name, self.dir = name, root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "s.sock"
        self.log_path = self.dir / "log"
        cmd = [*wrap, sys.executable, "-m", "meshd.cli", "join", "--listen", listen,
               "--state-dir", str(self.dir / "state"), "--socket", str(self.socket), *args]
        self.log = open(self.log_path, "ab")  # a daemon restarted under its name keeps its earlier log
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)

    def status(self, timeout: float = 10.0) -> dict | None:
        out = ctl(self.socket, ["status", "--json"], timeout=timeout)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def wait_for(self, predicate, timeout: float = START_TIMEOUT, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            last = self.status() if self.socket.exists() else None
            if last is not None and predicate(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"daemon {self.name}: timed out waiting for {what}; last status {last}\n{self.tail()}")

    def wait_serving(self) -> dict:
        return self.wait_for(lambda s: s["state"] == "serving", what="serving")

    @property
    def addr(self) -> str:
        return self.status()["addrs"][0]

    def tail(self, n: int = 30, skip: str | None = None) -> str:
        """The log's last `n` lines (leaving out those containing `skip`)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join([ln for ln in lines if skip is None or skip not in ln][-n:])

    def error_lines(self) -> list[str]:
        """The ERROR lines in its log so far: meshd's own (JSON, level error) and its libraries' ("ERROR name: ...")."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if line.startswith("ERROR") or '"level": "error"' in line]

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def free_port() -> int:
    """A TCP port on loopback free now: for a daemon that must come back on the port it had (`listen`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_rest(stream) -> tuple[str, float]:
    """Read a text stream (a generating meshctl's stdout) to its end, a character at a time; returns
    the text and the longest pause between characters, the time a disruption cost the client. (Not
    `communicate()`: it would skip what the text wrapper has buffered already.)"""
    last, pause, text = time.monotonic(), 0.0, []
    while chunk := stream.read(1):
        now = time.monotonic()
        pause, last = max(pause, now - last), now
        text.append(chunk)
    return "".join(text), pause


def ctl(socket: Path, args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(socket), *args],
                          capture_output=True, text=True, timeout=timeout)


def local_text(prompt: str, tokens: int, split: str = "10,20") -> str:
    """The reference text: `meshd local` run in one process over the same split (greedy)."""
    local = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--split", split, "--max-tokens", str(tokens),
                            prompt], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    return local.stdout


class Mesh:
    """A set of daemons under one short temporary directory (Unix socket paths must stay short)."""

    def __init__(self, env: dict | None = None) -> None:
        """`env` goes to every daemon; the default shortens record lifetimes for tests (8 s). Daemons
        check no generation unless asked (MESHD_VERIFY_RATE=0, which `env` or a flag overrides)."""
        self.root = Path(tempfile.mkdtemp(prefix="meshd-", dir="/tmp"))
        self.daemons: list[DaemonProc] = []
        self.env = {"MESHD_RECORD_TTL": "8"} if env is None else env

    def start(self, name: str, args: list[str], env: dict | None = None, preexec_fn=None, **where) -> DaemonProc:
        """`preexec_fn` runs in the child before the daemon starts (e.g. to enter a memory cgroup);
        `where` (`listen`, `wrap`) places it elsewhere than loopback, e.g. in a test-bed host."""
        # no checked generations unless a test asks (--verify-rate, --verify): a check drawn at random
        # (1 in 4 by default) would make a test's timing and stats differ from run to run
        d = DaemonProc(self.root, name, args, {"MESHD_VERIFY_RATE": "0", **self.env, **(env or {})}, preexec_fn,
                       **where)
        self.daemons.append(d)
        return d

    def start_chain(self, ranges: list[tuple[int, int]], extra: list[str] | None = None,
                    env: dict | None = None) -> list[DaemonProc]:
        """Daemons serving the given ranges, the first as bootstrap; returns once all serve and every
        one of them sees every other serving."""
        boot, started = None, []
        for i, (a, b) in enumerate(ranges):
            d = self.start(f"d{i}", ["--layers", f"{a}:{b}", *(["--bootstrap", boot] if boot else []), *(extra or [])],
                           env)
            started.append(d)
            if boot is None:
                boot = d.wait_serving()["addrs"][0]
        for d in started:
            d.wait_for(lambda s: s["state"] == "serving" and s["complete"]
                       and sum(p["serving"] for p in s["peers"]) == len(ranges) - 1,
                       what="every daemon serving")
        return started

    def tails(self, n: int = 40, skip: str = "Failed to open TCP stream") -> str:
        """Every daemon's last `n` log lines but those containing `skip` (py-libp2p logs each failed
        dial of an address), for an assertion's message."""
        return "\n".join(f"--- {d.name} ---\n{d.tail(n, skip)}" for d in self.daemons)

    def close(self) -> None:
        """Stop every daemon; with MESHD_KEEP_LOGS=DIR set, their logs are kept under DIR first."""
        for d in self.daemons:
            d.terminate()
        keep = os.environ.get("MESHD_KEEP_LOGS")
        if keep:
            for d in self.daemons:
                dest = Path(keep) / self.root.name / d.name
                dest.mkdir(parents=True, exist_ok=True)
                if d.log_path.exists():
                    shutil.copy(d.log_path, dest / "log")
        shutil.rmtree(self.root, ignore_errors=True)
