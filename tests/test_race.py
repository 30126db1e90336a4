"""Staggered dialling as pure logic: fake attempts on trio's MockClock."""

import pytest
import trio
import trio.testing

from meshd.p2p.race import race


def attempt(log, label, seconds, ok=True):
    async def fn():
        log.append(("start", label, trio.current_time()))
        await trio.sleep(seconds)
        if not ok:
            raise OSError(f"{label} refused")
        log.append(("done", label, trio.current_time()))
        return label.upper()
    return label, fn


async def test_a_hanging_first_way_costs_the_stagger_not_its_timeout(autojump_clock):
    log = []
    t0 = trio.current_time()
    got = await race([attempt(log, "dead relay", 1000), attempt(log, "live relay", 0.2)], stagger=1.0,
                     attempt_timeout=5.0)
    assert got == ("live relay", "LIVE RELAY")
    assert trio.current_time() - t0 == pytest.approx(1.2)
    assert [e[:2] for e in log] == [("start", "dead relay"), ("start", "live relay"), ("done", "live relay")]


async def test_a_failure_starts_the_next_at_once_and_the_first_success_wins(autojump_clock):
    log = []
    t0 = trio.current_time()
    got = await race([attempt(log, "direct", 0.1, ok=False), attempt(log, "a", 0.5), attempt(log, "b", 0.1)],
                     stagger=1.0, attempt_timeout=5.0)
    assert got[0] == "a" and trio.current_time() - t0 == pytest.approx(0.6)
    assert ("start", "b") not in [e[:2] for e in log]  # a answered before b was due


async def test_every_failure_is_named_and_timeouts_count_as_failures(autojump_clock):
    with pytest.raises(ConnectionError, match=r"x: OSError: x refused; y: TooSlowError"):
        await race([attempt([], "x", 0.1, ok=False), attempt([], "y", 100)], stagger=1.0, attempt_timeout=3.0)
    with pytest.raises(ConnectionError, match="nothing to try"):
        await race([], stagger=1.0, attempt_timeout=1.0)
