"""Staggered dialling ("happy eyeballs"): start the first way to a peer, then the next each time one
fails or `stagger` seconds pass without an answer; the first to succeed wins and the others are
cancelled. A way that hangs (a dead relay whose connection is still listed, a private address that
drops packets) then costs `stagger`, not its own timeout.
"""

from __future__ import annotations

import trio


async def race(attempts, stagger: float, attempt_timeout: float):
    """`attempts`: (label, async fn) pairs, best first. Returns the winner's label and result;
    raises ConnectionError naming every failure when none succeeds."""
    won: list = []
    failures: list[str] = []
    async with trio.open_nursery() as nursery:
        for label, fn in attempts:
            failed = trio.Event()

            async def one(label=label, fn=fn, failed=failed) -> None:
                try:
                    with trio.fail_after(attempt_timeout):
                        result = await fn()
                except Exception as exc:
                    failures.append(f"{label}: {type(exc).__name__}: {exc}")
                    failed.set()
                    return
                if not won:
                    won.append((label, result))
                    nursery.cancel_scope.cancel()

            nursery.start_soon(one)
            with trio.move_on_after(stagger):
                await failed.wait()
    if not won:
        raise ConnectionError("; ".join(failures) or "nothing to try")
    return won[0]
