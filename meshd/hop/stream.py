"""The shard stream protocol (/meshd/shard/1.0.0) on a hop: one long-lived stream per session hop
(or per upstream daemon's link), frames in, replies out.

Rules: heartbeats are answered by the reader at once, while a worker runs the stream's frames in
order on the service (and through it on the compute thread): a hop busy computing still shows it is
alive. A `ForwardBatch` is submitted whole at once, so what one hop computed together the next
computes together. A stream that can no longer be trusted (a bad frame, a version it does not speak)
is told why and closed. A stream's sessions are released when it ends, however it ends, so a
vanished entry never leaves KV behind.
"""

from __future__ import annotations

import structlog
import trio

from meshd.hop.scheduler import Work
from meshd.node.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import (Error, ErrorCode, Forward, ForwardBatch, Heartbeat, Hello, Message, OpenSession,
                        UnsupportedVersion, WireError)
from meshd.wire.protocols import SHARD_PROTOCOL

IDLE_TIMEOUT = 300.0
WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream
log = get_logger(__name__)


async def serve_shard_stream(service, stream) -> None:
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
            nursery.start_soon(_work, service, channel, work_recv, replies_send)
            nursery.start_soon(_send_replies, service, channel, replies_recv)
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
                    await channel.send(Hello(agent="meshd", model_fingerprint=service.endpoint.model_fp,
                                             recipe_fingerprint=service.endpoint.recipe_fp))
                elif isinstance(msg, Heartbeat):
                    await channel.send(msg)
                elif isinstance(msg, ForwardBatch):
                    # one upstream pass's outputs: all of them join the scheduler now, so they
                    # can share a pass here too; the worker answers them in order
                    submitted = [(frame, service.submit(frame)) for frame in msg.frames()]
                    try:
                        for i, item in enumerate(submitted):
                            await work_send.send(item)
                    except BaseException:  # cancelled: what the worker never gets is taken back
                        for _, work in submitted[i:]:
                            if isinstance(work, Work):
                                service.scheduler.withdraw(work)
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
            _withdraw_unread(service, work_recv)
            for key in opened:
                await service.release(key)
            await channel.aclose()
        if opened:
            log.info("session stream closed", sessions=len(opened))

def _withdraw_unread(service, work: trio.MemoryReceiveChannel) -> None:
    """Take back the submitted frames of a stream that ended before its worker reached them."""
    while True:
        try:
            item = work.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        if isinstance(item, tuple) and isinstance(item[1], Work):
            service.scheduler.withdraw(item[1])

async def _send_replies(service, channel: Channel, replies: trio.MemoryReceiveChannel) -> None:
    """Deliver the replies of a link's frames in order, while the worker goes on to the next
    frames (a tail's tokens go to many entries' streams: the next pass need not wait for that)."""
    async with replies:
        async for msg, out in replies:
            try:
                for reply in out:
                    await service.deliver(msg, reply, channel)
            except ChannelClosed:
                return

async def _work(service, channel: Channel, work: trio.MemoryReceiveChannel,
                replies: trio.MemorySendChannel) -> None:
    """Run a stream's frames in arrival order and send their replies."""
    async for msg in work:
        if isinstance(msg, tuple):  # a frame of a ForwardBatch, already submitted
            msg, submitted = msg
            out = [submitted] if isinstance(submitted, Error) else await service.finish(submitted)
            if out:
                try:
                    await replies.send((msg, out))
                except trio.BrokenResourceError:  # the stream broke: nobody to answer
                    return
            continue
        if isinstance(msg, OpenSession):
            structlog.contextvars.bind_contextvars(request_id=msg.request_id, session=msg.session_id.hex()[:8])
        try:
            answers = await (service.open_linked(msg, channel) if isinstance(msg, OpenSession) else service.handle(msg))
        except Exception as exc:  # a bug in one session must not take the daemon down
            log.exception("shard request failed")
            answers = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                             session_id=getattr(msg, "session_id", b""))]
        try:
            for reply in answers:
                await service.deliver(msg, reply, channel)
        except ChannelClosed:
            return
