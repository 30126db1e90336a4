"""Links to next hops: a pass's outputs leave as one ForwardBatch on one shared stream, the next hop
submits them at once and runs them in one pass, and every session still gets its solo tokens."""

import numpy as np
import trio
import trio.testing

from meshd.hop.links import NextHop, NextHops
from meshd.p2p.channel import Channel
from meshd.hop.service import ShardService
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
from meshd.hop.scheduler import Scheduler
from meshd.wire import (MAX_BATCH_FRAMES, Decoder, Error, ErrorCode, Forward, ForwardBatch, OpenSession, Opened,
                        Phase, Tensor, Token)
from tests.test_service import artifact, compute  # noqa: F401 (fixtures: a tiny Q4_0 llama, a compute thread)

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 201], [9], [40, 41, 42]]
STEPS = 4


def frame(k: int, step: int = 0) -> Forward:
    t = Tensor.from_numpy("hidden", np.full((1, 1, 4), k, dtype=np.float32))
    return Forward(session_id=bytes([k]) * 16, epoch=0, step=step, phase=Phase.DECODE, position=step, tensors=(t,))


class Pipe:
    """A libp2p-like stream over a trio stream (what `serve_stream` reads)."""

    def __init__(self, stream) -> None:
        self.read, self.write, self.close = stream.receive_some, stream.send_all, stream.aclose


def channel_pair() -> tuple[Channel, Channel]:
    a, b = trio.testing.memory_stream_pair()
    return Channel.over_trio(a), Channel.over_trio(b)


def test_a_flush_sends_what_waits_as_one_frame_in_order_and_splits_big_ones():
    async def main():
        a, b = channel_pair()
        hop = NextHop("peer", a)
        frames = [frame(k) for k in range(MAX_BATCH_FRAMES + 3)]
        for f in frames:
            hop.put(f)
        assert await hop.flush() == []
        first, second = await b.receive(1), await b.receive(1)
        assert isinstance(first, ForwardBatch) and isinstance(second, ForwardBatch)
        assert first.frames() + second.frames() == frames
        assert (hop.sent_frames, hop.sent_outputs) == (2, len(frames))

    trio.run(main)


def test_a_broken_link_hands_back_its_frames():
    async def main():
        a, b = channel_pair()
        await b.aclose()
        hop = NextHop("peer", a)
        hop.put(frame(1))
        hop.put(frame(2))
        assert [f.session_id for f in await hop.flush()] == [bytes([1]) * 16, bytes([2]) * 16]
        assert hop.broken
        hop.put(frame(3))
        assert len(await hop.flush()) == 1

    trio.run(main)


def test_sessions_share_one_link_per_peer_until_the_last_lets_go():
    async def main():
        dialled = []

        async def dial(peer, addrs):
            a, b = channel_pair()
            dialled.append((peer, b))
            return a

        hops = NextHops(dial)
        x, y = await hops.acquire("p", []), await hops.acquire("p", [])
        z = await hops.acquire("q", [])
        assert x is y and x is not z and len(dialled) == 2
        await hops.release(x)
        assert len(hops) == 2
        await hops.release(y)
        assert len(hops) == 1
        x.broken = "gone"
        assert (await hops.acquire("p", [])) is not x and len(dialled) == 3

    trio.run(main)


def service_for(artifact, compute, start, end):
    shard = Shard(artifact, start, end, NATIVE, kv_budget_bytes=1 << 26)
    return ShardService(ShardEndpoint(shard, "m", "r"), compute, Scheduler())


def open_msg(sid: bytes, start: int, end: int, next_peer: str = "") -> OpenSession:
    return OpenSession(request_id=1, session_id=sid, epoch=0, start=start, end=end, model_fingerprint="m",
                       recipe_fingerprint="r", max_length=64, next_peer=next_peer)


async def solo_tokens(service, sid, prompt) -> list[int]:
    await service.handle(open_msg(sid, 0, 6))
    (tok,) = await service.handle(token_frame(sid, 0, 0, Phase.PREFILL, 0, prompt))
    tokens = [tok.token_id]
    for i in range(STEPS):
        (tok,) = await service.handle(token_frame(sid, 0, i + 1, Phase.DECODE, len(prompt) + i, [tokens[-1]]))
        tokens.append(tok.token_id)
    return tokens


def test_a_pass_reaches_the_next_hop_as_one_batch_and_runs_there_as_one_pass(artifact, compute):
    """Head 0:3 forwards to tail 3:6 over one link; every step of all sessions is one pass on each
    side, one frame on the link, and each session's tokens are its solo tokens."""
    n = len(PROMPTS)
    sids = [bytes([k + 1]) * 16 for k in range(n)]

    async def main():
        full = service_for(artifact, compute, 0, 6)
        solo = [await solo_tokens(full, sid, p) for sid, p in zip(sids, PROMPTS)]
        head, tail = service_for(artifact, compute, 0, 3), service_for(artifact, compute, 3, 6)
        async with trio.open_nursery() as nursery:
            async def dial(peer, addrs):  # the head's link to the tail, served like a libp2p stream
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon(tail.serve_stream, Pipe(b))
                return Channel.over_trio(a)

            head.outputs.dial = dial
            entry_side, tail_side = trio.testing.memory_stream_pair()  # the entry's stream to the tail
            nursery.start_soon(tail.serve_stream, Pipe(tail_side))
            to_tail = Channel.over_trio(entry_side)
            home, _ = channel_pair()
            for sid in sids:
                await to_tail.send(open_msg(sid, 3, 6))
                assert isinstance(await to_tail.receive(5), Opened)
                (opened,) = await head.open_linked(open_msg(sid, 0, 3, next_peer="tail"), home)
                assert opened.forwarding
            assert len(head.outputs.next_hops) == 1
            tokens: dict[bytes, list[int]] = {sid: [] for sid in sids}

            async def step(frames):  # all sessions' frames join the head's scheduler, then one pass
                works = [head.submit(f) for f in frames]
                async with trio.open_nursery() as inner:
                    for w in works:
                        inner.start_soon(head.finish, w)
                for _ in frames:
                    tok = await to_tail.receive(5)
                    assert isinstance(tok, Token), tok
                    tokens[tok.session_id].append(tok.token_id)

            await step([token_frame(sid, 0, 0, Phase.PREFILL, 0, p) for sid, p in zip(sids, PROMPTS)])
            for i in range(STEPS):
                await step([token_frame(sid, 0, i + 1, Phase.DECODE, len(p) + i, [tokens[sid][-1]])
                            for sid, p in zip(sids, PROMPTS)])
            nursery.cancel_scope.cancel()
        assert [tokens[sid] for sid in sids] == solo
        link = next(iter(head.outputs.next_hops._links.values()))
        assert (link.sent_frames, link.sent_outputs) == (STEPS + 1, n * (STEPS + 1))
        assert head.scheduler.stats.passes == tail.scheduler.stats.passes == STEPS + 1
        assert tail.scheduler.stats.largest == n

    trio.run(main)


def test_a_session_whose_link_broke_is_told_and_forwards_no_more(artifact, compute):
    async def main():
        head = service_for(artifact, compute, 0, 3)

        async def dial(peer, addrs):
            a, b = channel_pair()
            await b.aclose()
            return a

        head.outputs.dial = dial
        home, entry = channel_pair()
        sid = b"s" * 16
        await head.open_linked(open_msg(sid, 0, 3, next_peer="tail"), home)
        assert await head.handle(token_frame(sid, 0, 0, Phase.PREFILL, 0, [1, 2, 3])) == []
        err = await entry.receive(5)
        assert isinstance(err, Error) and err.code == ErrorCode.NEXT_HOP_FAILED
        assert head.endpoint.sessions.links((sid, 0)).next is None and len(head.outputs.next_hops) == 0

    trio.run(main)


def test_bad_frames_on_a_link_get_an_error_and_leave_the_service_up(artifact, compute):
    async def main():
        tail = service_for(artifact, compute, 3, 6)
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tail.serve_stream, Pipe(b))
            await a.send_all(b"\0\0\0\x10" + b"\xff" * 40)
            data = await a.receive_some(1 << 16)
            (reply,) = Decoder().feed(data)
            assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FRAME
            # a well-formed batch for sessions this hop does not hold: answered, not crashed
            a, b = trio.testing.memory_stream_pair()
            nursery.start_soon(tail.serve_stream, Pipe(b))
            link = Channel.over_trio(a)
            await link.send(ForwardBatch.of([frame(1), frame(2)]))
            replies = [await link.receive(5), await link.receive(5)]
            assert [r.code for r in replies] == [ErrorCode.UNKNOWN_SESSION] * 2
            assert tail.scheduler.queued == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_batch_after_other_frames_on_one_stream_is_answered(artifact, compute):
    """A stream that opened a session (its frames answered one by one) and then sends a
    ForwardBatch still gets every reply, in order, and the stream stays served."""
    async def main():
        tail = service_for(artifact, compute, 3, 6)
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tail.serve_stream, Pipe(b))
            ch = Channel.over_trio(a)
            sid = b"o" * 16
            await ch.send(open_msg(sid, 3, 6))
            assert isinstance(await ch.receive(5), Opened)
            await ch.send(ForwardBatch.of([frame(1), frame(2)]))
            replies = [await ch.receive(5), await ch.receive(5)]
            assert [r.code for r in replies] == [ErrorCode.UNKNOWN_SESSION] * 2
            await ch.send(open_msg(b"p" * 16, 3, 6))  # the stream is still served
            assert isinstance(await ch.receive(5), Opened)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_pass_waits_briefly_for_frames_said_to_be_on_their_way(artifact, compute):
    """The entry's tokens come back one stream at a time: a pass waits (at most DUE_WAIT_S) for
    the sessions `expect`ed, and not again for one that never came."""
    from meshd.hop.due import DUE_WAIT_S

    sids = [bytes([k + 1]) * 16 for k in range(3)]

    async def main():
        service = service_for(artifact, compute, 0, 6)
        for sid in sids:
            await service.handle(open_msg(sid, 0, 6))
        service.expect((sids[1], 0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.handle, token_frame(sids[0], 0, 0, Phase.PREFILL, 0, [1, 2]))
            await trio.sleep(DUE_WAIT_S / 3)
            nursery.start_soon(service.handle, token_frame(sids[1], 0, 0, Phase.PREFILL, 0, [3]))
        assert service.scheduler.stats.passes == 1 and service.scheduler.stats.largest == 2
        assert trio.current_time() < DUE_WAIT_S
        service.expect((sids[2], 0))
        t0 = trio.current_time()
        await service.handle(token_frame(sids[0], 0, 1, Phase.DECODE, 2, [5]))  # sids[2] never comes
        assert DUE_WAIT_S <= trio.current_time() - t0 and not service.due
        t0 = trio.current_time()
        await service.handle(token_frame(sids[0], 0, 2, Phase.DECODE, 3, [5]))
        assert trio.current_time() - t0 < DUE_WAIT_S

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_pass_waits_for_every_token_of_a_tail_pass_to_come_back(artifact, compute):
    """The tail says how many tokens of its pass go to this entry: the entry's next pass waits for
    the steps all of them bring, though they come back one by one (within DUE_WAIT_S)."""
    from meshd.hop.due import DUE_WAIT_S

    sids = [bytes([k + 1]) * 16 for k in range(3)]
    gap = DUE_WAIT_S / 8

    async def main():
        service = service_for(artifact, compute, 0, 6)
        for sid in sids:
            await service.handle(open_msg(sid, 0, 6))

        async def token_comes_back(k):  # what the entry's pump and generation do, a gap apart
            await trio.sleep(2 * k * gap)
            service.expect((sids[k], 0), ("tail", 7), len(sids))
            await trio.sleep(gap)
            await service.handle(token_frame(sids[k], 0, 0, Phase.PREFILL, 0, [k + 1]))

        async with trio.open_nursery() as nursery:
            for k in range(len(sids)):
                nursery.start_soon(token_comes_back, k)
        assert service.scheduler.stats.passes == 1 and service.scheduler.stats.largest == 3
        assert 4 * gap < trio.current_time() < DUE_WAIT_S
        # this shard is the whole model and its callers the entry itself: the pass's three tokens
        # bring three next steps at once, so the next pass waits for those (hop/passes.local_tokens)
        assert service.due.keys == {(sid, 0) for sid in sids}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
