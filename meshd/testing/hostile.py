"""A hostile peer: one py-libp2p host that speaks meshd's shard protocol with frames built by
`meshd.wire`, for tests and benches that try a daemon as an attacker would.

Rule: every attack is a short async method that returns what the daemon answered (or how it
treated the attacker); nothing here waits without a deadline, and every stream it opens is closed
or reset when the attack ends. Measuring the daemon (RSS, heartbeat echo) is `RssSampler` and
`HostilePeer.echo_times`: the attacker's own view, which is what an honest entry sees too.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

from meshd import wire as w
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire.protocols import SHARD_PROTOCOL

REPLY_TIMEOUT = 30.0
STREAM_TIMEOUT = 5.0


def zeros_frame(session_id: bytes, raw_bytes: int, hidden: int, dtype: str = "float32", step: int = 0) -> bytes:
    """A Forward frame of `raw_bytes` of zero hidden states, zstd-packed (a few KB on the wire
    for tens of MB once inflated): the zstd bomb."""
    itemsize = w.DTYPES[dtype][0]
    n = max(1, raw_bytes // (hidden * itemsize))
    tensor = w.Tensor("hidden", (1, n, hidden), dtype, bytes(n * hidden * itemsize))
    return w.encode(w.Forward(session_id=session_id, epoch=0, step=step, phase=w.Phase.PREFILL, position=0,
                              tensors=(tensor,)), "zstd")


def half_frame(declared_raw: int, sent: int) -> bytes:
    """The first `sent` bytes of a raw frame that declares `declared_raw` payload bytes."""
    hidden = 576
    n = max(1, declared_raw // (hidden * 4))
    header_and_more = w.encode(w.Forward(session_id=b"h" * 16, epoch=0, step=0, phase=w.Phase.PREFILL,
                                         position=0, tensors=(w.Tensor("hidden", (1, n, hidden), "float32",
                                                                       bytes(n * hidden * 4)),)), "raw")
    return header_and_more[:sent]


@dataclass
class HostilePeer:
    host: object
    peer: object  # the daemon's peer id
    fingerprints: tuple[str, str] = ("", "")  # model, recipe: learnt from Hello
    streams: list = field(default_factory=list)

    async def open_stream(self) -> Channel:
        with trio.fail_after(REPLY_TIMEOUT):
            stream = await self.host.new_stream(self.peer, [SHARD_PROTOCOL])
        self.streams.append(stream)
        return Channel.over_libp2p(stream, "hostile")

    async def hello(self) -> tuple[str, str]:
        ch = await self.open_stream()
        await ch.send(w.Hello(agent="hostile"))
        reply = await ch.receive(REPLY_TIMEOUT)
        await ch.aclose()
        self.fingerprints = (reply.model_fingerprint, reply.recipe_fingerprint)
        return self.fingerprints

    async def open_session(self, ch: Channel, start: int, end: int, session_id: bytes | None = None,
                           max_length: int = 0) -> w.Message:
        model_fp, recipe_fp = self.fingerprints
        await ch.send(w.OpenSession(request_id=1, session_id=session_id or os.urandom(16), epoch=0, start=start,
                                    end=end, model_fingerprint=model_fp, recipe_fingerprint=recipe_fp,
                                    max_length=max_length))
        return await ch.receive(REPLY_TIMEOUT)

    async def zstd_bombs(self, count: int, raw_bytes: int, hidden: int, start: int, end: int,
                         dtype: str = "float32") -> list[w.Message]:
        """`count` zstd bombs of `raw_bytes` each, written at once on one session's stream; the
        replies (errors, mostly) read back until the stream ends or goes quiet."""
        ch = await self.open_stream()
        sid = os.urandom(16)
        opened = await self.open_session(ch, start, end, sid)
        frame = zeros_frame(sid, raw_bytes, hidden, dtype)
        replies: list[w.Message] = [opened]
        try:
            for _ in range(count):
                await ch.send_bytes(frame)
        except ChannelClosed:  # refused and reset: what the daemon answered first is still there to read
            pass
        try:
            with trio.move_on_after(REPLY_TIMEOUT):
                while len(replies) <= count:
                    replies.append(await ch.receive(REPLY_TIMEOUT))
        except ChannelClosed:
            pass
        await ch.aclose()
        return replies

    async def half_frames(self, streams: int, declared_raw: int, sent: int) -> list:
        """`streams` streams, each stopped `sent` bytes into a frame that declares `declared_raw`:
        the streams are left open (the caller ends them with `reset_all`)."""
        chunk = half_frame(declared_raw, sent)
        out: list = []

        async def one() -> None:
            ch = await self.open_stream()
            try:
                await ch.send_bytes(chunk)  # a stream the daemon stopped reading fails here
            except ChannelClosed as exc:
                out.append(exc)
                return
            out.append(ch)

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)
        return out

    async def flood_sessions(self, count: int, start: int, end: int) -> list[w.Message]:
        """Open `count` sessions on one stream (their KV promised), keeping them: the replies."""
        ch = await self.open_stream()
        replies = []
        for _ in range(count):
            try:
                replies.append(await self.open_session(ch, start, end))
            except (ChannelClosed, trio.TooSlowError) as exc:
                replies.append(exc)
                break
        return replies

    async def many_streams(self, count: int) -> tuple[int, int]:
        """Open up to `count` idle streams: how many opened, and how many the daemon closed at once."""
        opened = refused = 0
        for i in range(count):
            try:
                with trio.fail_after(STREAM_TIMEOUT):  # yamux's 257th stream on a connection never opens
                    stream = await self.host.new_stream(self.peer, [SHARD_PROTOCOL])
            except Exception:
                return opened, count - i
            self.streams.append(stream)
            ch = Channel.over_libp2p(stream, "hostile")
            try:
                await ch.send(w.Heartbeat(seq=i))
                reply = await ch.receive(STREAM_TIMEOUT)
            except (ChannelClosed, trio.TooSlowError):
                refused += 1
                continue
            if isinstance(reply, w.Error):
                refused += 1
            else:
                opened += 1
        return opened, refused

    async def wrong_dtype(self, dtype: str, hidden: int, start: int, end: int, positions: int = 4) -> w.Message:
        """One Forward of `positions` hidden states in `dtype` on a fresh session: the reply."""
        ch = await self.open_stream()
        sid = os.urandom(16)
        await self.open_session(ch, start, end, sid)
        itemsize = w.DTYPES[dtype][0]
        tensor = w.Tensor("hidden", (1, positions, hidden), dtype, bytes(positions * hidden * itemsize))
        await ch.send(w.Forward(session_id=sid, epoch=0, step=0, phase=w.Phase.PREFILL, position=0,
                                tensors=(tensor,)))
        reply = await ch.receive(REPLY_TIMEOUT)
        await ch.aclose()
        return reply

    async def offer_kv(self, start: int, end: int, positions: int = 64) -> list[w.Message]:
        """KV nobody asked for: a chunk under a made-up ticket, then a hand-over of someone else's session asked
        as if it were its entry, then a hand-over it asks of itself from a sender it names, whose KV comes from
        another peer (itself here, under the wrong name). The replies, in order."""
        ch = await self.open_stream()
        model_fp, recipe_fp = self.fingerprints
        k = w.Tensor("k", (end - start, 1, 3, positions, 64), "bfloat16", bytes((end - start) * 3 * positions * 64 * 2))
        v = w.Tensor("v", k.shape, k.dtype, k.data)
        await ch.send(w.KVChunk(ticket=os.urandom(16), position=0, tensors=(k, v)))
        out = [await ch.receive(REPLY_TIMEOUT)]
        await ch.send(w.HandOver(session_id=os.urandom(16), epoch=0, peer=str(self.host.get_id()), addrs="",
                                 ticket=os.urandom(16), positions=positions))
        out.append(await ch.receive(REPLY_TIMEOUT))
        ticket = os.urandom(16)
        await ch.send(w.AcceptKV(ticket=ticket, sender="12D3KooWsomebodyelse", start=start, end=end, rope_table=0,
                                 positions=positions, chain=os.urandom(16) * (positions // 16),
                                 model_fingerprint=model_fp, recipe_fingerprint=recipe_fp))
        out.append(await ch.receive(REPLY_TIMEOUT))
        await ch.send(w.KVChunk(ticket=ticket, position=0, tensors=(k, v)))
        out.append(await ch.receive(REPLY_TIMEOUT))
        await ch.aclose()
        return out

    async def echo_times(self, seconds: float, period: float = 0.1, channel: Channel | None = None) -> list[float]:
        """Heartbeat round trips on one stream (`channel`, else a new one) for `seconds`, as an
        entry pings a hop; a missing echo counts as the whole wait."""
        ch = channel or await self.open_stream()
        times: list[float] = []
        deadline = trio.current_time() + seconds
        nonce = 0
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            nonce += 1
            try:
                await ch.send(w.Heartbeat(seq=nonce))
                await ch.receive(REPLY_TIMEOUT)
            except (ChannelClosed, trio.TooSlowError):
                times.append(time.perf_counter() - t0)
                break
            times.append(time.perf_counter() - t0)
            await trio.sleep(period)
        await ch.aclose()
        return times

    async def reset_all(self) -> None:
        for stream in self.streams:
            try:
                await stream.reset()
            except Exception:  # already gone
                pass
        self.streams.clear()


@asynccontextmanager
async def open_hostile(addr: str) -> AsyncIterator[HostilePeer]:
    """A hostile peer connected to the daemon at `addr` (a /p2p/ multiaddr), fingerprints learnt."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from meshd.p2p.host import connect, open_host

    async with open_host(create_new_key_pair(), []) as host:
        peer = HostilePeer(host, await connect(host, addr))
        await peer.hello()
        try:
            yield peer
        finally:
            with trio.CancelScope(shield=True):
                await peer.reset_all()


def rss_bytes(pid: int) -> int:
    """A process's resident set size now."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


class RssSampler:
    """A process's RSS sampled every `period` seconds on a thread: `peak` since `start`."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.pid, self.period = pid, period
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RssSampler":
        self.peak = rss_bytes(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, ValueError):
                return


def settle_rss(pid: int, target: int, timeout: float) -> int:
    """Wait up to `timeout` s for a process's RSS to fall to `target` bytes; its RSS at the end."""
    deadline = time.monotonic() + timeout
    while (now := rss_bytes(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.25)
    return now

