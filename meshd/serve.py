"""Serving a shard over streams: one long-lived stream per session hop, frames in, frames out.

Rules: tensor work runs on the daemon's compute executor, one job at a time in arrival order, so
the event loop keeps reading every stream; a stream's sessions are released when the stream ends, however
it ends, so a vanished entry never leaves KV behind; every failure goes back as an `Error` frame.
"""

from __future__ import annotations

import time

import structlog
import trio

from meshd.compute import ComputeExecutor
from meshd.gen import SHARD_PROTOCOL
from meshd.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.shard.endpoint import ShardEndpoint
from meshd.wire import (Cancel, Close, Error, ErrorCode, Heartbeat, Hello, Message, OpenSession,
                        Phase, UnsupportedVersion, WireError)

IDLE_TIMEOUT = 300.0
WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream
log = get_logger(__name__)


class ShardService:
    def __init__(self, endpoint: ShardEndpoint, compute: ComputeExecutor) -> None:
        self.endpoint = endpoint
        self.compute = compute
        self.compute_s = 0.0  # time spent in tensor work, for status and benchmarks
        self.steps = 0
        self.on_step = None  # called with each step's compute seconds (metrics)
        self.decode_layer_rate: float | None = None  # moving average of layer-steps/s on real decode steps

    async def handle(self, msg: Message) -> list[Message]:
        """Answer one message on the compute thread (in arrival order)."""
        if isinstance(msg, (OpenSession, Close, Cancel)):
            return await self.compute.run(self.endpoint.handle, msg)
        t0 = time.perf_counter()
        try:
            return await self.compute.run(self.endpoint.handle, msg)
        finally:
            took = time.perf_counter() - t0
            self.compute_s += took
            self.steps += 1
            if self.on_step is not None:
                self.on_step(took)
            if getattr(msg, "phase", None) == Phase.DECODE and took > 0:
                rate = (self.endpoint.shard.end - self.endpoint.shard.start) / took
                old = self.decode_layer_rate
                self.decode_layer_rate = rate if old is None else 0.9 * old + 0.1 * rate

    async def release(self, key: tuple[bytes, int]) -> None:
        """Free a session's KV (safe while other sessions compute: it runs in order on the compute thread)."""
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
                replies = await self.handle(msg)
            except Exception as exc:  # a bug in one session must not take the daemon down
                log.exception("shard request failed")
                replies = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                                 session_id=getattr(msg, "session_id", b""))]
            try:
                for reply in replies:
                    await channel.send(reply)
            except ChannelClosed:
                return
