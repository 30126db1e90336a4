"""Generation at an entry daemon: plan a route, open a session on every hop, pipeline, stream text.

Rules: the entry runs its own layers [0, k) and holds one long-lived stream per further hop (its
sessions, pings and errors). Hidden states go from hop to hop: each hop is told the next one and
sends its output there, and the tail's token comes back to the entry, one transfer a hop a token.
A hop that cannot reach its next hop sends its output back instead, and the entry passes it on.
Prefill chunks overlap across stages. Generations are spread over microbatches (`Microbatches`)
that hops never mix in a pass, and a token's text goes to the client while its next step already
runs. Every wait has a deadline. A hop that fails makes the entry plan a new route (new epoch)
without that peer and replay the prompt and the tokens so far: the client sees a pause, not an
error, while the mesh still covers the model. Close, cancel or a vanished client release the KV on
every hop.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from meshd.node.log import get_logger
from meshd.hop.links import Links
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.entry.route import link_latency, NoRoute, Route, plan_route
from meshd.hop.endpoint import token_frame
from meshd.wire.protocols import SHARD_PROTOCOL
from meshd.shard.tokenizer import TextStream, encode_messages, encode_prompt
from meshd.wire import (Close, Error, ErrorCode, Forward, GenerateRequest, Heartbeat, Message, OpenSession, Opened,
                        Phase, StreamEvent, Token, WireError, chunk_spans)

OPEN_TIMEOUT = 30.0
STEP_TIMEOUT = 60.0  # the longest a step may take on hops that answer their liveness pings
REPLAY_WINDOW = 8  # decode steps in flight while replaying after a reroute
HEARTBEAT_S = 0.25  # how often the entry pings each hop of a running generation
SILENT_S = 1.5  # a hop that answers nothing (no ping, no frame) for this long is failed: a frozen hop
# costs the client under 2.5 s, with a margin for event loops slowed by a loaded machine
MAX_ATTEMPTS = 3  # routes tried after hop failures (busy hops do not count)
BUSY_WAIT_S = 30.0  # how long a generation waits for a full mesh before "mesh busy"
BUSY_RETRY_S = 0.5  # the wait before trying a full mesh again, when a busy hop gives no hint
log = get_logger(__name__)


class HopFailed(RuntimeError):
    def __init__(self, peer_id: str, reason: str, retriable: bool = True, busy_s: float | None = None):
        self.peer_id, self.retriable = peer_id, retriable
        self.busy_s = busy_s  # set when the hop is alive but full: try again after this long
        super().__init__(f"hop {peer_id[-8:]} {'is busy' if busy_s is not None else 'failed'}: {reason}")


def hop_error(peer_id: str, err: Error, retriable: bool = False) -> HopFailed:
    """The HopFailed an Error frame from a hop means: `busy` is not a failure of the hop."""
    if err.code == ErrorCode.BUSY:
        return HopFailed(peer_id, err.message, busy_s=err.retry_after_s or BUSY_RETRY_S)
    return HopFailed(peer_id, f"{err.code}: {err.message}",
                     retriable=retriable or err.retriable or err.code == ErrorCode.UNKNOWN_SESSION)


class GenerationError(RuntimeError):
    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


@dataclass
class Progress:
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    route: list = field(default_factory=list)
    reroutes: int = 0
    local_s: float = 0.0  # time in the entry's own layers
    wait_s: float = 0.0  # time waiting for the rest of the route
    emitted: bool = False  # some text has reached the client


Emit = Callable[[StreamEvent], Awaitable[None]]


def first_of(group: BaseExceptionGroup) -> BaseException:
    """The error that matters in a task group: a generation or hop error if any, else the group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = first_of(exc)
        if isinstance(exc, (HopFailed, GenerationError)):
            return exc
    return group


class Entry:
    """Runs generations for a daemon that serves layer 0."""

    def __init__(self, daemon, busy_wait_s: float = BUSY_WAIT_S, forwarding: bool = True,
                 microbatches: int = 2) -> None:
        self.daemon = daemon
        self.busy_wait_s = busy_wait_s
        self.forwarding = forwarding  # ask hops to pass hidden states on themselves (else the entry relays)
        self.microbatches = microbatches  # spread generations over so many, at most one per daemon on the route
        # (0: exactly one per daemon on the route)
        self.microbatch_use = Microbatches()

    async def generate(self, req: GenerateRequest, emit: Emit) -> dict:
        d = self.daemon
        try:
            ids = (encode_messages(d.tokenizer, json.loads(req.messages)) if req.messages
                   else encode_prompt(d.tokenizer, req.prompt, req.chat))
        except (ValueError, TypeError, KeyError) as exc:  # a bad conversation, or no chat template
            raise GenerationError(ErrorCode.BAD_FRAME, f"cannot encode the prompt: {exc}") from None
        eos = set() if req.ignore_eos else {i for i in (d.artifact.config.eos_id, d.tokenizer.eos_token_id)
                                              if i is not None}
        limit = d.artifact.config.max_positions - len(ids)
        if limit <= 0:
            raise GenerationError(ErrorCode.BAD_FRAME, f"prompt of {len(ids)} tokens exceeds the context")
        max_tokens = max(0, min(req.max_tokens, limit))
        text = TextStream(d.tokenizer)
        progress = Progress()
        t0 = time.perf_counter()
        exclude: set[str] = set()  # hops that failed: not tried again by this generation
        busy: set[str] = set()  # hops that said they are full: skipped until the next wait
        failures, epoch = 0, 0
        deadline = trio.current_time() + self.busy_wait_s
        while True:
            try:
                try:
                    await self._attempt(req, ids, max_tokens, eos, epoch, exclude, busy, progress, text, emit)
                except BaseExceptionGroup as group:  # trio wraps errors of concurrent tasks
                    raise first_of(group) from None
                break
            except HopFailed as exc:
                epoch += 1
                if exc.busy_s is not None:  # alive but full: another route now, else wait below
                    log.info("hop busy, trying another route", peer=exc.peer_id[-8:])
                    busy.add(exc.peer_id)
                    continue
                log.warning("hop failed, rerouting", error=str(exc), attempt=failures)
                failures += 1
                if not exc.retriable or failures == MAX_ATTEMPTS:
                    raise GenerationError(ErrorCode.HOP_FAILED, str(exc)) from None
                exclude.add(exc.peer_id)
                progress.reroutes += 1  # replan at once from the records at hand, without that peer
            except GenerationError as exc:
                # every route left runs through a full hop, or this daemon's own layers are full
                if not (exc.code == ErrorCode.BUSY or (exc.code == ErrorCode.NO_ROUTE and busy)):
                    raise
                left = deadline - trio.current_time()
                if left <= 0:
                    raise GenerationError(ErrorCode.BUSY, f"mesh busy: no route had room within {self.busy_wait_s:g} s"
                                          f" ({exc})") from None
                epoch += 1
                await trio.sleep(min(left, BUSY_RETRY_S))
                busy.clear()
        end = time.perf_counter()
        n = len(progress.tokens)
        first = progress.first_token_at or end
        log.info("generation done", tokens=n, prompt_tokens=len(ids), reroutes=progress.reroutes,
                 seconds=round(end - t0, 3))
        return {"ttft_s": round(first - t0, 4), "tokens": n, "prompt_tokens": len(ids),
                "decode_tok_per_s": round((n - 1) / (end - first), 2) if n > 1 and end > first else None,
                "route": progress.route, "reroutes": progress.reroutes,
                "entry_compute_s": round(progress.local_s, 3), "route_wait_s": round(progress.wait_s, 3)}

    def _plan(self, failed: set[str], busy: set[str]) -> Route:
        """A route around the hops that failed and those that are full. Where only a failed hop
        covers some layers it is tried again (a broken stream is not always a dead peer; the
        generation's bounded attempts stop a hop that keeps failing)."""
        d = self.daemon
        coverage = d.mesh.coverage.serving()
        links = link_latency(coverage.records, dict(d.mesh.latency))
        plan = lambda skip: plan_route(coverage, d.shard.end, latency=links,  # noqa: E731
                                       exclude=skip | {d.mesh.peer_id})
        try:
            return plan(failed | busy)
        except NoRoute as exc:
            if failed:
                try:
                    route = plan(busy)
                    log.info("retrying a failed hop: no other covers its layers", hops=len(route.hops))
                    return route
                except NoRoute:
                    pass
            raise GenerationError(ErrorCode.NO_ROUTE, str(exc)) from None

    async def _attempt(self, req, ids, max_tokens, eos, epoch, failed, busy, progress: Progress, text, emit) -> None:
        d = self.daemon
        route = self._plan(failed, busy)
        progress.route = [[d.mesh.peer_id, 0, d.shard.end]] + route.describe()
        sid = os.urandom(16)
        at = Attempt(d.service, progress, sid, epoch)  # this try's own state: nothing shared between generations
        local_key = (sid, epoch)
        daemons = len(route.hops) + 1
        microbatch = self.microbatch_use.take(min(self.microbatches, daemons) if self.microbatches else daemons)
        try:
            async with trio.open_nursery() as nursery:
                await self._open_local(sid, epoch, req, ids, max_tokens, microbatch)
                for i, hop in enumerate(route.hops):
                    nxt = route.hops[i + 1] if i + 1 < len(route.hops) else None
                    at.add_hop(hop.peer_id, *await self._open_hop(hop, sid, epoch, req, len(ids) + max_tokens, nxt,
                                                                  microbatch))
                if at.hops and self.forwarding:
                    await at.link_first_hop(route.hops[0].addrs)
                for i, (peer, channel) in enumerate(at.hops):
                    nxt = at.hops[i + 1] if i + 1 < len(at.hops) else None
                    nursery.start_soon(at.pump, peer, channel, nxt)
                if at.hops:
                    nursery.start_soon(at.keepalive)
                token = await at.prefill(ids)
                position = len(ids)
                if progress.tokens:  # a replay after rerouting feeds back what was generated
                    token = await at.replay(progress.tokens, position)
                    position += len(progress.tokens)
                while len(progress.tokens) < max_tokens:
                    if progress.first_token_at is None:
                        progress.first_token_at = time.perf_counter()
                    progress.tokens.append(token)
                    if token in eos or len(progress.tokens) >= max_tokens:
                        await self._emit(req, ids, progress, text, token, emit)
                        break
                    # the next step is under way (submitted to this daemon's pass) before the client
                    # is sent this token's text: writing to the client no longer delays every pass here
                    async with trio.open_nursery() as overlap:
                        overlap.start_soon(self._emit, req, ids, progress, text, token, emit)
                        token = await at.step(len(progress.tokens), Phase.DECODE, position, [token])
                    position += 1
                nursery.cancel_scope.cancel()
        finally:
            self.microbatch_use.give(microbatch)
            with trio.CancelScope(shield=True):
                await at.service.release(local_key)  # the shard it opened on, even after a move
                with trio.move_on_after(2.0):
                    for _, channel in at.hops:
                        try:
                            await channel.send(Close(session_id=sid, epoch=epoch))
                        except ChannelClosed:
                            pass
                        await channel.aclose()

    @staticmethod
    async def _emit(req, ids, progress: Progress, text, token: int, emit) -> None:
        """Send a generated token's text to the client. Not cancelled half-way by a hop failing
        meanwhile: the token counts as generated, and a reroute does not send its text again."""
        piece = text.push(token)
        if piece:  # the first text also says how long the prompt was (for usage counts)
            first = {"prompt_tokens": len(ids)} if not progress.emitted else {}
            progress.emitted = True
            with trio.CancelScope(shield=True):
                await emit(StreamEvent(request_id=req.request_id, kind="text", text=piece, token_id=token,
                                       stats=first))

    async def _open_local(self, sid, epoch, req, ids, max_tokens, microbatch=0) -> None:
        d = self.daemon
        reply = await d.service.handle(self._open_msg(sid, epoch, 0, d.shard.end, req, len(ids) + max_tokens,
                                                      microbatch=microbatch))
        if not isinstance(reply[0], Opened):
            raise GenerationError(reply[0].code, reply[0].message)  # `busy`: waited on by generate

    def _open_msg(self, sid, epoch, start, end, req, max_length, nxt=None, microbatch=0) -> OpenSession:
        d = self.daemon
        return OpenSession(request_id=req.request_id, session_id=sid, epoch=epoch, start=start, end=end,
                           model_fingerprint=d.artifact.fingerprint, recipe_fingerprint=d.recipe_fp,
                           max_length=max_length, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                           seed=req.seed, next_peer=nxt.peer_id if nxt and self.forwarding else "",
                           next_addrs=" ".join(nxt.addrs) if nxt and self.forwarding else "", microbatch=microbatch)

    async def _open_hop(self, hop, sid, epoch, req, max_length, nxt=None, microbatch=0) -> tuple[Channel, bool]:
        """A session on a hop: its stream, and whether the hop sends its output on to `nxt` itself."""
        d = self.daemon
        try:
            with trio.fail_after(OPEN_TIMEOUT):
                stream = await d.dialer.open_stream(hop.peer_id, hop.addrs, SHARD_PROTOCOL)
                channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL))
                await channel.send(self._open_msg(sid, epoch, hop.start, hop.end, req, max_length, nxt, microbatch))
                reply = await channel.receive(OPEN_TIMEOUT)
        except (trio.TooSlowError, ChannelClosed, WireError, OSError) as exc:
            raise HopFailed(hop.peer_id, f"could not open a session: {exc or type(exc).__name__}") from None
        except Exception as exc:  # libp2p dial and negotiation errors
            raise HopFailed(hop.peer_id, f"could not open a session: {type(exc).__name__}: {exc}") from None
        if isinstance(reply, Error):
            raise hop_error(hop.peer_id, reply)
        if not isinstance(reply, Opened):
            raise HopFailed(hop.peer_id, f"answered OpenSession with {type(reply).__name__}")
        return channel, reply.forwarding and nxt is not None


class Microbatches:
    """How many generations run in each microbatch. A new generation takes the least used of the first
    n, so that n groups move down the route apart: while one group computes at a daemon, the others
    are at other daemons (or on the wire), and a daemon has a pass to run while work waits elsewhere
    (see meshd/hop/scheduler.py)."""

    def __init__(self) -> None:
        self.used: dict[int, int] = {}

    def take(self, n: int) -> int:
        microbatch = min(range(max(1, n)), key=lambda i: (self.used.get(i, 0), i))
        self.used[microbatch] = self.used.get(microbatch, 0) + 1
        return microbatch

    def give(self, microbatch: int) -> None:
        self.used[microbatch] -= 1
        if not self.used[microbatch]:
            del self.used[microbatch]

    def counts(self) -> list[int]:
        """Generations in microbatch 0, 1, ... up to the highest in use ([] when none runs)."""
        return [self.used.get(i, 0) for i in range(max(self.used, default=-1) + 1)]


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

    def __init__(self, service, progress: Progress, sid: bytes, epoch: int) -> None:
        self.service, self.progress, self.sid, self.epoch = service, progress, sid, epoch
        self.hops: list[tuple[str, Channel]] = []
        self.forwards: list[bool] = []  # per hop: it sends its output to the next hop itself
        self.pending: dict[str, int] = {}  # frames a hop holds or will hold, not yet answered
        self.heard: dict[str, float] = {}  # when each hop last said anything (a frame or a ping's echo)
        self.tokens_send, self.tokens_recv = trio.open_memory_channel[Token | Error](16)
        self.linked = False  # the entry's own outputs go to the first hop over the service's shared link

    async def link_first_hop(self, addrs) -> None:
        """Send the entry's own outputs to the first hop the way hops send theirs: with those of the
        other generations of the same pass, as one frame on one link (see `meshd/hop/links.py`). A
        link that breaks reports here, as an Error from the first hop."""
        peer = self.hops[0][0]
        try:
            with trio.fail_after(OPEN_TIMEOUT):
                link = await self.service.next_hops.acquire(peer, addrs)
        except Exception as exc:  # the session stream still works: send on it instead
            log.info("no link to the first hop, sending on the session stream", peer=peer[-8:],
                     error=f"{type(exc).__name__}: {exc}")
            return
        self.service.links[(self.sid, self.epoch)] = Links(home=LinkErrors(self.tokens_send), next=link)
        self.linked = True

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
        self.progress.local_s += time.perf_counter() - t0
        if replies and isinstance(replies[0], Error):
            raise GenerationError(replies[0].code, replies[0].message)
        return replies[0] if replies else None

    async def step(self, step, phase, position, ids, chunk=(0, 1)) -> int | None:
        out = await self.local(token_frame(self.sid, self.epoch, step, phase, position, ids, *chunk))
        if isinstance(out, Token):
            return out.token_id
        if out is not None:
            await self.send(*self.hops[0], out)
        elif self.linked:
            self.sent_on_link()
        if phase == Phase.PREFILL and chunk[0] != chunk[1] - 1:
            return None
        return await self.next_token(STEP_TIMEOUT)

    async def prefill(self, ids) -> int:
        spans = chunk_spans(len(ids))
        token = None
        for ci, (a, b) in enumerate(spans):
            token = await self.step(0, Phase.PREFILL, a, ids[a:b], (ci, len(spans)))
        assert token is not None
        return token

    async def replay(self, tokens, position) -> int:
        """Run the tokens generated before a reroute through the new route so that every hop computes
        bit for bit what the lost route computed, and return the token after the last one (seeded
        sampling draws from the position, so it is the token the lost route would have given).
        Where a pass of many positions rounds like one-position steps (the block kernel: the route
        shares this daemon's model and recipe, so its hops compute as this shard does), the tokens go
        as prefill-sized chunks; elsewhere (torch's attention rounds differently for many queries
        than for one) as the decode steps they first were, REPLAY_WINDOW in flight."""
        if self.service.endpoint.shard.passes_equal_steps:
            spans = chunk_spans(len(tokens))
            token = None
            for ci, (a, b) in enumerate(spans):
                token = await self.step(a + 1, Phase.PREFILL, position + a, list(tokens[a:b]), (ci, len(spans)))
            assert token is not None
            return token
        outs: list[int] = []
        sent = 0
        for i, t in enumerate(tokens):
            out = await self.local(token_frame(self.sid, self.epoch, i + 1, Phase.DECODE, position + i, [t], 0, 1))
            if isinstance(out, Token):  # the entry holds the whole model
                outs.append(out.token_id)
                continue
            if out is None and self.linked:
                self.sent_on_link()
            else:
                await self.send(*self.hops[0], out)
            sent += 1
            while sent - len(outs) >= REPLAY_WINDOW:
                outs.append(await self.next_token(STEP_TIMEOUT))
        while len(outs) < len(tokens):
            outs.append(await self.next_token(STEP_TIMEOUT))
        if outs[:-1] != list(tokens[1:]):
            log.warning("replay diverged from the first route", positions=len(tokens))
        return outs[-1]

    async def next_token(self, timeout: float) -> int:
        """The next token from the tail. A hop silent for SILENT_S is failed at once; hops that echo
        their pings are given up to `timeout`, however slowly they compute."""
        t0 = time.perf_counter()
        deadline = trio.current_time() + timeout
        try:
            while True:
                with trio.move_on_after(min(HEARTBEAT_S, max(0.0, deadline - trio.current_time()))):
                    msg = await self.tokens_recv.receive()
                    if isinstance(msg, Error):  # the link to the first hop broke
                        raise hop_error(self.hops[0][0], msg, retriable=True)
                    return msg.token_id
                silent = self.silent_hop() if self.hops else None
                if silent is not None:
                    raise HopFailed(silent, f"silent for {trio.current_time() - self.heard[silent]:.1f} s")
                if trio.current_time() >= deadline:
                    # blame the first hop that holds a frame it has not answered: the stall is there
                    stalled = next((peer for peer, _ in self.hops if self.pending.get(peer, 0) > 0),
                                   self.hops[-1][0] if self.hops else "entry")
                    raise HopFailed(stalled, f"no answer within {timeout:.1f} s")
        finally:
            self.progress.wait_s += time.perf_counter() - t0
