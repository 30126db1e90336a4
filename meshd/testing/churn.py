"""A churn soak (real daemons on loopback, SmolLM2): clients generate without pause through one entry while
a chaos loop kills, freezes or stops one daemon at a time and brings it back, as an operator's mesh lives.
Every generation is checked against the text the calm mesh gave for its prompt.

Rules it keeps: a fault never hits the clients' entry, a daemon that is down or coming back, or a daemon
whose range has no other server up; every wait is bounded; every process it starts (daemons and clients)
is ended by its own PID when the soak ends, also when it fails. Used by bench/churn_bench.py and
tests/test_churn.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from meshd.testing.churn_report import entry_events, report
from meshd.cli.localmesh import DaemonProc, Mesh, free_port, read_rest

# Ordinary prompts, of the kind anyone types first; none was chosen for how it behaves under churn.
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The best way to learn a language is", "In 1969, the first", "Dear Sir or Madam,",
           "import numpy as np\n", "My favourite recipe for pancakes", "The three primary colours are",
           "A good night's sleep", "The train to London leaves"]
FAULTS = ("kill", "stop", "term")  # SIGKILL then a restart; SIGSTOP then SIGCONT; SIGTERM (it leaves) then a restart
LEAVE_S = 30.0  # a SIGTERMed daemon still up after this is killed, and the fault says so


@dataclass(frozen=True)
class SoakPlan:
    ranges: tuple = ((0, 10), (0, 10), (10, 20), (10, 20), (20, 30), (20, 30))  # the first is the clients' entry
    clients: int = 3
    tokens: int = 40
    calm_s: float = 45.0  # at least; the calm phase also lasts until every prompt has its text
    chaos_s: float = 240.0
    period_s: float = 15.0  # between faults, give or take a fifth (seeded)
    seed: int = 0
    record_ttl: int = 8
    down_s: float = 8.0  # a SIGKILLed daemon restarts this long after
    frozen_s: float = 6.0  # a SIGSTOPped daemon gets SIGCONT this long after
    heal_s: float = 180.0  # the end's wait for every daemon serving and every layer served twice
    generation_s: float = 120.0  # a client still running after this is killed and its generation failed
    # a restarted daemon's imports and loading run at this nice value until it serves (0: like the others): on
    # loopback they would take the cores of the daemons serving, which on a real mesh are other machines
    restart_nice: int = 0
    aim: str = "busy"  # "busy": a daemon with sessions open when there is one (a fault on an idle one tells little); "any"


@dataclass(frozen=True)
class Outcome:
    """One generation as its client saw it. `at`: seconds since the soak began."""
    phase: str
    client: int
    prompt: str
    at: float
    latency_s: float
    pause_s: float  # the longest wait between two characters (the first included)
    code: int
    text: str
    error: str = ""
    stats: dict = field(default_factory=dict)
    load: float = 0.0  # the box's one-minute load average when it began (other work shares the cores)


@dataclass
class Fault:
    kind: str
    target: str
    at: float  # seconds since the soak began
    sessions: int = 0  # open on the target when it was chosen
    back_at: float | None = None  # when it was continued, or its restart was started
    left_s: float | None = None  # term: how long the daemon took to exit
    serving_at: float | None = None  # kill, term: when the restarted daemon said it serves
    note: str = ""


class Clients:
    """K threads, each running one `meshctl generate` after another through `entry` until stopped."""

    def __init__(self, plan: SoakPlan, entry: DaemonProc, phase: str, t0: float) -> None:
        self.plan, self.entry, self.phase, self.t0 = plan, entry, phase, t0
        self.outcomes: list[Outcome] = []
        self.running: set[subprocess.Popen] = set()
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.turn = 0
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(plan.clients)]
        for t in self.threads:
            t.start()

    def next_prompt(self) -> str:
        with self.lock:
            self.turn += 1
            return PROMPTS[(self.turn - 1) % len(PROMPTS)]

    def loop(self, client: int) -> None:
        while not self.stopping.is_set():
            self.outcomes.append(self.generate(client, self.next_prompt()))

    def generate(self, client: int, prompt: str) -> Outcome:
        p = self.plan
        at, load = time.monotonic(), os.getloadavg()[0]
        proc = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(self.entry.socket), "generate",
                                 "--max-tokens", str(p.tokens), "--ignore-eos", "--stats", "--timeout", "60", prompt],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with self.lock:
            self.running.add(proc)
        watchdog = threading.Timer(p.generation_s, proc.kill)
        watchdog.start()
        try:
            text, pause = read_rest(proc.stdout)
            err = proc.stderr.read()
            code = proc.wait()
        finally:
            watchdog.cancel()
            with self.lock:
                self.running.discard(proc)
        latency = time.monotonic() - at
        lines = err.strip().splitlines()
        stats = json.loads(lines[-1]) if code == 0 and lines and lines[-1].startswith("{") else {}
        error = "" if code == 0 else (f"killed after {p.generation_s:.0f} s; " if code < 0 else "") + err.strip()[-600:]
        return Outcome(self.phase, client, prompt, round(at - self.t0, 2), round(latency, 3), round(pause, 3), code,
                       text, error, stats, load)

    def stop(self, timeout: float) -> list[Outcome]:
        """No new generation; those running finish (or are killed by their PID past `timeout`)."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        for t in self.threads:
            t.join(10)
        return list(self.outcomes)

    def kill(self) -> None:
        with self.lock:
            procs = list(self.running)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


class Chaos:
    """Faults one daemon at a time and brings it back. The loop calls `tick()`; each faulted daemon is
    brought back by a thread of its own, on time, unless the soak is ending (`cancel()`)."""

    def __init__(self, plan: SoakPlan, mesh: Mesh, daemons: dict[str, DaemonProc], args: dict[str, list[str]],
                 listen: dict[str, str], t0: float, say) -> None:
        self.plan, self.mesh, self.daemons, self.args, self.listen, self.t0 = plan, mesh, daemons, args, listen, t0
        self.say = say
        self.rng = random.Random(plan.seed)
        self.faults: list[Fault] = []
        self.pending: dict[str, threading.Thread] = {}  # a faulted daemon -> the thread bringing it back
        self.lock, self.ending = threading.Lock(), threading.Event()
        self.kinds: list[str] = []
        self.next_at = time.monotonic() + self.gap()
        self.deferred = 0  # fault times at which no daemon could be faulted

    def gap(self) -> float:
        return self.plan.period_s * self.rng.uniform(0.8, 1.2)

    def next_kind(self) -> str:
        """Each block of three faults has one of each kind, in a seeded order."""
        if not self.kinds:
            self.kinds = self.rng.sample(FAULTS, len(FAULTS))
        return self.kinds.pop(0)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        target, sessions = self.choose()
        if target is None:
            self.deferred += 1
            self.next_at = now + 1.0
        else:
            self.strike(target, self.next_kind(), sessions)
            self.next_at = now + self.gap()

    def range_of(self, name: str) -> tuple[int, int]:
        return self.plan.ranges[list(self.daemons).index(name)]

    def choose(self) -> tuple[str | None, int]:
        """A daemon to fault now (and its open sessions): not the entry, serving, with another server of
        its range serving too, and the entry seeing every server of that range; with `aim` "busy", one
        with sessions open where there is one."""
        with self.lock:
            calm = [n for n, d in self.daemons.items() if n not in self.pending and d.proc.poll() is None]
        statuses = {n: answer(self.daemons[n]) for n in calm}
        up = {n for n, st in statuses.items() if st is not None and st["state"] == "serving"}
        entry = next(iter(self.daemons))
        seen = (statuses.get(entry) or {}).get("coverage") or []
        want = whole_coverage(self.plan)

        def may_go(n: str) -> bool:
            a, b = self.range_of(n)
            others = [o for o in up if o != n and self.range_of(o) == (a, b)]
            return n != entry and n in up and bool(others) and seen[a:b] == want[a:b]

        names = [n for n in self.daemons if may_go(n)]
        busy = [n for n in names if statuses[n]["sessions"] > 0]
        if self.plan.aim == "busy" and busy:
            names = busy
        name = self.rng.choice(names) if names else None
        return name, statuses[name]["sessions"] if name else 0

    def strike(self, name: str, kind: str, sessions: int) -> None:
        d = self.daemons[name]
        fault = Fault(kind, name, round(time.monotonic() - self.t0, 2), sessions)
        self.faults.append(fault)
        self.say(f"[{fault.at:7.1f} s] {kind} {name} ({'%d:%d' % self.range_of(name)}, {sessions} sessions)")
        {"kill": d.proc.kill, "stop": lambda: d.proc.send_signal(signal.SIGSTOP),
         "term": lambda: d.proc.send_signal(signal.SIGTERM)}[kind]()
        back = threading.Thread(target=self.bring_back, args=(d, fault), daemon=True)
        with self.lock:
            self.pending[name] = back
        back.start()

    def bring_back(self, d: DaemonProc, fault: Fault) -> None:
        """SIGCONT after `frozen_s`; a restart `down_s` after a kill, or once a SIGTERMed daemon has left
        (killed if still up after LEAVE_S); then the time the restarted daemon takes to serve."""
        struck = time.monotonic()
        if fault.kind == "term":
            while d.proc.poll() is None and time.monotonic() - struck < LEAVE_S and not self.ending.is_set():
                time.sleep(0.05)
            if d.proc.poll() is None:
                d.kill()
                fault.note = "still up after SIGTERM: killed"
            fault.left_s = round(time.monotonic() - struck, 2)
        else:
            self.ending.wait(self.plan.frozen_s if fault.kind == "stop" else self.plan.down_s)
        with self.lock:
            if fault.kind == "stop":
                d.proc.send_signal(signal.SIGCONT)
            elif not self.ending.is_set():  # the same daemon again: name, state directory, port, arguments
                d.log.close()
                nice = self.plan.restart_nice
                self.daemons[d.name] = self.mesh.start(d.name, self.args[d.name], listen=self.listen[d.name],
                                                       preexec_fn=(lambda: os.nice(nice)) if nice else None)
            fault.back_at = round(time.monotonic() - self.t0, 2)
            del self.pending[d.name]
            fresh = self.daemons[d.name] if fault.kind != "stop" and not self.ending.is_set() else None
        while fresh is not None and fresh.proc.poll() is None and not self.ending.is_set() \
                and time.monotonic() - struck < self.plan.heal_s:
            st = answer(fresh)
            if st is not None and st["state"] == "serving":
                fault.serving_at = round(time.monotonic() - self.t0, 2)
                unnice(fresh.proc.pid)
                return
            self.ending.wait(1.0)

    def settle(self, timeout: float) -> None:
        """Wait, at most `timeout`, for every faulted daemon to be brought back."""
        deadline = time.monotonic() + timeout
        for back in list(self.pending.values()):
            back.join(max(0.0, deadline - time.monotonic()))

    def cancel(self) -> None:
        """No more restarts; every daemon stopped is continued (a stopped one would not act on SIGTERM)."""
        self.ending.set()
        for back in list(self.pending.values()):
            back.join(5)
        with self.lock:
            for d in self.daemons.values():
                if d.proc.poll() is None:
                    d.proc.send_signal(signal.SIGCONT)


def answer(d: DaemonProc, timeout: float = 5.0) -> dict | None:
    """`d`'s status, or None when it has no socket yet or does not answer within `timeout` (frozen, or
    starved on a loaded box): such a daemon is not serving for the chaos loop."""
    if not d.socket.exists():
        return None
    try:
        return d.status(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def unnice(pid: int) -> None:
    """Every thread of process `pid` back to nice 0 (on Linux a nice value is a thread's)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except OSError:  # it exited meanwhile (or a thread did)
        pass


def start_mesh(plan: SoakPlan, mesh: Mesh) -> tuple[dict[str, DaemonProc], dict[str, list[str]], dict[str, str]]:
    """The daemons, each on a port of its own that it keeps across restarts (as a service's unit does);
    returns once every one serves and sees every layer served as often as the plan says."""
    names = [f"d{i}" for i in range(len(plan.ranges))]
    listen = {n: f"/ip4/127.0.0.1/tcp/{free_port()}" for n in names}
    args = {n: ["--layers", f"{a}:{b}", "--threads", "1"] for n, (a, b) in zip(names, plan.ranges)}
    daemons = {names[0]: mesh.start(names[0], args[names[0]], listen=listen[names[0]])}
    boot = daemons[names[0]].wait_serving()["addrs"][0]
    for n in names[1:]:
        args[n] += ["--bootstrap", boot]
        daemons[n] = mesh.start(n, args[n], listen=listen[n])
    wait_whole(plan, daemons, timeout=300)
    return daemons, args, listen


def whole_coverage(plan: SoakPlan) -> list[int]:
    n = max(b for _, b in plan.ranges)
    return [sum(a <= layer < b for a, b in plan.ranges) for layer in range(n)]


def wait_whole(plan: SoakPlan, daemons: dict[str, DaemonProc], timeout: float) -> float:
    """Seconds until every daemon serves and sees every layer served as often as planned."""
    t0, want = time.monotonic(), whole_coverage(plan)
    for d in list(daemons.values()):
        d.wait_for(lambda s: s["state"] == "serving" and s["coverage"] == want,
                   timeout=max(1.0, timeout - (time.monotonic() - t0)), what=f"serving, coverage {want[0]}x")
    return time.monotonic() - t0


def run_phase(plan: SoakPlan, entry: DaemonProc, phase: str, t0: float, seconds: float, chaos: Chaos | None,
              done=lambda outcomes: True) -> list[Outcome]:
    """Clients generating for `seconds` (and until `done(outcomes)`, at most thrice as long), the chaos
    loop ticking meanwhile."""
    clients = Clients(plan, entry, phase, t0)
    try:
        start = time.monotonic()
        while time.monotonic() - start < seconds or (not done(clients.outcomes)
                                                      and time.monotonic() - start < 3 * seconds):
            if chaos is not None:
                chaos.tick()
            time.sleep(0.2)
    finally:
        outcomes = clients.stop(timeout=plan.generation_s)
    return outcomes


def run_soak(plan: SoakPlan = SoakPlan(), say=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """The soak: a calm phase, then the chaos phase, then the wait for a whole mesh; its report (see
    `report`). Raises only when the mesh cannot be started."""
    mesh = Mesh(env={"MESHD_RECORD_TTL": str(plan.record_ttl)})
    chaos = None
    try:
        daemons, args, listen = start_mesh(plan, mesh)
        entry, t0 = daemons["d0"], time.monotonic()
        say(f"mesh of {len(daemons)} up; calm phase, {plan.clients} clients, at least {plan.calm_s:.0f} s")
        calm = run_phase(plan, entry, "calm", t0, plan.calm_s, None,
                         done=lambda outs: {o.prompt for o in outs if o.code == 0} >= set(PROMPTS))
        chaos = Chaos(plan, mesh, daemons, args, listen, t0, say)
        say(f"chaos phase, {plan.chaos_s:.0f} s, a fault every ~{plan.period_s:.0f} s (seed {plan.seed})")
        stormy = run_phase(plan, entry, "chaos", t0, plan.chaos_s, chaos)
        chaos.settle(timeout=LEAVE_S + plan.down_s + 10)
        try:
            heal_s, healed = wait_whole(plan, daemons, plan.heal_s), ""
        except (AssertionError, subprocess.TimeoutExpired) as exc:  # not whole in time, or a status unanswered
            heal_s, healed = None, str(exc)[-2000:]
        ends = {n: answer(d) or {} for n, d in daemons.items()}
        return report(plan, calm, stormy, chaos.faults, chaos.deferred, heal_s, healed, ends, entry_events(entry))
    finally:
        if chaos is not None:
            chaos.cancel()
        mesh.close()
