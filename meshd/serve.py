"""Serving a shard over streams: one long-lived stream per session hop, frames in, frames out.

Rules: tensor work runs in a worker thread, one computation at a time per shard, so the event
loop keeps reading every stream; a stream's sessions are released when the stream ends, however
it ends, so a vanished entry never leaves KV behind; every failure goes back as an `Error` frame.
"""

from __future__ import annotations

import trio

from meshd.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.shard.endpoint import ShardEndpoint
from meshd.wire import (Cancel, Close, Error, ErrorCode, Heartbeat, Hello, Message, OpenSession, WireError)

IDLE_TIMEOUT = 300.0
log = get_logger(__name__)


class ShardService:
    def __init__(self, endpoint: ShardEndpoint) -> None:
        self.endpoint = endpoint
        self.compute = trio.Lock()
        self.active_streams = 0

    async def handle(self, msg: Message) -> list[Message]:
        """Answer one message; Forward runs in a worker thread under the shard's compute lock."""
        if isinstance(msg, (OpenSession, Close, Cancel)):
            return self.endpoint.handle(msg)
        async with self.compute:
            return await trio.to_thread.run_sync(self.endpoint.handle, msg)

    async def serve_stream(self, stream) -> None:
        """The /meshd/shard/1.0.0 handler: serve frames until the stream ends."""
        channel = Channel.over_libp2p(stream)
        opened: set[tuple[bytes, int]] = set()
        self.active_streams += 1
        try:
            while True:
                try:
                    msg = await channel.receive(IDLE_TIMEOUT)
                except (ChannelClosed, trio.TooSlowError):
                    return
                except WireError as exc:
                    await channel.send(Error(code=ErrorCode.BAD_FRAME, message=str(exc)))
                    return
                if isinstance(msg, Hello):
                    await channel.send(Hello(agent="meshd", model_fingerprint=self.endpoint.model_fp,
                                             recipe_fingerprint=self.endpoint.recipe_fp))
                    continue
                if isinstance(msg, Heartbeat):
                    await channel.send(msg)
                    continue
                if isinstance(msg, OpenSession):
                    opened.add((msg.session_id, msg.epoch))
                try:
                    replies = await self.handle(msg)
                except Exception as exc:  # a bug in one session must not take the daemon down
                    log.exception("shard request failed")
                    replies = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                                     session_id=getattr(msg, "session_id", b""))]
                for reply in replies:
                    await channel.send(reply)
        except ChannelClosed:
            pass
        finally:
            self.active_streams -= 1
            for key in opened:
                self.endpoint.release(key)
            with trio.CancelScope(shield=True):
                await channel.aclose()
