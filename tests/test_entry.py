"""The entry's per-route state (`Attempt`), over in-memory channels and trio's MockClock: which hop is
blamed for a stall, and that generations never share it."""

import pytest
import trio

from meshd.entry.attempt import SILENT_S, Attempt, LinkErrors
from meshd.entry.errors import HopFailed
from meshd.entry.microbatch import Microbatches
from meshd.entry.state import Generation
from meshd.testing.fakes import FakeHop
from meshd.wire import Error, ErrorCode, Forward, Heartbeat, Phase, Token

SID = b"s" * 16


def forward(step: int = 1) -> Forward:
    return Forward(session_id=SID, epoch=0, step=step, phase=Phase.DECODE, position=5)


async def test_the_hop_holding_an_unanswered_frame_is_blamed(autojump_clock):
    at, other = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0), Attempt(None, Generation(ids=[1], max_tokens=8), b"t" * 16, 0)
    a, b = FakeHop(), FakeHop()
    at.add_hop("A", a)
    at.add_hop("B", b)
    other.add_hop("C", FakeHop())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(at.pump, "A", a, ("B", b))
        nursery.start_soon(at.pump, "B", b, None)
        await at.send("A", a, forward())
        await a.answers_in.send(forward())  # A answers: its output goes on to B, which now holds it
        await trio.sleep(0.1)
        assert at.pending == {"A": 0, "B": 1} and b.sent == [forward()]
        with pytest.raises(HopFailed) as failed:
            await at.next_token(2.0)
        assert failed.value.peer_id == "B"  # the stall is at B, not at A
        await b.answers_in.send(Token(session_id=SID, epoch=0, step=1, token_id=42))
        assert await at.next_token(2.0) == 42 and at.pending == {"A": 0, "B": 0}
        assert other.pending == {"C": 0} and other.generation.wait_s == 0  # nothing leaked into another generation
        nursery.cancel_scope.cancel()


async def test_an_error_frame_fails_its_hop_at_once(autojump_clock):
    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    a = FakeHop()
    at.add_hop("A", a)
    await a.answers_in.send(Error(code=ErrorCode.UNKNOWN_SESSION, message="evicted"))
    with pytest.raises(HopFailed, match="unknown_session"):
        await at.pump("A", a, None)


async def one_hop_step(hop: FakeHop, answer_after: float | None):
    """Send one frame to a single hop; it answers after `answer_after` seconds (never if None).
    Returns the token or the HopFailed, and the (mock) seconds it took."""
    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    at.add_hop("H", hop)
    result = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(at.pump, "H", hop, None)
        nursery.start_soon(at.keepalive)
        if answer_after is not None:
            async def answer():
                await trio.sleep(answer_after)
                await hop.answers_in.send(Token(session_id=SID, epoch=0, step=1, token_id=7))
            nursery.start_soon(answer)
        await at.send("H", hop, forward())
        t0 = trio.current_time()
        try:
            result = await at.next_token(60.0)
        except HopFailed as exc:
            result = exc
        nursery.cancel_scope.cancel()
    return result, trio.current_time() - t0


async def test_a_busy_hop_that_answers_pings_is_given_time(autojump_clock):
    result, took = await one_hop_step(FakeHop(echo=True), answer_after=8.0)
    assert result == 7 and took >= 8.0  # eight times the silence limit, and not failed


async def test_a_frozen_hop_is_failed_after_a_second_of_silence(autojump_clock):
    result, took = await one_hop_step(FakeHop(echo=False), answer_after=None)
    assert isinstance(result, HopFailed) and result.peer_id == "H" and "silent" in str(result)
    assert SILENT_S <= took <= SILENT_S + 0.5


async def test_forwarding_hops_hold_a_frame_until_the_tail_answers(autojump_clock):
    """A forwards to B itself: the entry sends to A, the token comes from B; a broken A->B link blames B."""
    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    a, b = FakeHop(echo=True), FakeHop(echo=True)
    at.add_hop("A", a, forwards=True)
    at.add_hop("B", b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(at.pump, "A", a, ("B", b))
        nursery.start_soon(at.pump, "B", b, None)
        await at.send("A", a, forward())
        assert at.pending == {"A": 1, "B": 1} and b.sent == []  # nothing relayed by the entry
        await b.answers_in.send(Token(session_id=SID, epoch=0, step=1, token_id=9))
        assert await at.next_token(5.0) == 9 and at.pending == {"A": 0, "B": 0}
        nursery.cancel_scope.cancel()

    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 1)
    at.add_hop("A", a, forwards=True)
    at.add_hop("B", b)
    await a.answers_in.send(Error(code=ErrorCode.NEXT_HOP_FAILED, message="reset", session_id=SID))
    with pytest.raises(HopFailed) as failed:
        await at.pump("A", a, ("B", b))
    assert failed.value.peer_id == "B" and failed.value.retriable


async def test_outputs_sent_on_the_link_are_held_by_the_segment_and_a_broken_link_fails_the_first_hop(
        autojump_clock):
    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    a, b = FakeHop(echo=True), FakeHop(echo=True)
    at.add_hop("A", a, forwards=True)
    at.add_hop("B", b)
    at.sent_on_link()  # the service sent the entry's output to A with those of other sessions
    assert at.pending == {"A": 1, "B": 1} and a.sent == []
    await LinkErrors(at.tokens_send).send(Error(code=ErrorCode.NEXT_HOP_FAILED, message="reset", session_id=SID))
    with pytest.raises(HopFailed) as failed:
        await at.next_token(5.0)
    assert failed.value.peer_id == "A" and failed.value.retriable


async def test_a_busy_error_is_not_a_failure(autojump_clock):
    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    a = FakeHop()
    at.add_hop("A", a)
    await a.answers_in.send(Error(code=ErrorCode.BUSY, message="queue full", retriable=True, retry_after_s=0.3))
    with pytest.raises(HopFailed) as failed:
        await at.pump("A", a, None)
    assert failed.value.busy_s == 0.3 and "busy" in str(failed.value)


async def test_keepalive_pings_only_hops_not_heard_from_lately(autojump_clock):
    """A hop whose answer arrived within the heartbeat period is alive: no ping for it (at many
    sessions pings were as many frames as the tokens); a quiet hop is still pinged every period."""
    from meshd.entry.attempt import HEARTBEAT_S

    class CountingHop(FakeHop):
        def __init__(self) -> None:
            super().__init__(echo=False)
            self.pings = 0

        async def send(self, msg) -> None:
            self.pings += isinstance(msg, Heartbeat)
            await super().send(msg)

    at = Attempt(None, Generation(ids=[1], max_tokens=8), SID, 0)
    a, b = CountingHop(), CountingHop()
    at.add_hop("A", a, forwards=True)
    at.add_hop("B", b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(at.pump, "B", b, None)
        nursery.start_soon(at.keepalive)

        async def tail_answers():  # B answers a token every tenth of a period: it completes A's frame too
            for step in range(40):
                await at.send("A", a, forward(step))
                await b.answers_in.send(Token(session_id=SID, epoch=0, step=step, token_id=1))
                assert await at.next_token(1.0) == 1
                await trio.sleep(HEARTBEAT_S / 10)
        await tail_answers()
        assert a.pings <= 1 and b.pings <= 1  # at most the first round, before any answer
        before = a.pings, b.pings
        await trio.sleep(4 * HEARTBEAT_S + 0.01)  # quiet: both are pinged every period again
        assert a.pings - before[0] >= 3 and b.pings - before[1] >= 3
        nursery.cancel_scope.cancel()


def test_new_generations_take_the_least_used_microbatch():
    microbatches = Microbatches()
    assert [microbatches.take(3) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    microbatches.give(1)
    microbatches.give(1)
    assert microbatches.take(3) == 1  # emptied: the next one goes there
    assert microbatches.take(2) == 1  # a shorter route spreads over its own number of microbatches
    assert microbatches.take(0) == 0  # no daemon count: one microbatch
    assert microbatches.counts() == [4, 2, 2]
    microbatches.give(1)
    microbatches.give(1)
    assert microbatches.counts() == [4, 0, 2]  # an emptied one in the middle shows as 0
    for microbatch, n in list(microbatches.used.items()):
        for _ in range(n):
            microbatches.give(microbatch)
    assert microbatches.used == {}


@pytest.mark.parametrize("ids, requested, switch, taken", [
    (list(range(10)), 20, 0, 1),  # ends by its count
    (list(range(10)), 20, 0, 7),
    (list(range(40)), 100, 64, 1),  # a short table: the steps stop where the sequence passes the switch
    (list(range(40)), 100, 64, 20),
    (list(range(40)), 10, 64, 3),  # the count comes first
    (list(range(70)), 100, 64, 2),  # long from the start: no switch left
])
def test_plain_steps_left_end_where_the_generation_must_stop_or_switch(ids, requested, switch, taken):
    """A decode run of `plain_steps_left` steps ends exactly where the entry's loop stops stepping:
    after its last token the generation is done or past the switch, and before it neither."""
    gen = Generation.start(ids, requested, 256, switch=switch)
    gen.take_table()
    for t in range(taken):
        gen.accept(t)
    steps = gen.plain_steps_left()
    assert steps > 0
    for t in range(steps):
        assert not gen.done and not gen.past_switch  # this token is fed to the next step
        gen.accept(100 + t)
    assert gen.done or gen.past_switch
