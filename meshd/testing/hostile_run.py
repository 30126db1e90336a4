"""One attack against a real daemon, measured: the victim's RSS before, at its peak and after the
attacker left, the heartbeat echo during the attack, and an honest generation's text and time
during the attack and just after it. Shared by `tests/test_hostile.py` and `bench/hostile_bench.py`.

Rule: the attack, the echo probe and the honest generation run at once (one trio program; the
honest client is a real `meshctl` process), and everything has a deadline.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

import trio

from meshd.testing.hostile import HostilePeer, RssSampler, open_hostile, rss_bytes, settle_rss

HONEST_TOKENS = 16
HONEST_PROMPT = "The capital of France is"
SETTLE_S = 30.0


@dataclass
class Honest:
    ok: bool
    seconds: float
    text: str
    stderr: str = ""


@dataclass
class AttackReport:
    name: str
    rss_before: int
    rss_peak: int
    rss_after: int
    echo_max_s: float
    during: Honest
    after: Honest
    answers: object = None  # what the attack returned (counts of replies, by kind)
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        mb = 1 << 20
        return {"attack": self.name, "rss_before_mb": round(self.rss_before / mb, 1),
                "rss_peak_mb": round(self.rss_peak / mb, 1), "rss_after_mb": round(self.rss_after / mb, 1),
                "echo_max_s": round(self.echo_max_s, 3), "honest_during_s": round(self.during.seconds, 2),
                "honest_during_ok": self.during.ok, "honest_after_s": round(self.after.seconds, 2),
                "honest_after_ok": self.after.ok, "answers": self.answers,
                **({"honest_stderr": (self.during.stderr + self.after.stderr)[-400:]}
                   if not (self.during.ok and self.after.ok) else {})}

    def as_dict(self) -> dict:
        return asdict(self)


def honest_generation(socket, reference: str | None, timeout: float = 120.0) -> Honest:
    """A greedy generation through `socket`'s daemon; ok when its text is `reference` (any text
    when None)."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(socket), "generate",
                          "--max-tokens", str(HONEST_TOKENS), "--ignore-eos", HONEST_PROMPT],
                         capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    ok = out.returncode == 0 and (reference is None or out.stdout == reference)
    return Honest(ok, seconds, out.stdout, out.stderr[-2000:])


def summarize(replies) -> dict:
    """Replies by kind: `Error` frames by code, other messages by type, exceptions by name."""
    counts: dict[str, int] = {}
    for r in replies if isinstance(replies, list) else []:
        name = getattr(r, "code", None) or type(r).__name__
        counts[str(name)] = counts.get(str(name), 0) + 1
    return counts if counts else replies


def run_attack(name: str, victim_pid: int, victim_addr: str, entry_socket, reference: str,
               attack: Callable[[HostilePeer], Awaitable[object]], echo_s: float = 4.0,
               settle_to: float = 1.10, hold_s: float = 0.0) -> AttackReport:
    """Run `attack` from a hostile peer against the victim while an honest generation goes through
    the entry and a bystander (another peer) pings the victim; `hold_s` keeps the attacker
    connected (its streams open) that long after the attack returned."""
    before = rss_bytes(victim_pid)
    result: dict = {}

    async def main() -> None:
        # the echo is timed by a bystander on its own connection, as an entry pings a hop: on the
        # attacker's connection it would wait behind the attacker's own bytes
        async with open_hostile(victim_addr) as bystander, open_hostile(victim_addr) as peer:
            async with trio.open_nursery() as nursery:
                async def echo():
                    result["echo"] = await bystander.echo_times(echo_s)

                async def honest():
                    await trio.sleep(0.2)  # the attack has begun
                    result["during"] = await trio.to_thread.run_sync(honest_generation, entry_socket, reference)

                nursery.start_soon(echo)
                nursery.start_soon(honest)
                with trio.fail_after(120):
                    result["answers"] = summarize(await attack(peer))
            await trio.sleep(hold_s)

    with RssSampler(victim_pid) as sampler:
        trio.run(main)
        after_honest = honest_generation(entry_socket, reference)
    after = settle_rss(victim_pid, int(before * settle_to), SETTLE_S)
    echo = result.get("echo") or [float("inf")]
    return AttackReport(name, before, sampler.peak, after, max(echo), result["during"], after_honest,
                        result.get("answers"))
