"""Where each session's outputs go: its home stream, and the link to its next hop.

Rules: a session's tokens and errors go to the stream it was opened on (its home); its hidden states go
straight to the next hop when the entry names one this daemon can reach, over a link shared by every
session going there (`meshd/hop/links.py`), else home as well. The record of both is the session's
`links` (`meshd/hop/sessions.py`). A link that breaks loses its queued frames: each session whose frame
was lost is told (NEXT_HOP_FAILED, so its entry reroutes) and forwards no more over it.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio

from meshd.hop.links import Links, NextHops
from meshd.hop.sessions import SessionTable
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import Error, ErrorCode, Message, OpenSession

DIAL_TIMEOUT = 10.0  # reaching the next hop of a session

log = get_logger(__name__)


class Outputs:
    """The links of one shard's sessions: which stream each session's outputs leave on."""

    def __init__(self, sessions: SessionTable) -> None:
        self.sessions = sessions
        self.dial: Callable[[str, list[str]], Awaitable[Channel]] | None = None  # a stream to a peer (daemon)
        self.next_hops = NextHops(lambda peer, addrs: self.dial(peer, addrs))

    async def link(self, key: tuple[bytes, int], msg: OpenSession, home: Channel) -> bool:
        """Link a session just opened: home is `home`, and its hidden states go to the next hop the
        sender named when this daemon can reach it. Whether they do (else they go home too)."""
        links = self.sessions.get(key).links = Links(home)
        if msg.next_peer and self.dial is not None:
            try:
                with trio.fail_after(DIAL_TIMEOUT):
                    links.next = await self.next_hops.acquire(msg.next_peer, msg.next_addrs.split())
            except Exception as exc:  # unreachable from here (NAT, firewall): the sender relays instead
                log.info("next hop unreachable, outputs go back to the sender", peer=msg.next_peer[-8:],
                         error=f"{type(exc).__name__}: {exc}")
        return links.next is not None

    async def forward_to(self, key: tuple[bytes, int], peer: str, addrs, home: Channel) -> None:
        """Send session `key`'s outputs to `peer` over the link shared with the other sessions going
        there; `home` hears of a broken link."""
        session = self.sessions.get(key)
        if session is None:
            raise KeyError(f"session {key[0].hex()[:12]} is not open here")
        link = await self.next_hops.acquire(peer, list(addrs))
        await self.unlink(key)
        session.links = Links(home, next=link)

    async def deliver(self, msg: Message, reply: Message, channel: Channel) -> None:
        """Send a reply to its session's home stream; replies for frames of no linked session go back
        on the stream they came from."""
        links = self.sessions.links((getattr(msg, "session_id", b""), getattr(msg, "epoch", -1)))
        if links is None:
            await channel.send(reply)
            return
        try:
            await links.home.send(reply)
        except ChannelClosed:
            if links.home is channel:
                raise
            # the entry is gone: its stream's end releases the session

    async def flush(self, hops) -> None:
        """Send what waits on these links. Not cancelled half-way: the frames queued there are other
        sessions' too (every send is bounded by its own timeout)."""
        with trio.CancelScope(shield=True):
            for hop in hops:
                for frame in await hop.flush():
                    await self._lost(hop, frame)

    async def _lost(self, hop, frame) -> None:
        links = self.sessions.links((frame.session_id, frame.epoch))
        if links is None:
            return
        if links.next is hop:
            links.next = None
            await self.next_hops.release(hop)
        try:
            await links.home.send(Error(code=ErrorCode.NEXT_HOP_FAILED, retriable=True, session_id=frame.session_id,
                                        message=f"next hop {hop.peer[-8:]} unreachable: {hop.broken}"))
        except ChannelClosed:
            pass  # the entry is gone: its stream's end releases the session

    async def unlink(self, key: tuple[bytes, int]) -> None:
        """Forget where a session's outputs go, letting go of its share of a next hop's link."""
        session = self.sessions.get(key)
        if session is not None:
            links, session.links = session.links, None
            await self.let_go(links)

    async def let_go(self, links: Links | None) -> None:
        """Let go of the next hop's link a (former) record of a session's links holds, if any."""
        if links is not None and links.next is not None:
            await self.next_hops.release(links.next)
