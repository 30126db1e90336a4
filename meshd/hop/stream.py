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

from collections import Counter
from dataclasses import dataclass, field

import structlog
import trio

from meshd.hop.admission import PEER_SHARE
from meshd.hop.scheduler import Work
from meshd.node.log import get_logger
from meshd.p2p.budget import ByteBudget, Held
from meshd.p2p.channel import FRAME_TIMEOUT, Channel, ChannelClosed, FrameStalled
from meshd.shard.footprint import trim_heap
from meshd.wire import (Error, ErrorCode, Forward, ForwardBatch, Heartbeat, Hello, Message, OpenSession,
                        UnsupportedVersion, WireError, chunk_tokens)
from meshd.wire.protocols import SHARD_PROTOCOL

IDLE_TIMEOUT = 300.0
WORK_QUEUE = 256  # frames read ahead of the compute thread on one stream (their bytes are bounded by the budget)
FRAME_BUDGET = 512 << 20  # bytes all peers' frames may occupy at once (queued, half-received, being decoded)
PEER_FRAME_SHARE = 192 << 20  # ... one peer's frames (three of the largest frames a decoder takes)
STREAMS_PER_PEER = 128  # shard streams one peer may hold open here (an entry opens one per session)
TRIM_AFTER = 16 << 20  # once the frames of a burst this big are done, freed heap goes back to the system
BUSY_RETRY_S = 1.0
log = get_logger(__name__)


@dataclass
class Intake:
    """What a daemon takes in from other daemons' shard streams, one for all its streams: frame
    bytes against a per-peer share and a total (`meshd/p2p/budget.py`), streams per peer, and how
    long a stream may sit on a half-sent frame or say nothing at all."""

    budget: ByteBudget = field(default_factory=lambda: ByteBudget(FRAME_BUDGET, PEER_FRAME_SHARE))
    streams_per_peer: int = STREAMS_PER_PEER
    frame_timeout: float = FRAME_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    peer_share: float = PEER_SHARE  # of the sessions and KV, what one peer may hold (meshd/hop/admission.py)
    streams: Counter = field(default_factory=Counter)  # peer -> shard streams open now
    opening: Counter = field(default_factory=Counter)  # peer -> sessions admitted here, not yet opened
    opening_kv: Counter = field(default_factory=Counter)  # peer -> their KV bytes

    def channel(self, stream) -> Channel:
        channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL))
        channel.peer = str(getattr(getattr(stream, "muxed_conn", None), "peer_id", ""))
        channel.budget, channel.frame_timeout = self.budget, self.frame_timeout
        return channel

    def admission(self, service, peer: str, msg: OpenSession) -> Error | None:
        """The `busy` refusal of a session, answered on the event loop (not behind a pass): the
        daemon is full, or this peer holds its share. None: the endpoint decides (and says what
        else may be wrong); the session then counts against the peer until it is open."""
        endpoint = service.endpoint
        if ((msg.model_fingerprint, msg.recipe_fingerprint) != (endpoint.model_fp, endpoint.recipe_fp)
                or (msg.session_id, msg.epoch) in endpoint.sessions):
            return None
        need = endpoint.kv_need(msg)
        count, promised = endpoint.sessions.held_by(peer)
        why = endpoint.capacity().peer_refusal(count + self.opening[peer], promised + self.opening_kv[peer], need,
                                               self.peer_share)
        if why is None:
            self.opening[peer] += 1
            self.opening_kv[peer] += need
            return None
        endpoint.refused += 1
        return Error(code=ErrorCode.BUSY, message=f"busy: this daemon is full: {why}", retriable=True,
                     request_id=msg.request_id, session_id=msg.session_id, retry_after_s=BUSY_RETRY_S)

    def opened(self, service, peer: str, msg: OpenSession) -> None:
        """A session admitted by `admission` has opened (or failed to): it counts as held, or not at all."""
        for counter, n in ((self.opening, 1), (self.opening_kv, service.endpoint.kv_need(msg))):
            counter[peer] -= n
            if counter[peer] <= 0:
                del counter[peer]

    async def release(self, held: Held | None) -> None:
        """Give a frame's bytes back; after a burst, hand the freed heap back too (as loading does)."""
        if held is not None:
            held.release()
        await self.trim_after_burst()

    async def trim_after_burst(self, now: bool = False) -> None:
        """Once a burst of frames is over (nothing held, much held before), or `now`, give the heap back."""
        if self.budget.trimmed(TRIM_AFTER) or now:
            await trio.to_thread.run_sync(trim_heap)


DEFAULT_INTAKE = Intake()


async def serve_shard_stream(service, stream, intake: Intake | None = None) -> None:
    """The /meshd/shard/1.0.0 handler: serve frames until the stream ends.

    Heartbeats are answered by the reader at once, while a worker runs the stream's frames in
    order on the compute thread: a hop busy computing still shows it is alive, so the entry
    can tell it from a frozen one. A peer past its streams is told so and closed."""
    intake = intake or DEFAULT_INTAKE
    channel = intake.channel(stream)
    if intake.streams[channel.peer] >= intake.streams_per_peer:
        await _refuse(channel, Error(code=ErrorCode.BUSY, retriable=True, retry_after_s=1.0,
                                     message=f"busy: this peer holds {intake.streams_per_peer} shard streams here,"
                                             " the limit"))
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
            intake.streams[channel.peer] -= 1
            if intake.streams[channel.peer] <= 0:
                del intake.streams[channel.peer]
            await _withdraw_unread(service, intake, channel.peer, work_recv)
            for key in opened:
                await service.release(key)
            await channel.aclose()  # its decoder's buffer (a half-sent frame) goes before the trim
            await intake.trim_after_burst(channel.largest >= TRIM_AFTER)
        if opened:
            log.info("session stream closed", sessions=len(opened))


async def _refuse(channel: Channel, error: Error) -> None:
    try:
        await channel.send(error)
    except ChannelClosed:
        pass
    await channel.aclose()


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
            await _submit_batch(service, msg, held, work_send)
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


def max_positions(service) -> int:
    """Positions one Forward frame may carry here: a pass's token budget (or the prefill chunk size
    this daemon was given, if larger), whoever sends it, so that no frame holds a pass for long."""
    return max(service.scheduler.token_budget, chunk_tokens())


def _too_long(service, frame: Forward) -> Error | None:
    shape = frame.tensors[0].shape if frame.tensors else ()
    rows, most = (shape[1] if len(shape) >= 2 else 1), max_positions(service)
    if rows <= most:
        return None
    return Error(code=ErrorCode.BAD_FRAME, session_id=frame.session_id,
                 message=f"a forward frame carries at most {most} positions here, not {rows}: send prefill in chunks")


def _refusal(service, intake: Intake, peer: str, msg: Message) -> Error | None:
    """What the reader answers at once instead of queueing `msg`: a Forward too long for one
    pass, a session the daemon (or this peer's share) has no room for."""
    if isinstance(msg, Forward):
        return _too_long(service, msg)
    if isinstance(msg, OpenSession):
        return intake.admission(service, peer, msg)
    return None


async def _submit_batch(service, msg: ForwardBatch, held: Held, work_send: trio.MemorySendChannel) -> None:
    """One upstream pass's outputs: all of them join the scheduler now, so they can share a pass
    here too; the worker answers them in order (and gives the batch's bytes back after the last)."""
    submitted = [(frame, _too_long(service, frame) or service.submit(frame)) for frame in msg.frames()]
    i = 0
    try:
        for i, item in enumerate(submitted):
            await work_send.send((item, held if i == len(submitted) - 1 else None))
    except BaseException:  # cancelled: what the worker never gets is taken back
        held.release()
        for _, work in submitted[i:]:
            if isinstance(work, Work):
                service.scheduler.withdraw(work)
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
            await intake.release(held)


async def _answer(service, channel: Channel, msg: Message) -> bool:
    """Run one frame that is not part of a batch and deliver its replies; False once the stream broke."""
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
        return False
    return True
