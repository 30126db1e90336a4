"""One try at a generation over one route: the hops, the frames each holds unanswered, their
liveness, and the steps (prefill, decode, verification of drafts, replay) the entry drives through them.

Rules: one `Attempt` per generation and route, never shared, so concurrent generations cannot blame
each other's hops or mix their stats. Every wait has a deadline: a hop silent for SILENT_S (no frame,
no echo of a ping) is failed at once; hops that echo their pings get up to STEP_TIMEOUT a step,
however slowly they compute. The hop service it runs its own layers on is injected (`service`), and
the transport to the hops is whatever `Channel`s `add_hop` is given (and the service's link to the
first hop, when `linked`: opened by `meshd/entry/opening.py`), so tests drive it over memory channels
and trio's MockClock.
"""

from __future__ import annotations

import itertools
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator

import trio

from meshd.entry.errors import GenerationError, HopFailed, hop_error
from meshd.entry.state import Generation
from meshd.hop.endpoint import token_frame
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import (DEFAULT_CHUNK_TOKENS, Error, ErrorCode, Forward, HandedOver, Heartbeat, Leaving, Message,
                        Phase, Token, WireError, chunk_spans)

STEP_TIMEOUT = 60.0  # the longest a step may take on hops that answer their liveness pings
HEARTBEAT_S = 0.25  # how often the entry pings each hop of a running generation
SILENT_S = 1.5  # a hop that answers nothing (no ping, no frame) for this long is failed: a frozen hop
# costs the client under 2.5 s, with a margin for event loops slowed by a loaded machine
log = get_logger(__name__)


class LinkErrors:
    """Where the service reports a broken link to the first hop: into the attempt's token queue,
    which raises it as that hop's failure (the stand-in for a session's home stream)."""

    def __init__(self, queue: trio.MemorySendChannel) -> None:
        self.queue = queue

    async def send(self, msg: Message) -> None:
        try:
            self.queue.send_nowait(msg)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a full queue has tokens the attempt reads first; a closed one, no attempt left


class Attempt:
    """One try at a generation over one route: its hops, the frames each holds unanswered, its
    deadlines and the time it spends. Rule: one per generation and route, never shared, so
    concurrent generations cannot blame each other's hops or mix their stats."""

    def __init__(self, service, generation: Generation, sid: bytes, epoch: int,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.service, self.generation, self.sid, self.epoch = service, generation, sid, epoch
        self.chunk_tokens = chunk_tokens  # prompt tokens per prefill chunk (--chunk-tokens)
        self.hops: list[tuple[str, Channel]] = []
        self.forwards: list[bool] = []  # per hop: it sends its output to the next hop itself
        self.pending: dict[str, int] = {}  # frames a hop holds or will hold, not yet answered
        self.heard: dict[str, float] = {}  # when each hop last said anything (a frame or a ping's echo)
        self.tokens_send, self.tokens_recv = trio.open_memory_channel[Token | Error](16)
        self.linked = False  # the entry's own outputs go to the first hop over the service's shared link (set by
        # whoever opened the route: see meshd/entry/opening.py)
        self.last_token: Token | None = None  # the tail's last answer (its sketches, when asked for)
        self.reused: int | None = None  # prompt positions every session of the route holds already (the least of
        # what each opened with: see meshd/shard/prefix.py); the prefill starts there
        self.completed = False  # the generation finished on this route: its hops may keep its KV
        self.leaving: list[str] = []  # hops that said they leave (`Leaving`), in the order they said it
        self.left = trio.Event()  # set at each of them (then replaced)
        self.handed: dict[str, HandedOver] = {}  # how each leaving hop's hand-over ended, once it has
        self.handed_event = trio.Event()  # set at each answer (then replaced)
        self.move = None  # the `Moved` that ends this try at the next step boundary (meshd/entry/opening.py)

    def opened_with(self, reused: int) -> None:
        """One more session of the route opened holding `reused` positions of the prompt."""
        self.reused = reused if self.reused is None else min(self.reused, reused)

    def add_hop(self, peer: str, channel: Channel, forwards: bool = False) -> None:
        self.hops.append((peer, channel))
        self.forwards.append(forwards)
        self.pending[peer] = 0
        self.heard[peer] = trio.current_time()

    def segment(self, i: int) -> list[str]:
        """The hops a frame sent to hop i passes before an answer comes back to the entry."""
        out = [self.hops[i][0]]
        while self.forwards[i] and i + 1 < len(self.hops):
            i += 1
            out.append(self.hops[i][0])
        return out

    def segment_ending(self, peer: str) -> list[str]:
        """The hops whose frame an answer from `peer` completes."""
        i = self.index(peer)
        while i > 0 and self.forwards[i - 1]:
            i -= 1
        return self.segment(i)

    def index(self, peer: str) -> int:
        return next(i for i, (p, _) in enumerate(self.hops) if p == peer)

    async def keepalive(self) -> None:
        """Ping every hop not heard from lately; a hop's event loop echoes pings even while its
        compute thread is busy. A hop that answered a frame in the last period is plainly alive:
        pinging it too would cost a frame each way per hop and session, at 8 sessions about as many
        frames as the tokens themselves."""
        for seq in itertools.count():
            now = trio.current_time()
            for peer, channel in self.hops:
                if now - self.heard[peer] < HEARTBEAT_S:
                    continue
                try:
                    await channel.send(Heartbeat(seq=seq))
                except ChannelClosed as exc:
                    raise HopFailed(peer, f"stream closed: {exc}") from None
            await trio.sleep(HEARTBEAT_S)

    def silent_hop(self) -> str | None:
        """A hop that has said nothing for SILENT_S, those holding frames first."""
        now = trio.current_time()
        silent = [peer for peer, _ in self.hops if now - self.heard[peer] > SILENT_S]
        return next((p for p in silent if self.pending[p] > 0), silent[0] if silent else None)

    async def pump(self, peer: str, channel: Channel, nxt: tuple[str, Channel] | None) -> None:
        """Move one hop's outputs on: hidden states to the next hop, tokens to the entry."""
        while True:
            try:
                msg = await channel.receive(STEP_TIMEOUT * 10)
            except (ChannelClosed, WireError, trio.TooSlowError) as exc:
                raise HopFailed(peer, str(exc) or type(exc).__name__) from None
            self.heard[peer] = trio.current_time()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, (Leaving, HandedOver)):
                self.hand_over_news(peer, msg)
                continue
            if isinstance(msg, Error):  # mid-generation: another route may well do
                i = self.index(peer)
                if msg.code == ErrorCode.NEXT_HOP_FAILED and i + 1 < len(self.hops):
                    raise HopFailed(self.hops[i + 1][0], f"unreachable from the hop before: {msg.message}")
                raise hop_error(peer, msg, retriable=True)
            if isinstance(msg, (Token, Forward)):
                for p in self.segment_ending(peer):  # each of them computed this frame: all alive
                    self.pending[p] -= 1
                    self.heard[p] = self.heard[peer]
            if isinstance(msg, Token):
                if self.service is not None:  # its next step comes at once: see ShardService.expect
                    self.service.expect((self.sid, self.epoch), (peer, msg.pass_id), msg.pass_size)
                await self.tokens_send.send(msg)  # tokens_recv also gets link errors: see LinkErrors
            elif isinstance(msg, Forward) and nxt is not None:
                await self.send(nxt[0], nxt[1], msg)

    def hand_over_news(self, peer: str, msg: Leaving | HandedOver) -> None:
        """A hop says it leaves, or how the hand-over of its session went (`meshd/hop/handover.py`)."""
        if (msg.session_id, msg.epoch) != (self.sid, self.epoch):
            return
        if isinstance(msg, Leaving):
            if peer not in self.leaving:
                self.leaving.append(peer)
                woken, self.left = self.left, trio.Event()
                woken.set()
            return
        self.handed[peer] = msg
        woken, self.handed_event = self.handed_event, trio.Event()
        woken.set()

    async def handed_over(self, peer: str, timeout: float) -> HandedOver | None:
        """How `peer`'s hand-over ended (None: no answer within `timeout`)."""
        with trio.move_on_after(timeout):
            while peer not in self.handed:
                await self.handed_event.wait()
        return self.handed.get(peer)

    async def send(self, peer: str, channel: Channel, msg: Message) -> None:
        try:
            await channel.send(msg)
        except ChannelClosed as exc:
            raise HopFailed(peer, f"stream closed: {exc}") from None
        for p in self.segment(self.index(peer)):
            self.pending[p] += 1

    def sent_on_link(self) -> None:
        """The service sent the entry's output to the first hop over the link: count it held there."""
        for p in self.segment(0):
            self.pending[p] += 1

    async def local(self, frame: Forward) -> Message | None:
        t0 = time.perf_counter()
        replies = await self.service.handle(frame)
        self.generation.local_s += time.perf_counter() - t0
        if replies and isinstance(replies[0], Error):
            raise GenerationError(replies[0].code, replies[0].message)
        return replies[0] if replies else None

    async def step(self, step, phase, position, ids, chunk=(0, 1)) -> int | None:
        reply = await self.advance(step, phase, position, ids, chunk)
        return None if reply is None else reply.token_id

    async def advance(self, step, phase, position, ids, chunk=(0, 1), extra=()) -> Token | None:
        """Send one frame of token ids down the route; the tail's Token (None for a prefill chunk
        before the last). A VERIFY frame's Token says how many of its drafts (ids[1:]) it accepts.
        `extra` tensors travel with the frame (a sketch request: meshd/hop/sketch.py)."""
        local = await self.submit(step, phase, position, ids, chunk, extra)
        if local is not None:
            return local
        if phase == Phase.PREFILL and chunk[0] != chunk[1] - 1:
            return None
        return await self.next_reply(STEP_TIMEOUT)

    async def submit(self, step, phase, position, ids, chunk=(0, 1), extra=()) -> Token | None:
        """Run a frame through this daemon's layers and send it on without waiting for the answer;
        the Token when the entry holds the whole model (else it comes from the tail later)."""
        frame = token_frame(self.sid, self.epoch, step, phase, position, ids, *chunk)
        if extra:
            frame = replace(frame, tensors=frame.tensors + tuple(extra))
        out = await self.local(frame)
        if isinstance(out, Token):
            self.last_token = out
            return out
        if out is not None:
            await self.send(*self.hops[0], out)
        elif self.linked:
            self.sent_on_link()
        return None

    async def past_here(self, frame: Forward) -> Token:
        """Send a frame of hidden states this daemon's layers gave already to the first hop; the tail's Token."""
        await self.send(*self.hops[0], frame)
        return await self.next_reply(STEP_TIMEOUT)

    def alone_here(self) -> bool:
        """The route is this daemon's own layers, and no other session is open on them."""
        return not self.hops and self.service is not None and len(self.service.endpoint.sessions) == 1

    @asynccontextmanager
    async def run_here(self, step, position, token, steps, stop) -> AsyncIterator[AsyncIterator[int]]:
        """Plain decode steps back to back on this daemon's compute thread (`ShardService.decode_run`),
        the first fed `token` at `position`: the token ids as they come. A route of this daemon alone."""
        def frame_of(i: int, fed: int) -> Forward:
            return token_frame(self.sid, self.epoch, step + i, Phase.DECODE, position + i, [fed])

        async def tokens(replies) -> AsyncIterator[int]:
            async for out, took in replies:
                self.generation.local_s += took
                if out and isinstance(out[0], Error):
                    raise GenerationError(out[0].code, out[0].message)
                if not out or not isinstance(out[0], Token):
                    raise GenerationError(ErrorCode.INTERNAL, f"a decode step answered {out!r}")
                self.last_token = out[0]
                yield out[0].token_id

        async with self.service.decode_run(frame_of, token, steps, stop) as replies:
            yield tokens(replies)

    async def prefill(self, ids, start: int = 0, extra=()) -> int:
        """The prompt `ids` through the route from position `start` (its sessions hold the positions
        before it: kept KV), in chunks; the token after it (`extra` tensors go with the last chunk)."""
        spans = [(a + start, b + start) for a, b in chunk_spans(len(ids) - start, self.chunk_tokens)]
        reply = None
        for ci, (a, b) in enumerate(spans):
            reply = await self.advance(0, Phase.PREFILL, a, ids[a:b], (ci, len(spans)),
                                       extra if ci == len(spans) - 1 else ())
        assert reply is not None
        return reply.token_id

    async def replay(self, tokens, position, extra=()) -> int:
        """Run the tokens generated before a reroute through the new route so that every hop computes
        bit for bit what the lost route computed, and return the token after the last one (seeded
        sampling draws from the position, so it is the token the lost route would have given). They
        go as decode frames of prefill-sized chunks, whose positions every hop computes as the decode
        steps they first were (`Phase.DECODE`), so the pause does not grow with the text so far."""
        spans = chunk_spans(len(tokens), self.chunk_tokens)
        outs = []  # the token after each chunk; all chunks are sent at once (they pipeline down the route)
        for i, (a, b) in enumerate(spans):
            local = await self.submit(a + 1, Phase.DECODE, position + a, list(tokens[a:b]),
                                      extra=extra if i == len(spans) - 1 else ())
            if local is not None:
                outs.append(local.token_id)
        while len(outs) < len(spans):
            outs.append(await self.next_token(STEP_TIMEOUT))
        if outs[:-1] != [tokens[b] for _, b in spans[:-1]]:
            log.warning("replay diverged from the first route", positions=len(tokens))
        return outs[-1]

    async def next_token(self, timeout: float) -> int:
        return (await self.next_reply(timeout)).token_id

    async def next_reply(self, timeout: float) -> Token:
        """The tail's next Token. A hop silent for SILENT_S is failed at once; hops that echo
        their pings are given up to `timeout`, however slowly they compute."""
        t0 = time.perf_counter()
        deadline = trio.current_time() + timeout
        try:
            while True:
                with trio.move_on_after(min(HEARTBEAT_S, max(0.0, deadline - trio.current_time()))):
                    msg = await self.tokens_recv.receive()
                    if isinstance(msg, Error):  # the link to the first hop broke
                        raise hop_error(self.hops[0][0], msg, retriable=True)
                    self.last_token = msg
                    return msg
                silent = self.silent_hop() if self.hops else None
                if silent is not None:
                    raise HopFailed(silent, f"silent for {trio.current_time() - self.heard[silent]:.1f} s")
                if trio.current_time() >= deadline:
                    # blame the first hop that holds a frame it has not answered: the stall is there
                    stalled = next((peer for peer, _ in self.hops if self.pending.get(peer, 0) > 0),
                                   self.hops[-1][0] if self.hops else "entry")
                    raise HopFailed(stalled, f"no answer within {timeout:.1f} s")
        finally:
            self.generation.wait_s += time.perf_counter() - t0


async def first_token(at: Attempt, extra=(), generated: int | None = None) -> int:
    """The prompt through the route (on a longrope model's long table, with the tokens generated before it took
    over), then (after a reroute) the tokens so far: the token after them (`extra` tensors go with the last
    frame: a sketch request). `generated`: how many of the tokens so far (default all: another task may be
    adding to them)."""
    gen = at.generation
    prefill, fed_back, start = gen.prefill_ids, gen.fed_back, gen.start_at
    if generated is not None:
        fed_back = fed_back[:max(0, generated - (gen.long_from or 0))]
    if start >= len(prefill):  # the route holds the prompt and some generated tokens (a hand-over's KV)
        return await at.replay(fed_back[start - len(prefill):], start, extra)
    token = await at.prefill(prefill, start, () if fed_back else extra)  # from what every session holds already
    if fed_back:  # a replay after rerouting feeds back what was generated
        token = await at.replay(fed_back, len(prefill), extra)
    return token
