"""Serving a shard over streams: one long-lived stream per session hop, frames in, frames out.

Rules: tensor work runs on the daemon's compute executor, one job at a time, so the event loop keeps
reading every stream; the Forward frames of all sessions waiting at once share one forward pass. A
session's hidden states go straight to the next hop when the entry names one this daemon can reach
(one transfer a hop a token), its tokens and errors to the stream it was opened on. The outputs of
one pass that go to the same next daemon leave as one `ForwardBatch` on a link shared by all those
sessions (`meshd/hop/links.py`), and a `ForwardBatch` that arrives is submitted whole at once, so
what one hop computed together the next computes together. A stream's
sessions are released when the stream ends, however it ends, so a vanished entry never leaves KV
behind; every failure goes back as an `Error` frame.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Awaitable, Callable

import structlog
import trio

from meshd.node.compute import ComputeExecutor
from meshd.wire.protocols import SHARD_PROTOCOL
from meshd.node.log import get_logger
from meshd.hop.links import Links, NextHop, NextHops
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.hop.endpoint import ShardEndpoint
from meshd.hop.scheduler import QueueFull, Scheduler, Work
from meshd.wire import (Cancel, Close, Error, ErrorCode, Forward, ForwardBatch, Heartbeat, Hello, Message,
                        OpenSession, Opened, Phase, Token, UnsupportedVersion, WireError)

IDLE_TIMEOUT = 300.0
DIAL_TIMEOUT = 10.0  # reaching the next hop of a session

DUE_WAIT_S = 0.008  # the longest a pass waits for frames said to be on their way (`expect`); a gap-based
# wait (5 ms between arrivals, 25 ms in all) made bigger passes but fewer tokens/s in bench/batch_bench.py
WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream
log = get_logger(__name__)


class ShardService:
    """A shard's work for all its sessions: Forward frames go through the batching scheduler, so the
    waiting work of every session (remote hops and the entry's own layers alike) shares one forward
    pass; other messages run on the compute thread in arrival order.

    There is no batching task: whoever waits for work while no pass runs runs the next pass (and
    every waiting piece has a waiter), so passes follow each other while work waits, and an idle
    shard does nothing at all."""

    def __init__(self, endpoint: ShardEndpoint, compute: ComputeExecutor, scheduler: Scheduler | None = None) -> None:
        self.endpoint = endpoint
        self.compute = compute
        self.scheduler = scheduler or Scheduler()
        self.compute_s = 0.0  # time spent in tensor work, for status and benchmarks
        self.steps = 0
        self.on_step = None  # called with each pass's compute seconds and its size (metrics)
        self.decode_layer_rate: float | None = None  # moving average of layer-steps/s on real decode steps
        self.pass_s: float | None = None  # moving average of a pass's seconds (the retry hint of a busy reply)
        self._stepping = False
        self._step_done = trio.Event()
        self.links: dict[tuple[bytes, int], Links] = {}  # where each session's outputs go
        self.forwarded = 0  # frames sent straight to a next hop
        self.retired = False  # no new sessions from other daemons: its daemon leaves, or moved to another range
        self.due: set[tuple[bytes, int]] = set()  # sessions whose next frame is on its way (`expect`)
        self._groups: dict[tuple, list] = {}  # (peer, pass id) -> [tokens not yet come, until when they are waited for]
        self._arrived = trio.Event()  # set by each submit while a pass waits for due frames
        self.gather_s = 0.0  # wait this long before a pass while other sessions' frames are due (--gather-ms)
        self.dial: Callable[[str, list[str]], Awaitable[Channel]] | None = None  # a stream to a peer (daemon)
        self.next_hops = NextHops(lambda peer, addrs: self.dial(peer, addrs))

    async def handle(self, msg: Message) -> list[Message]:
        """Answer one message: a Forward joins the next pass it can, the rest run in order."""
        if isinstance(msg, Forward):
            return await self._forward(msg)
        if isinstance(msg, (Close, Cancel)):
            self._cancel((msg.session_id, msg.epoch))
            await self._unlink((msg.session_id, msg.epoch))
        return await self.compute.run(self.endpoint.handle, msg)

    async def open_linked(self, msg: OpenSession, home: Channel) -> list[Message]:
        """Open a session whose tokens and errors go to `home`, and whose hidden states go straight
        to the next hop when the sender names one and this daemon can reach it (else back home).
        A retired service refuses as busy, so the entry picks another route at once."""
        if self.retired:
            self.endpoint.refused += 1
            return [Error(code=ErrorCode.BUSY, message="draining: this daemon is leaving the mesh", retriable=True,
                          request_id=msg.request_id, session_id=msg.session_id, retry_after_s=1.0)]
        replies = await self.handle(msg)
        if not replies or not isinstance(replies[0], Opened):
            return replies
        key = (msg.session_id, msg.epoch)
        await self._unlink(key)  # a reopened session starts afresh
        links = self.links[key] = Links(home)
        if msg.next_peer and self.dial is not None:
            try:
                with trio.fail_after(DIAL_TIMEOUT):
                    links.next = await self.next_hops.acquire(msg.next_peer, msg.next_addrs.split())
            except Exception as exc:  # unreachable from here (NAT, firewall): the sender relays instead
                log.info("next hop unreachable, outputs go back to the sender", peer=msg.next_peer[-8:],
                         error=f"{type(exc).__name__}: {exc}")
        return [replace(replies[0], forwarding=links.next is not None)]

    async def forward_outputs(self, key: tuple[bytes, int], peer: str, addrs, home) -> None:
        """Send session `key`'s outputs to `peer` over the link shared with the other sessions going
        there (the entry's own layers use this for its first hop); `home` hears of a broken link."""
        link = await self.next_hops.acquire(peer, list(addrs))
        await self._unlink(key)
        self.links[key] = Links(home, next=link)

    async def deliver(self, msg: Message, reply: Message, channel: Channel) -> None:
        """Send a reply to its session's home stream (tokens, errors, and hidden states when this hop
        does not forward: those for a next hop left with their pass, see `_queue_forwards`); replies
        for frames of no linked session go back on the stream they came from."""
        links = self.links.get((getattr(msg, "session_id", b""), getattr(msg, "epoch", -1)))
        if links is None:
            await channel.send(reply)
            return
        try:
            await links.home.send(reply)
        except ChannelClosed:
            if links.home is channel:
                raise
            # the entry is gone: its stream's end releases the session

    def _cancel(self, key: tuple[bytes, int]) -> None:
        """Drop a session's waiting work; its waiters get no output (they must not wait on)."""
        for work in self.scheduler.cancel(key):
            work.output, work.done = [], True

    async def _flush(self, hops) -> None:
        """Send what waits on these links; the sessions whose frames a broken link lost are told
        (their entries reroute) and forward no more over it. Not cancelled half-way: the frames
        queued there are other sessions' too (every send is bounded by its own timeout)."""
        with trio.CancelScope(shield=True):
            await self._flush_now(hops)

    async def _flush_now(self, hops) -> None:
        for hop in hops:
            failed = await hop.flush()
            for frame in failed:
                links = self.links.get((frame.session_id, frame.epoch))
                if links is None:
                    continue
                if links.next is hop:
                    links.next = None
                    await self.next_hops.release(hop)
                try:
                    await links.home.send(Error(code=ErrorCode.NEXT_HOP_FAILED, retriable=True,
                                                session_id=frame.session_id,
                                                message=f"next hop {hop.peer[-8:]} unreachable: {hop.broken}"))
                except ChannelClosed:
                    pass  # the entry is gone: its stream's end releases the session

    async def _unlink(self, key: tuple[bytes, int]) -> None:
        links = self.links.pop(key, None)
        if links is not None and links.next is not None:
            await self.next_hops.release(links.next)

    def submit(self, msg: Forward) -> Work | Error:
        """Queue a Forward frame for the next pass it can join (at once, without waiting), or the
        `busy` Error that refuses it."""
        shape = msg.tensors[0].shape if msg.tensors else ()
        rows = shape[1] if len(shape) >= 2 else 1
        key = (msg.session_id, msg.epoch)
        self.due.discard(key)
        self._arrived.set()
        try:
            state = self.endpoint.sessions.get(key)  # its microbatch: only frames of one microbatch share a pass
            return self.scheduler.submit(key, rows, msg.phase == Phase.DECODE, msg, state.microbatch if state else 0)
        except QueueFull as exc:
            return Error(code=ErrorCode.BUSY, message=str(exc), retriable=True, session_id=msg.session_id,
                         retry_after_s=self.retry_hint())

    async def _forward(self, msg: Forward) -> list[Message]:
        work = self.submit(msg)
        return [work] if isinstance(work, Error) else await self.finish(work)

    async def finish(self, work: Work) -> list[Message]:
        """Wait for a submitted piece of work to run (running passes while none runs); its outputs,
        less those already sent on to the next hop."""
        try:
            while not work.done:
                if self._stepping:
                    await self._step_done.wait()
                else:
                    await self._step()
        finally:
            if not work.done:  # the caller gave up (cancelled) before its work ran
                self.scheduler.withdraw(work)
        return work.output if work.output is not None else []

    async def _step(self) -> None:
        """Run one pass of the scheduler's choosing, then wake everyone waiting."""
        self._stepping = True
        batch: list = []
        hops: set[NextHop] = set()
        try:
            if self.gather_s and len(self.endpoint.sessions) > self.scheduler.waiting() > 0:
                # other sessions' frames of the same upstream pass are arriving on their own streams
                # a moment apart: wait for them, so one pass takes them all (not 1, then the rest)
                await trio.sleep(self.gather_s)
            await self._wait_for_due()
            batch = self.scheduler.schedule()
            if not batch:
                return
            t0 = time.perf_counter()
            try:
                outputs = await self.compute.run(self.endpoint.forward_batch, [w.payload for w in batch])
            except Exception as exc:  # a bug in one pass must not take the daemon down
                log.exception("shard pass failed", sessions=len(batch))
                outputs = [[Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                                  session_id=w.payload.session_id)] for w in batch]
            self.scheduler.update_from_output(batch, outputs)
            done, batch = batch, []
            self._account(time.perf_counter() - t0, done)
            hops = self._queue_forwards(done)
            self._stamp_tokens(done)
        finally:
            if batch:  # interrupted before its outputs arrived: its waiters must not wait forever
                self.scheduler.update_from_output(batch, [[] for _ in batch])
            self._stepping = False
            woken, self._step_done = self._step_done, trio.Event()
            woken.set()
        if hops:  # the next pass may start meanwhile: its outputs queue behind these
            await self._flush(hops)

    def expect(self, key: tuple[bytes, int], group: tuple = (), size: int = 0) -> None:
        """Say that a session's next frame is on its way (its entry just got the token it answers),
        and that `size` tokens of the same tail pass `group` come here: a pass about to start waits
        for those frames (at most DUE_WAIT_S). The tail's tokens reach the entry a moment apart,
        each on its own stream: without this, the first to come back would start a pass alone and
        the others would follow one by one."""
        self.due.add(key)
        self._arrived.set()
        if size > 1 and group:
            entry = self._groups.setdefault(group, [size, trio.current_time() + DUE_WAIT_S])
            entry[0] -= 1
            if entry[0] <= 0:
                del self._groups[group]

    def _awaited(self) -> bool:
        """Frames said to be on their way that have not come yet."""
        now = trio.current_time()
        for group in [g for g, (_, until) in self._groups.items() if until <= now]:
            del self._groups[group]
        return bool(self.due or self._groups)

    async def _wait_for_due(self) -> None:
        if not self._awaited() or not self.scheduler.waiting():
            return
        with trio.move_on_after(DUE_WAIT_S) as waited:
            while self._awaited():
                self._arrived = trio.Event()
                await self._arrived.wait()
        if waited.cancelled_caught:
            # what has not come by now (a generation that ended) is not waited for again
            self.due.clear()
            self._groups.clear()

    def _stamp_tokens(self, done: list[Work]) -> None:
        """Tell each entry how many of this pass's tokens go to it (see `expect`)."""
        homes: dict[str, list[Work]] = {}
        for w in done:
            links = self.links.get((w.payload.session_id, w.payload.epoch))
            if links is not None and w.output and isinstance(w.output[0], Token):
                homes.setdefault(links.home.peer, []).append(w)
        for group in homes.values():
            for w in group:
                w.output = [replace(w.output[0], pass_id=self.steps, pass_size=len(group)), *w.output[1:]]

    def _queue_forwards(self, done: list[Work]) -> set[NextHop]:
        """Queue the pass's hidden states for the next hops, in pass order (a link sends them as
        one frame); they leave the pieces' outputs. Returns the links that got some."""
        hops: set[NextHop] = set()
        for w in done:
            links = self.links.get((w.payload.session_id, w.payload.epoch))
            if links is None or links.next is None or not w.output or not isinstance(w.output[0], Forward):
                continue
            links.next.put(w.output[0])
            hops.add(links.next)
            self.forwarded += 1
            w.output = w.output[1:]
        return hops

    def _account(self, took: float, batch: list) -> None:
        self.compute_s += took
        self.steps += 1
        self.pass_s = took if self.pass_s is None else 0.9 * self.pass_s + 0.1 * took
        if self.on_step is not None:
            self.on_step(took, len(batch))
        if took > 0 and all(w.decode for w in batch):
            rate = (self.endpoint.shard.end - self.endpoint.shard.start) / took
            old = self.decode_layer_rate
            self.decode_layer_rate = rate if old is None else 0.9 * old + 0.1 * rate

    def retry_hint(self) -> float:
        """Seconds after which a refused client may try again: about the time to drain the queue."""
        per_pass = self.pass_s or 0.05
        return round(min(5.0, max(0.1, per_pass * self.scheduler.queued / max(1, self.scheduler.max_batch))), 2)

    async def release(self, key: tuple[bytes, int]) -> None:
        """Free a session's KV (safe while other sessions compute: it runs in order on the compute thread)."""
        self.due.discard(key)
        self._cancel(key)
        await self._unlink(key)
        await self.compute.run(self.endpoint.release, key)

    async def serve_stream(self, stream) -> None:
        """The /meshd/shard/1.0.0 handler: serve frames until the stream ends.

        Heartbeats are answered by the reader at once, while a worker runs the stream's frames in
        order on the compute thread: a hop busy computing still shows it is alive, so the entry
        can tell it from a frozen one."""
        channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL))
        channel.peer = str(getattr(getattr(stream, "muxed_conn", None), "peer_id", ""))
        opened: set[tuple[bytes, int]] = set()
        work_send, work_recv = trio.open_memory_channel[Message | tuple[Forward, Work | Error]](WORK_QUEUE)
        try:
            async with trio.open_nursery() as nursery:
                replies_send, replies_recv = trio.open_memory_channel[tuple[Message, list[Message]]](WORK_QUEUE)
                nursery.start_soon(self._work, channel, work_recv, replies_send)
                nursery.start_soon(self._send_replies, channel, replies_recv)
                while True:
                    try:
                        msg = await channel.receive(IDLE_TIMEOUT)
                    except (ChannelClosed, trio.TooSlowError):
                        break
                    except WireError as exc:  # the stream can no longer be trusted: say why, then close
                        code = ErrorCode.VERSION if isinstance(exc, UnsupportedVersion) else ErrorCode.BAD_FRAME
                        await channel.send(Error(code=code, message=str(exc)))
                        break
                    if isinstance(msg, Hello):
                        await channel.send(Hello(agent="meshd", model_fingerprint=self.endpoint.model_fp,
                                                 recipe_fingerprint=self.endpoint.recipe_fp))
                    elif isinstance(msg, Heartbeat):
                        await channel.send(msg)
                    elif isinstance(msg, ForwardBatch):
                        # one upstream pass's outputs: all of them join the scheduler now, so they
                        # can share a pass here too; the worker answers them in order
                        submitted = [(frame, self.submit(frame)) for frame in msg.frames()]
                        try:
                            for i, item in enumerate(submitted):
                                await work_send.send(item)
                        except BaseException:  # cancelled: what the worker never gets is taken back
                            for _, work in submitted[i:]:
                                if isinstance(work, Work):
                                    self.scheduler.withdraw(work)
                            raise
                    else:
                        if isinstance(msg, OpenSession):
                            opened.add((msg.session_id, msg.epoch))
                            # this stream's log lines carry the request they serve, as on the entry
                            structlog.contextvars.bind_contextvars(request_id=msg.request_id,
                                                                   session=msg.session_id.hex()[:8])
                        await work_send.send(msg)
                nursery.cancel_scope.cancel()
        except ChannelClosed:
            pass
        finally:
            with trio.CancelScope(shield=True):
                self._withdraw_unread(work_recv)
                for key in opened:
                    await self.release(key)
                await channel.aclose()
            if opened:
                log.info("session stream closed", sessions=len(opened))

    def _withdraw_unread(self, work: trio.MemoryReceiveChannel) -> None:
        """Take back the submitted frames of a stream that ended before its worker reached them."""
        while True:
            try:
                item = work.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if isinstance(item, tuple) and isinstance(item[1], Work):
                self.scheduler.withdraw(item[1])

    async def _send_replies(self, channel: Channel, replies: trio.MemoryReceiveChannel) -> None:
        """Deliver the replies of a link's frames in order, while the worker goes on to the next
        frames (a tail's tokens go to many entries' streams: the next pass need not wait for that)."""
        async with replies:
            async for msg, out in replies:
                try:
                    for reply in out:
                        await self.deliver(msg, reply, channel)
                except ChannelClosed:
                    return

    async def _work(self, channel: Channel, work: trio.MemoryReceiveChannel,
                    replies: trio.MemorySendChannel) -> None:
        """Run a stream's frames in arrival order and send their replies."""
        async for msg in work:
            if isinstance(msg, tuple):  # a frame of a ForwardBatch, already submitted
                msg, submitted = msg
                out = [submitted] if isinstance(submitted, Error) else await self.finish(submitted)
                if out:
                    try:
                        await replies.send((msg, out))
                    except trio.BrokenResourceError:  # the stream broke: nobody to answer
                        return
                continue
            if isinstance(msg, OpenSession):
                structlog.contextvars.bind_contextvars(request_id=msg.request_id, session=msg.session_id.hex()[:8])
            try:
                answers = await (self.open_linked(msg, channel) if isinstance(msg, OpenSession) else self.handle(msg))
            except Exception as exc:  # a bug in one session must not take the daemon down
                log.exception("shard request failed")
                answers = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                                 session_id=getattr(msg, "session_id", b""))]
            try:
                for reply in answers:
                    await self.deliver(msg, reply, channel)
            except ChannelClosed:
                return
