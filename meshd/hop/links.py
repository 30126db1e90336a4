"""Links from a hop to the hops after it: one long-lived stream per next daemon, shared by all the
sessions this daemon forwards there, carrying one `ForwardBatch` per pass.

Why: with a stream per session, a pass's N outputs left as N frames on N streams; the next hop
started a pass on the first one to arrive, and the batch split further at every hop. Frames that
leave together now arrive together, and the next hop submits them together.

Rules: outputs are queued in pass order (`put`, no await) and sent by whoever flushes while no
flush runs on that link, so a session's frames never overtake each other; frames a broken link
could not send are handed back to the caller, which tells their sessions' entries. A link is
closed when the last session using it lets go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import MAX_BATCH_FRAMES, Forward, ForwardBatch


class NextHop:
    """One stream to a next daemon and the frames waiting to go on it."""

    def __init__(self, peer: str, channel: Channel) -> None:
        self.peer, self.channel = peer, channel
        self.users = 0  # sessions forwarding over this link
        self.broken = ""  # why the stream failed; nothing more is sent on it
        self.sent_frames = 0  # ForwardBatch frames sent
        self.sent_outputs = 0  # session outputs they carried
        self._outbox: list[Forward] = []
        self._flushing = False

    def put(self, frame: Forward) -> None:
        self._outbox.append(frame)

    async def flush(self) -> list[Forward]:
        """Send every queued frame, as few ForwardBatch frames as fit; returns the frames that could
        not be sent because the link broke (now or before). A flush already running sends ours."""
        if self._flushing:
            return []
        self._flushing = True
        failed: list[Forward] = []
        try:
            while self._outbox:
                frames, self._outbox = self._outbox, []
                for i in range(0, len(frames), MAX_BATCH_FRAMES):
                    part = frames[i:i + MAX_BATCH_FRAMES]
                    if self.broken:
                        failed += part
                        continue
                    try:
                        await self.channel.send(ForwardBatch.of(part))
                        self.sent_frames += 1
                        self.sent_outputs += len(part)
                    except ChannelClosed as exc:
                        self.broken = str(exc) or "stream closed"
                        failed += part
        finally:
            self._flushing = False
        return failed


class NextHops:
    """The links of one daemon, by next peer: sessions going to the same peer share one."""

    def __init__(self, dial: Callable[[str, list[str]], Awaitable[Channel]]) -> None:
        self.dial = dial
        self._links: dict[str, NextHop] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def acquire(self, peer: str, addrs: list[str]) -> NextHop:
        """The live link to `peer`, dialled if there is none; the caller must `release` it."""
        async with self._locks.setdefault(peer, trio.Lock()):
            link = self._links.get(peer)
            if link is None or link.broken:
                link = self._links[peer] = NextHop(peer, await self.dial(peer, addrs))
            link.users += 1
            return link

    async def release(self, link: NextHop) -> None:
        link.users -= 1
        if link.users > 0:
            return
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            await link.channel.aclose()

    def __len__(self) -> int:
        return len(self._links)


@dataclass
class Links:
    """Where a session's outputs go."""

    home: Channel  # the stream it was opened on (the entry): tokens and errors
    next: NextHop | None = None  # the link to the next hop, when this hop forwards its hidden states
