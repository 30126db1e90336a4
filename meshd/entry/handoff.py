"""Handing a generation request to another entry (this daemon holds no layer 0, or is draining).

Rule: an entry that cannot be reached or refuses before any text (its record can lag behind it: an
entry that just stopped) is passed over for the next best (`choose_entry`: free sessions, then
latency and load), up to FORWARD_TRIES; once text has reached the client, a failure is the client's.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio

from meshd.entry.errors import GenerationError
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import ErrorCode, GenerateRequest, StreamEvent, WireError
from meshd.wire.protocols import GEN_PROTOCOL

REQUEST_TIMEOUT = 30.0
FORWARD_EVENT_TIMEOUT = 120.0
FORWARD_TRIES = 3  # entries tried for one forwarded request
log = get_logger(__name__)


async def hand_off(req: GenerateRequest, emit: Callable[[StreamEvent], Awaitable[None]], choose, open_stream) -> dict:
    """Run `req` on another entry, streaming its events to `emit`. `choose(tried)` names the entry to
    try next (a record, or None when none is left); `open_stream(peer, addrs, protocol)` reaches it."""
    tried: set[str] = set()
    while True:
        entry = choose(tried)
        if entry is None:
            raise GenerationError(ErrorCode.NO_ROUTE, "no live daemon serves layer 0 (no entry point)")
        texts = []

        async def passed_on(event: StreamEvent) -> None:
            texts.append(event)
            await emit(event)

        try:
            return await _run_on(entry, req, passed_on, open_stream)
        except GenerationError as exc:
            tried.add(entry.peer_id)
            if texts or exc.code not in (ErrorCode.HOP_FAILED, ErrorCode.BUSY) or len(tried) >= FORWARD_TRIES:
                raise
            log.info("entry failed; trying another", entry=entry.peer_id[-8:], error=str(exc))


async def _run_on(entry, req: GenerateRequest, emit, open_stream) -> dict:
    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            stream = await open_stream(entry.peer_id, entry.dial_addrs, GEN_PROTOCOL)
    except Exception as exc:
        raise GenerationError(ErrorCode.HOP_FAILED, f"entry {entry.peer_id[-8:]} unreachable: {exc}") from None
    remote = Channel.over_libp2p(stream, str(GEN_PROTOCOL))
    try:
        await remote.send(req)
        while True:
            try:
                event = await remote.receive(FORWARD_EVENT_TIMEOUT)
            except (ChannelClosed, trio.TooSlowError, WireError) as exc:
                raise GenerationError(ErrorCode.HOP_FAILED, f"entry stream failed: {exc}") from None
            if event.kind == "text":
                await emit(event)
            elif event.kind == "done":
                stats = dict(event.stats)
                stats["forwarded_to"] = entry.peer_id
                return stats
            else:
                raise GenerationError(event.stats.get("code", ErrorCode.HOP_FAILED), event.text)
    finally:
        with trio.CancelScope(shield=True):
            await remote.aclose()
