"""The shard stream protocol (/meshd/shard/1.0.0) on a hop: one long-lived stream per session hop
(or per upstream daemon's link), frames in, replies out.

Rules: heartbeats are answered by the reader at once, while a worker runs the stream's frames in
order on the service (and through it on the compute thread): a hop busy computing still shows it is
alive. A `ForwardBatch` is submitted whole at once, so what one hop computed together the next
computes together. A stream that can no longer be trusted (a bad frame, a version it does not speak)
is told why and closed. A stream's sessions are released when it ends, however it ends, so a
vanished entry never leaves KV behind. What a peer's streams may take (bytes, streams, shares of
sessions and of the queue) is the daemon's `Intake` (`meshd/hop/intake.py`), asked before a frame
is queued.
"""

from __future__ import annotations

from dataclasses import replace

import structlog
import trio

from meshd.hop.admission import busy
from meshd.hop.intake import Intake
from meshd.hop.scheduler import Work
from meshd.core.log import get_logger
from meshd.p2p.budget import Held
from meshd.p2p.channel import Channel, ChannelClosed, FrameStalled
from meshd.wire import (Error, ErrorCode, Forward, ForwardBatch, Heartbeat, Hello, Message, OpenSession,
                        UnsupportedVersion, WireError)

WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream (their bytes are bounded by the budget)
TRIM_AFTER = 16 << 20  # a stream that took a frame this big hands the freed heap back when it ends
RESET_LINGER_S = 1.0  # a stream this daemon stopped reading is reset this long after its close: a peer
# still writing reads the refusal before (py-libp2p's reader loses it once its own write met the reset)
log = get_logger(__name__)


DEFAULT_INTAKE = Intake()


async def serve_shard_stream(service, stream, intake: Intake | None = None) -> None:
    """The /meshd/shard/1.0.0 handler: serve frames until the stream ends.

    Heartbeats are answered by the reader at once, while a worker runs the stream's frames in
    order on the compute thread: a hop busy computing still shows it is alive, so the entry
    can tell it from a frozen one. A peer past its streams is told so and closed."""
    intake = intake or DEFAULT_INTAKE
    channel = intake.channel(stream)
    if intake.streams[channel.peer] >= intake.streams_per_peer:
        await _refuse(channel, busy(f"busy: this peer holds {intake.streams_per_peer} shard streams here, the limit"))
        return
    intake.streams[channel.peer] += 1
    opened: set[tuple[bytes, int]] = set()
    work_send, work_recv = trio.open_memory_channel[tuple](WORK_QUEUE)
    try:
        async with trio.open_nursery() as nursery:
            replies_send, replies_recv = trio.open_memory_channel[tuple[Message, list[Message]]](WORK_QUEUE)
            nursery.start_soon(_work, service, intake, channel, work_recv, replies_send)
            nursery.start_soon(_send_replies, service, channel, replies_recv)
            await _read(service, intake, channel, work_send, opened)
            nursery.cancel_scope.cancel()
    except ChannelClosed:
        pass
    finally:
        with trio.CancelScope(shield=True):
            await _withdraw_unread(service, intake, channel.peer, work_recv)
            for key in opened:
                await service.release(key)
            # its decoder's buffer (a half-sent frame) goes before the trim; a stream this daemon stopped
            # reading before its peer ended it is reset, and what py-libp2p buffered of it unread goes too
            # (it counts against its peer's streams until then)
            await channel.aclose(reset=not channel.ended, linger=RESET_LINGER_S)
            intake.streams[channel.peer] -= 1
            if intake.streams[channel.peer] <= 0:
                del intake.streams[channel.peer]
            await intake.trim_after_burst(later=channel.largest >= TRIM_AFTER)
        if opened:
            log.info("session stream closed", sessions=len(opened))


async def _refuse(channel: Channel, error: Error) -> None:
    try:
        await channel.send(error)
    except ChannelClosed:
        pass
    await channel.aclose(reset=True)  # never read: what its peer sends is not kept


async def _read(service, intake: Intake, channel: Channel, work_send: trio.MemorySendChannel,
                opened: set) -> None:
    """Read a stream's frames until it ends, answering hellos and heartbeats at once and queueing
    the rest for the worker (each with the budget bytes it holds)."""
    while True:
        try:
            msg, held = await channel.receive_held(intake.idle_timeout)
        except FrameStalled as exc:  # a half-sent or trickled frame: its bytes are not kept
            await channel.send(Error(code=ErrorCode.TIMEOUT, message=str(exc)))
            return
        except (ChannelClosed, trio.TooSlowError):
            return
        except WireError as exc:  # the stream can no longer be trusted: say why, then close
            code = ErrorCode.VERSION if isinstance(exc, UnsupportedVersion) else ErrorCode.BAD_FRAME
            await channel.send(Error(code=code, message=str(exc)))
            return
        if isinstance(msg, (Hello, Heartbeat)):
            held.release()
            if isinstance(msg, Hello):
                msg = Hello(agent="meshd", model_fingerprint=service.endpoint.model_fp,
                            recipe_fingerprint=service.endpoint.recipe_fp)
            await channel.send(msg)
        elif isinstance(msg, ForwardBatch):
            await _submit_batch(service, intake, channel.peer, msg, held, work_send)
        elif (refusal := _refusal(service, intake, channel.peer, msg)) is not None:
            msg = None  # its tensors go before a trim
            await intake.release(held)
            await channel.send(refusal)
        else:
            if isinstance(msg, OpenSession):
                opened.add((msg.session_id, msg.epoch))
                # this stream's log lines carry the request they serve, as on the entry
                structlog.contextvars.bind_contextvars(request_id=msg.request_id,
                                                       session=msg.session_id.hex()[:8])
            try:
                await work_send.send((msg, held))
            except BaseException:
                held.release()
                raise


def max_positions(service, chunk_tokens: int) -> int:
    """Positions one Forward frame may carry here: a pass's token budget (or the prefill chunk size
    this daemon was given, if larger), whoever sends it, so that no frame holds a pass for long."""
    return max(service.scheduler.token_budget, chunk_tokens)


def _too_long(service, frame: Forward, chunk_tokens: int) -> Error | None:
    shape = frame.tensors[0].shape if frame.tensors else ()
    rows, most = (shape[1] if len(shape) >= 2 else 1), max_positions(service, chunk_tokens)
    if rows <= most:
        return None
    return Error(code=ErrorCode.BAD_FRAME, session_id=frame.session_id,
                 message=f"a forward frame carries at most {most} positions here, not {rows}: send prefill in chunks")


def _refusal(service, intake: Intake, peer: str, msg: Message) -> Error | None:
    """What the reader answers at once instead of queueing `msg`: a Forward too long for one
    pass or past this peer's share of the queue, a session the daemon (or this peer's share) has
    no room for."""
    if isinstance(msg, Forward):
        refusal = _too_long(service, msg, intake.chunk_tokens) or intake.enqueue(service, peer)
        return replace(refusal, session_id=msg.session_id) if refusal is not None else None
    if isinstance(msg, OpenSession):
        return intake.admission(service, peer, msg)
    return None


def _submit(service, intake: Intake, peer: str, frame: Forward) -> Work | Error:
    """A frame of a ForwardBatch into the scheduler (counted against its peer's share while it
    waits), or the Error that refuses it."""
    refusal = _refusal(service, intake, peer, frame)
    if refusal is not None:
        return refusal
    work = service.submit(frame)
    if not isinstance(work, Work):
        intake.dequeue(peer)
    return work


async def _submit_batch(service, intake: Intake, peer: str, msg: ForwardBatch, held: Held,
                        work_send: trio.MemorySendChannel) -> None:
    """One upstream pass's outputs: all of them join the scheduler now, so they can share a pass
    here too; the worker answers them in order (and gives the batch's bytes back after the last)."""
    submitted = [(frame, _submit(service, intake, peer, frame)) for frame in msg.frames()]
    i = 0
    try:
        for i, item in enumerate(submitted):
            await work_send.send((item, held if i == len(submitted) - 1 else None))
    except BaseException:  # cancelled: what the worker never gets is taken back
        held.release()
        for _, work in submitted[i:]:
            if isinstance(work, Work):
                service.scheduler.withdraw(work)
                intake.dequeue(peer)
        raise

async def _withdraw_unread(service, intake: Intake, peer: str, work: trio.MemoryReceiveChannel) -> None:
    """Take back the submitted frames (and admitted sessions) of a stream that ended before its
    worker reached them."""
    while True:
        try:
            item, held = work.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        await intake.release(held)
        if isinstance(item, OpenSession):
            intake.opened(service, peer, item)
        if _counted(item):
            intake.dequeue(peer)
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

async def _work(service, intake: Intake, channel: Channel, work: trio.MemoryReceiveChannel,
                replies: trio.MemorySendChannel) -> None:
    """Run a stream's frames in arrival order and send their replies; each frame's bytes go back
    to the budget once its work is done."""
    async for msg, held in work:
        counted = _counted(msg)
        try:
            if isinstance(msg, tuple):  # a frame of a ForwardBatch, already submitted
                msg, submitted = msg
                out = [submitted] if isinstance(submitted, Error) else await service.finish(submitted)
                if out:
                    try:
                        await replies.send((msg, out))
                    except trio.BrokenResourceError:  # the stream broke: nobody to answer
                        return
                continue
            try:
                if not await _answer(service, channel, msg):
                    return
            finally:
                if isinstance(msg, OpenSession):
                    intake.opened(service, channel.peer, msg)
        finally:
            msg = submitted = None  # its tensors go before a trim
            if counted:
                intake.dequeue(channel.peer)
            await intake.release(held)


def _counted(item) -> bool:
    """Whether a work item counts against its peer's share of the queue (see `Intake.enqueue`)."""
    return isinstance(item, Forward) or (isinstance(item, tuple) and isinstance(item[1], Work))


async def _answer(service, channel: Channel, msg: Message) -> bool:
    """Run one frame that is not part of a batch and deliver its replies; False once the stream broke."""
    if isinstance(msg, OpenSession):
        structlog.contextvars.bind_contextvars(request_id=msg.request_id, session=msg.session_id.hex()[:8])
    try:
        answers = await (service.open_linked(msg, channel) if isinstance(msg, OpenSession)
                         else service.handle(msg, channel.peer))
    except Exception as exc:  # a bug in one session must not take the daemon down
        log.exception("shard request failed")
        answers = [Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                         session_id=getattr(msg, "session_id", b""))]
    try:
        for reply in answers:
            await service.deliver(msg, reply, channel)
    except ChannelClosed:
        return False
    return True
