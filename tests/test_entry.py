"""The entry's per-route state (`Attempt`), over in-memory channels and trio's MockClock: which hop is
blamed for a stall, and that generations never share it."""

import pytest
import trio

from meshd.gen import Attempt, HopFailed, Progress
from meshd.wire import Error, ErrorCode, Forward, Phase, Token

SID = b"s" * 16


class FakeHop:
    """A hop's channel: what the entry sends is recorded; what the hop answers is fed by the test."""

    def __init__(self) -> None:
        self.sent = []
        self.answers_in, self.answers = trio.open_memory_channel(10)

    async def send(self, msg) -> None:
        self.sent.append(msg)

    async def receive(self, timeout: float):
        with trio.fail_after(timeout):
            return await self.answers.receive()


def forward(step: int = 1) -> Forward:
    return Forward(session_id=SID, epoch=0, step=step, phase=Phase.DECODE, position=5)


async def test_the_hop_holding_an_unanswered_frame_is_blamed(autojump_clock):
    at, other = Attempt(None, Progress(), SID, 0), Attempt(None, Progress(), b"t" * 16, 0)
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
        assert other.pending == {"C": 0} and other.progress.wait_s == 0  # nothing leaked into another generation
        nursery.cancel_scope.cancel()


async def test_an_error_frame_fails_its_hop_at_once(autojump_clock):
    at = Attempt(None, Progress(), SID, 0)
    a = FakeHop()
    at.add_hop("A", a)
    await a.answers_in.send(Error(code=ErrorCode.UNKNOWN_SESSION, message="evicted"))
    with pytest.raises(HopFailed, match="unknown_session"):
        await at.pump("A", a, None)
