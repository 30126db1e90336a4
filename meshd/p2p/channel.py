"""meshd.wire frames over a byte stream: a libp2p stream or a trio stream (the control socket).

Rules: a channel reads only what it needs and never infers success from end-of-stream (a killed
peer, a clean close and a reset all look alike): the end of a conversation is an explicit frame.
Every receive takes a deadline.
"""

from __future__ import annotations

from collections import Counter

import trio

from meshd.core.settings import default
from meshd.p2p.budget import ByteBudget, Held, OverBudget
from meshd.wire import DEFAULT_ENCODING, Decoder, FrameTooLarge, Message, encode
from meshd.wire.codec import RawFrame

READ_SIZE = 1 << 16
SEND_TIMEOUT = 10.0  # a peer that reads nothing for this long is as good as gone
FRAME_TIMEOUT = default("frame_timeout")  # a frame begun must be whole within this (a half-sent frame is not kept)
OFFLOAD_BYTES = 256 << 10  # frames that cost more are checked and decoded on a worker thread
DECODE_THREADS = 2  # worker threads decoding at once, all channels together
TRAFFIC: Counter = Counter()  # (protocol, "sent" | "received") -> bytes, for this process's metrics
_limiter: trio.CapacityLimiter | None = None


class ChannelClosed(ConnectionError):
    """The other side went away (EOF, reset or a dead connection)."""


class FrameStalled(trio.TooSlowError):
    """A frame begun was not whole within the channel's frame timeout (sent half, or trickled)."""


def message_bytes(msg: Message) -> int:
    """The tensor bytes a decoded message holds."""
    return sum(t.nbytes for t in msg.tensors)


def _decode_limiter() -> trio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = trio.CapacityLimiter(DECODE_THREADS)
    return _limiter


class Channel:
    """Frames over a stream. With a `budget`, every frame's declared cost is taken from the peer's
    share before the frame is read past its header (flow control: past the share the stream is
    not read until room frees) and held until the caller releases it (`receive_held`). `encoding`: how
    the tensors of the frames it sends are packed (--wire-encoding; the receiver reads any)."""

    def __init__(self, read, write, close, protocol: str = "", budget: ByteBudget | None = None,
                 frame_timeout: float = FRAME_TIMEOUT, reset=None, encoding: str = DEFAULT_ENCODING) -> None:
        self._read, self._write, self._close, self._reset = read, write, close, reset
        self.protocol, self.encoding = protocol, encoding
        self.peer = ""  # the peer at the other end, where known
        self.budget, self.frame_timeout = budget, frame_timeout
        self.largest = 0  # the largest cost of a frame begun on this channel
        self.ended = False  # the peer's end of the stream was read (or the stream broke)
        self._decoder = Decoder()
        self._send_lock = trio.Lock()

    @classmethod
    def over_libp2p(cls, stream, protocol: str = "libp2p", encoding: str = DEFAULT_ENCODING) -> "Channel":
        return cls(stream.read, stream.write, stream.close, protocol,
                   reset=lambda linger: reset_stream(stream, linger), encoding=encoding)

    @classmethod
    def over_trio(cls, stream: trio.abc.Stream, protocol: str = "control") -> "Channel":
        return cls(stream.receive_some, stream.send_all, stream.aclose, protocol)

    async def send(self, msg: Message) -> None:
        """Write one frame. The write itself is shielded from cancellation (bounded by SEND_TIMEOUT):
        py-libp2p encrypts a Noise message before it writes it, so a write cancelled half-way leaves the
        connection's nonces out of step and kills the connection, every other stream on it too (seen in
        the relay: a circuit cut mid-write took down the relay's connection to the target)."""
        await self.send_bytes(encode(msg, self.encoding))

    async def send_bytes(self, data: bytes) -> None:
        """Write bytes already framed (or, in tests, deliberately not), as `send` writes a frame."""
        try:
            async with self._send_lock:
                with trio.CancelScope(shield=True), trio.fail_after(SEND_TIMEOUT):
                    await self._write(data)
            TRAFFIC[self.protocol, "sent"] += len(data)
        except trio.TooSlowError:
            raise ChannelClosed(f"send took over {SEND_TIMEOUT} s: the peer stopped reading") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ChannelClosed(f"send failed: {exc}") from None
        except Exception as exc:  # libp2p raises its own stream errors (StreamReset, StreamClosed, ...)
            if type(exc).__module__.startswith("libp2p"):
                raise ChannelClosed(f"send failed: {type(exc).__name__}: {exc}") from None
            raise

    async def receive(self, timeout: float) -> Message:
        """The next message; raises ChannelClosed at end of stream, trio.TooSlowError after timeout
        (`FrameStalled` when a frame began but did not finish in time), a `WireError` for bad bytes."""
        msg, held = await self.receive_held(timeout)
        held.release()
        return msg

    async def receive_held(self, timeout: float) -> tuple[Message, Held]:
        """`receive`, and the budget bytes its tensors hold until the caller releases them."""
        held = Held(self.budget, self.peer)
        try:
            with trio.fail_after(timeout):
                frame = await self._next_frame(held)
            if frame.head.cost > OFFLOAD_BYTES:  # checksum, zstd and copies off the event loop
                msg = await trio.to_thread.run_sync(self._decoder.decode, frame, limiter=_decode_limiter())
            else:
                msg = self._decoder.decode(frame)
        except BaseException:
            held.release()
            raise
        held.shrink(message_bytes(msg))  # the frame's wire bytes are gone, its tensors stay
        return msg, held

    async def _next_frame(self, held: Held) -> RawFrame:
        begun: float | None = None
        while True:
            head = self._decoder.head()
            if head is not None:
                begun = trio.current_time() if begun is None else begun
                self.largest = max(self.largest, head.cost)
                with trio.move_on_at(begun + self.frame_timeout) as waited:
                    try:
                        await held.grow(head.cost)
                    except OverBudget as exc:
                        raise FrameTooLarge(str(exc)) from None
                if waited.cancelled_caught:
                    raise FrameStalled(f"no room for a frame of {head.cost} bytes within {self.frame_timeout:g} s")
                frame = self._decoder.take()
                if frame is not None:
                    return frame
            with trio.move_on_at(float("inf") if begun is None else begun + self.frame_timeout) as waited:
                data = await self._read_some()
            if waited.cancelled_caught:
                raise FrameStalled(f"a frame of {head.body_len} bytes was not whole within {self.frame_timeout:g} s"
                                   f" ({self._decoder.buffered} bytes came)")
            if not data:
                self.ended = True
                self._decoder.close()  # raises TruncatedFrame if a frame was cut short
                raise ChannelClosed("end of stream")
            self._decoder.push(data)

    async def _read_some(self) -> bytes:
        try:
            data = await self._read(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.ended = True
            raise ChannelClosed(f"receive failed: {exc}") from None
        except Exception as exc:
            if type(exc).__module__.startswith("libp2p"):
                self.ended = True
                raise ChannelClosed(f"stream ended: {type(exc).__name__}") from None
            raise
        TRAFFIC[self.protocol, "received"] += len(data)
        return data

    async def aclose(self, reset: bool = False, linger: float = 0.0) -> None:
        """Close the stream; what was sent still reaches the peer. With `reset`, or in the middle of a
        frame (sent half, stalled, bad bytes), the stream is also reset `linger` seconds later: its peer
        stops sending, and what the transport buffered of it unread goes at once and at the reset (a
        reader that will not read again). The close comes first: py-libp2p's reader drops what it
        buffered at a reset unless the stream's end came before it."""
        reset = reset or self._decoder.buffered > 0
        self._decoder = Decoder(self._decoder.limits)  # nothing more is read: a half frame's bytes go now
        try:
            await self._close()
            if reset and self._reset is not None:
                await self._reset(linger)
        except Exception:  # closing a dead stream is not an error worth reporting
            pass


async def reset_stream(stream, linger: float = 0.0) -> None:
    """Reset a libp2p stream after `linger` seconds, dropping what py-libp2p's Yamux buffered of it
    unread now and then. py-libp2p 0.8.1 keeps a closed or reset stream's unread bytes for a 60 s
    grace, swept every 30 s: a peer that stopped 16 streams in the middle of 8 MB frames left ~30 MB
    held for that long after it left."""
    if not hasattr(stream, "reset"):  # meshd.testing's fake streams only close
        return
    _drop_unread(stream)
    await trio.sleep(linger)
    _drop_unread(stream)  # an empty buffer lets the reset drop the stream's entry at once
    try:
        await stream.reset()
    finally:
        _drop_unread(stream)


def _drop_unread(stream) -> None:
    muxed = getattr(stream, "muxed_stream", None)
    buffers = getattr(getattr(muxed, "conn", None), "stream_buffers", None)
    unread = buffers.get(getattr(muxed, "stream_id", None)) if isinstance(buffers, dict) else None
    if isinstance(unread, bytearray):
        unread.clear()
