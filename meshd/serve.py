"""Serving a shard over streams: one long-lived stream per session hop, frames in, frames out.

Rules: tensor work runs on the daemon's compute executor, one job at a time, so the event loop keeps
reading every stream; the Forward frames of all sessions waiting at once share one forward pass. A
session's hidden states go straight to the next hop when the entry names one this daemon can reach
(one transfer a hop a token), its tokens and errors to the stream it was opened on. A stream's
sessions are released when the stream ends, however it ends, so a vanished entry never leaves KV
behind; every failure goes back as an `Error` frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import structlog
import trio

from meshd.compute import ComputeExecutor
from meshd.gen import SHARD_PROTOCOL
from meshd.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.shard.endpoint import ShardEndpoint
from meshd.shard.scheduler import QueueFull, Scheduler
from meshd.wire import (Cancel, Close, Error, ErrorCode, Forward, Heartbeat, Hello, Message, OpenSession, Opened,
                        Phase, UnsupportedVersion, WireError)

IDLE_TIMEOUT = 300.0
DIAL_TIMEOUT = 10.0  # reaching the next hop of a session

WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream
log = get_logger(__name__)


@dataclass
class Links:
    """Where a session's outputs go."""

    home: Channel  # the stream it was opened on (the entry): tokens and errors
    next: Channel | None = None  # the stream to the next hop, when this hop forwards its hidden states
    next_peer: str = ""


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
        self.draining = False  # leaving the mesh: sessions from other daemons are refused
        self.gather_s = 0.0  # wait this long before a pass while other sessions' frames are due (--gather-ms)
        self.dial: Callable[[str, list[str]], Awaitable[Channel]] | None = None  # a stream to a peer (daemon)

    async def handle(self, msg: Message) -> list[Message]:
        """Answer one message: a Forward joins the next pass it can, the rest run in order."""
        if isinstance(msg, Forward):
            return await self._forward(msg)
        if isinstance(msg, (Close, Cancel)):
            self.scheduler.cancel((msg.session_id, msg.epoch))
            await self._unlink((msg.session_id, msg.epoch))
        return await self.compute.run(self.endpoint.handle, msg)

    async def open_linked(self, msg: OpenSession, home: Channel) -> list[Message]:
        """Open a session whose tokens and errors go to `home`, and whose hidden states go straight
        to the next hop when the sender names one and this daemon can reach it (else back home).
        A draining daemon refuses as busy, so the entry picks another route at once."""
        if self.draining:
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
                    links.next = await self.dial(msg.next_peer, msg.next_addrs.split())
                links.next_peer = msg.next_peer
            except Exception as exc:  # unreachable from here (NAT, firewall): the sender relays instead
                log.info("next hop unreachable, outputs go back to the sender", peer=msg.next_peer[-8:],
                         error=f"{type(exc).__name__}: {exc}")
        return [replace(replies[0], forwarding=links.next is not None)]

    async def deliver(self, msg: Message, reply: Message, channel: Channel) -> None:
        """Send a reply to where its session's outputs go: hidden states to the next hop (when this
        hop forwards), tokens and errors to the session's home stream; replies for frames of no
        linked session go back on the stream they came from."""
        links = self.links.get((getattr(msg, "session_id", b""), getattr(msg, "epoch", -1)))
        if links is None:
            await channel.send(reply)
            return
        if isinstance(reply, Forward) and links.next is not None:
            try:
                await links.next.send(reply)
                self.forwarded += 1
                return
            except ChannelClosed as exc:
                nxt, links.next = links.next, None
                await nxt.aclose()
                reply = Error(code=ErrorCode.NEXT_HOP_FAILED, retriable=True, session_id=reply.session_id,
                              message=f"next hop {links.next_peer[-8:]} unreachable: {exc}")
        try:
            await links.home.send(reply)
        except ChannelClosed:
            if links.home is channel:
                raise
            # the entry is gone: its stream's end releases the session

    async def _unlink(self, key: tuple[bytes, int]) -> None:
        links = self.links.pop(key, None)
        if links is not None and links.next is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await links.next.aclose()

    async def _forward(self, msg: Forward) -> list[Message]:
        shape = msg.tensors[0].shape if msg.tensors else ()
        rows = shape[1] if len(shape) >= 2 else 1
        try:
            work = self.scheduler.submit((msg.session_id, msg.epoch), rows, msg.phase == Phase.DECODE, msg)
        except QueueFull as exc:
            return [Error(code=ErrorCode.BUSY, message=str(exc), retriable=True, session_id=msg.session_id,
                          retry_after_s=self.retry_hint())]
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
        try:
            if self.gather_s and len(self.endpoint.sessions) > self.scheduler.waiting() > 0:
                # other sessions' frames of the same upstream pass are arriving on their own streams
                # a moment apart: wait for them, so one pass takes them all (not 1, then the rest)
                await trio.sleep(self.gather_s)
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
        finally:
            if batch:  # interrupted before its outputs arrived: its waiters must not wait forever
                self.scheduler.update_from_output(batch, [[] for _ in batch])
            self._stepping = False
            done, self._step_done = self._step_done, trio.Event()
            done.set()

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
        self.scheduler.cancel(key)
        await self._unlink(key)
        await self.compute.run(self.endpoint.release, key)

    async def serve_stream(self, stream) -> None:
        """The /meshd/shard/1.0.0 handler: serve frames until the stream ends.

        Heartbeats are answered by the reader at once, while a worker runs the stream's frames in
        order on the compute thread: a hop busy computing still shows it is alive, so the entry
        can tell it from a frozen one."""
        channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL))
        opened: set[tuple[bytes, int]] = set()
        work_send, work_recv = trio.open_memory_channel[Message](WORK_QUEUE)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._work, channel, work_recv)
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
                for key in opened:
                    await self.release(key)
                await channel.aclose()
            if opened:
                log.info("session stream closed", sessions=len(opened))

    async def _work(self, channel: Channel, work: trio.MemoryReceiveChannel) -> None:
        """Run a stream's frames in arrival order and send their replies."""
        async for msg in work:
            if isinstance(msg, OpenSession):
                structlog.contextvars.bind_contextvars(request_id=msg.request_id, session=msg.session_id.hex()[:8])
            try:
                replies = await (self.open_linked(msg, channel) if isinstance(msg, OpenSession) else self.handle(msg))
            except Exception as exc:  # a bug in one session must not take the daemon down
                log.exception("shard request failed")
                replies = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                                 session_id=getattr(msg, "session_id", b""))]
            try:
                for reply in replies:
                    await self.deliver(msg, reply, channel)
            except ChannelClosed:
                return
