"""meshd.wire frames over a byte stream: a libp2p stream or a trio stream (the control socket).

Rules: a channel reads only what it needs and never infers success from end-of-stream (a killed
peer, a clean close and a reset all look alike): the end of a conversation is an explicit frame.
Every receive takes a deadline.
"""

from __future__ import annotations

from collections import Counter

import trio

from meshd.wire import Decoder, Message, encode

READ_SIZE = 1 << 16
SEND_TIMEOUT = 10.0  # a peer that reads nothing for this long is as good as gone
TRAFFIC: Counter = Counter()  # (protocol, "sent" | "received") -> bytes, for this process's metrics


class ChannelClosed(ConnectionError):
    """The other side went away (EOF, reset or a dead connection)."""


class Channel:
    def __init__(self, read, write, close, protocol: str = "") -> None:
        self._read, self._write, self._close = read, write, close
        self.protocol = protocol
        self.peer = ""  # the peer at the other end, where known
        self._decoder = Decoder()
        self._pending: list[Message] = []
        self._send_lock = trio.Lock()

    @classmethod
    def over_libp2p(cls, stream, protocol: str = "libp2p") -> "Channel":
        return cls(stream.read, stream.write, stream.close, protocol)

    @classmethod
    def over_trio(cls, stream: trio.abc.Stream, protocol: str = "control") -> "Channel":
        return cls(stream.receive_some, stream.send_all, stream.aclose, protocol)

    async def send(self, msg: Message) -> None:
        """Write one frame. The write itself is shielded from cancellation (bounded by SEND_TIMEOUT):
        py-libp2p encrypts a Noise message before it writes it, so a write cancelled half-way leaves the
        connection's nonces out of step and kills the connection, every other stream on it too (seen in
        the relay: a circuit cut mid-write took down the relay's connection to the target)."""
        data = encode(msg)
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
        """The next message; raises ChannelClosed at end of stream, trio.TooSlowError after timeout."""
        with trio.fail_after(timeout):
            while not self._pending:
                try:
                    data = await self._read(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise ChannelClosed(f"receive failed: {exc}") from None
                except Exception as exc:
                    if type(exc).__module__.startswith("libp2p"):
                        raise ChannelClosed(f"stream ended: {type(exc).__name__}") from None
                    raise
                TRAFFIC[self.protocol, "received"] += len(data)
                if not data:
                    self._decoder.close()  # raises TruncatedFrame if a frame was cut short
                    raise ChannelClosed("end of stream")
                self._pending.extend(self._decoder.feed(data))
            return self._pending.pop(0)

    async def aclose(self) -> None:
        try:
            await self._close()
        except Exception:  # closing a dead stream is not an error worth reporting
            pass
