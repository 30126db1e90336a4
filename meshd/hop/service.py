"""A hop's work for all its sessions: frames in, passes on the compute thread, outputs out.

Rules: tensor work runs on the daemon's compute executor, one job at a time, so the event loop keeps
reading every stream (the stream protocol itself is `meshd/hop/stream.py`); the Forward frames of all
sessions waiting at once share one forward pass (`meshd/hop/scheduler.py` chooses). A session's
hidden states go straight to the next hop when the entry names one this daemon can reach (one
transfer a hop a token), its tokens and errors to the stream it was opened on. The outputs of one
pass that go to the same next daemon leave as one `ForwardBatch` on a link shared by all those
sessions (`meshd/hop/links.py`). Where each session's outputs go is `meshd/hop/outputs.py`'s; every
failure goes back as an `Error` frame. An entry that holds the whole route and the shard alone may run
its decode steps back to back on the compute thread (`decode_run`), until other work comes.
A session ends through its table (`meshd/hop/sessions.py`), on the compute thread; the event loop's part of
the end (its due mark, its share of a next hop's link) follows in `reap`, whoever ended it: its entry, its
stream, a newcomer that took its room, or the KV store that evicted it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator, Callable

import trio

from meshd.hop import handover
from meshd.hop.admission import busy
from meshd.hop.due import DueFrames
from meshd.hop.endpoint import ShardEndpoint
from meshd.hop.links import NextHop
from meshd.hop.outputs import Outputs
from meshd.hop.passes import PassStats, local_tokens, route_outputs
from meshd.hop.scheduler import QueueFull, Scheduler, Work
from meshd.hop.sessions import HopSession
from meshd.hop.stream import serve_shard_stream
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import (Cancel, Close, Error, ErrorCode, Forward, HandedOver, HandOver, Leaving, Message, OpenSession,
                        Opened, Phase, Token)

if TYPE_CHECKING:
    from meshd.core.compute import ComputeExecutor

log = get_logger(__name__)
RUN_STEP = Work(key=None, rows=1, decode=True)  # how a step of a decode run counts in the pass stats
RUN_AHEAD = 4  # steps a decode run computes past the last one its caller read (its client's text)


class ShardService:
    """A shard's work for all its sessions: Forward frames go through the batching scheduler, so the
    waiting work of every session (remote hops and the entry's own layers alike) shares one forward
    pass; other messages run on the compute thread in arrival order.

    There is no batching task: whoever waits for work while no pass runs runs the next pass (and
    every waiting piece has a waiter), so passes follow each other while work waits, and an idle
    shard does nothing at all."""

    def __init__(self, endpoint: ShardEndpoint, compute: ComputeExecutor, scheduler: Scheduler | None = None) -> None:
        self.endpoint = endpoint
        self.compute = compute
        self.scheduler = scheduler or Scheduler()
        self.stats = PassStats(endpoint.shard.end - endpoint.shard.start)
        self._stepping = False
        self._step_done = trio.Event()
        self.forwarded = 0  # frames sent straight to a next hop
        self.retired = False  # no new sessions from other daemons: its daemon leaves, or moved to another range
        self.due = DueFrames()  # frames said to be on their way (`expect`)
        self._arrived = trio.Event()  # set by each submit while a pass waits for due frames
        self.gather_s = 0.0  # wait this long before a pass while other sessions' frames are due (--gather-ms)
        self.outputs = Outputs(endpoint.sessions)  # where each session's outputs go (`dial` set by the slot)
        self.taps: dict[tuple[bytes, int], Callable[[Forward], None]] = {}  # sessions whose hidden states this
        # daemon's entry reads as they go out (a check by prefill reuses its own layers' rows: entry/windows.py)
        self.nursery: trio.Nursery | None = None  # where hand-overs run (the daemon's; None: none are sent)
        self._ended: deque[HopSession] = deque()  # sessions the table closed, whose event-loop part `reap` lets go
        self._reaping = False  # a `reap` is posted to the event loop
        try:
            self._loop: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:  # built outside trio (tests): reaped at the next call
            self._loop = None
        endpoint.sessions.closers.append(self._closed)

    async def handle(self, msg: Message, peer: str | None = None) -> list[Message]:
        """Answer one message: a Forward joins the next pass it can, the rest run in order. `peer`: the
        daemon whose stream it came on (None: this daemon's entry), which may end only its own sessions
        (a Close may keep its KV for that peer's later sessions: nobody else may say what it holds)."""
        if isinstance(msg, Forward):
            return await self._forward(msg)
        if isinstance(msg, HandOver):
            return self._hand_over(msg, peer)
        if isinstance(msg, (Close, Cancel)):
            if peer is not None and not self.endpoint.opened_by((msg.session_id, msg.epoch), peer):
                log.warning("a peer tried to end a session it did not open", peer=peer[-8:])
                return []
            await self._end((msg.session_id, msg.epoch))
        replies = await self.compute.run(self.endpoint.handle, msg, peer or "")  # hand-overs check who asks
        await self.reap()
        return replies

    async def open_linked(self, msg: OpenSession, home: Channel) -> list[Message]:
        """Open a session whose tokens and errors go to `home`, and whose hidden states go straight
        to the next hop when the sender names one and this daemon can reach it (else back home).
        A retired service refuses as busy, so the entry picks another route at once."""
        if self.retired:
            self.endpoint.refused += 1
            return [busy("draining: this daemon is leaving the mesh", msg.request_id, msg.session_id)]
        key = (msg.session_id, msg.epoch)
        if msg.grammar and msg.end == self.endpoint.shard.config.n_layers and self.endpoint.tokenizer is not None:
            # the first grammar here builds the tokenizer's view off the compute thread (seconds for a big vocab)
            await trio.to_thread.run_sync(self.endpoint.grammar_tokenizer)
        stale = self.endpoint.sessions.links(key)  # a reopened session starts afresh
        replies = await self.compute.run(self.endpoint.handle, msg, getattr(home, "peer", ""))
        await self.outputs.let_go(stale)
        await self.reap()  # sessions whose room this one took
        session = self.endpoint.sessions.get(key)
        if not replies or not isinstance(replies[0], Opened) or session is None:
            return replies
        return [replace(replies[0], forwarding=await self.outputs.link(key, msg, home))]

    def _hand_over(self, msg: HandOver, peer: str | None) -> list[Message]:
        """Start sending a session's KV where its entry asks (`meshd/hop/handover.py`); the answer comes later,
        on the session's home stream. Only the session's owner may ask, and only of a daemon that is leaving."""
        key = (msg.session_id, msg.epoch)
        session = self.endpoint.sessions.get(key)
        why = ("no such session here" if session is None or session.links is None
               else "only the session's entry may hand it over" if peer is None or session.requester != peer
               else "this hop is not leaving" if not self.retired
               else "this hop sends no hand-overs" if self.nursery is None else "")
        if why:
            return [HandedOver(session_id=msg.session_id, epoch=msg.epoch, ticket=msg.ticket, positions=0, reason=why)]
        self.nursery.start_soon(handover.push, self, msg, session.links.home)
        return []

    async def retire(self) -> int:
        """Take no new sessions from other daemons (its daemon leaves, or moved to another range), and tell the
        entry of every session open here for another daemon that this hop leaves (`Leaving`): each may hand its
        session's KV over to another hop (`meshd/hop/handover.py`). The sessions told."""
        self.retired = True
        told = 0
        for key, session in list(self.endpoint.sessions.items()):
            if not session.requester or session.links is None:
                continue
            try:
                await session.links.home.send(Leaving(session_id=key[0], epoch=key[1]))
                told += 1
            except ChannelClosed:
                pass
        return told

    async def forward_outputs(self, key: tuple[bytes, int], peer: str, addrs, home) -> None:
        """Send session `key`'s outputs to `peer` over the link shared with the other sessions going
        there (the entry's own layers use this for its first hop); `home` hears of a broken link."""
        await self.outputs.forward_to(key, peer, addrs, home)

    async def deliver(self, msg: Message, reply: Message, channel: Channel) -> None:
        """Send a reply to its session's home stream (tokens, errors, and hidden states when this hop
        does not forward: those for a next hop left with their pass)."""
        await self.outputs.deliver(msg, reply, channel)

    def _cancel(self, key: tuple[bytes, int]) -> None:
        """Drop a session's waiting work; its waiters get no output (they must not wait on)."""
        for work in self.scheduler.cancel(key):
            work.output, work.done = [], True

    async def _end(self, key: tuple[bytes, int]) -> None:
        """The event loop's part of a session its entry ends (or its stream), before the table closes it: its
        waiting work goes unanswered, its due mark and its link go."""
        self.due.arrived(key)
        self._cancel(key)
        await self.outputs.unlink(key)

    def _closed(self, session: HopSession) -> None:
        """The table's closer, on whichever thread closed the session: the event loop lets go of its part
        (`reap`) at its next turn. Its waiting work is not dropped: an evicted session's is answered
        `unknown_session` (an entry's close dropped it before)."""
        self._ended.append(session)
        if self._loop is not None and self.nursery is not None and not self._reaping:
            self._reaping = True
            try:
                self._loop.run_sync_soon(self._reap_soon)
            except trio.RunFinishedError:
                pass

    def _reap_soon(self) -> None:
        self._reaping = False
        try:
            self.nursery.start_soon(self.reap)
        except RuntimeError:  # the daemon's nursery is closing: nothing left to let go of
            pass

    async def reap(self) -> None:
        """Let go of the event loop's part of the sessions the table closed: their due marks, their links."""
        while self._ended:
            session = self._ended.popleft()
            self.due.arrived(session.key)
            links, session.links = session.links, None
            await self.outputs.let_go(links)

    def submit(self, msg: Forward) -> Work | Error:
        """Queue a Forward frame for the next pass it can join (at once, without waiting), or the
        `busy` Error that refuses it."""
        shape = msg.tensors[0].shape if msg.tensors else ()
        rows = shape[1] if len(shape) >= 2 else 1
        key = (msg.session_id, msg.epoch)
        self.due.arrived(key)
        self._arrived.set()
        try:
            state = self.endpoint.sessions.get(key)  # its microbatch: only frames of one microbatch share a pass
            decode = msg.phase in (Phase.DECODE, Phase.VERIFY)  # a step of chosen tokens (one, a replay's, or drafts)
            return self.scheduler.submit(key, rows, decode, msg, state.microbatch if state else 0)
        except QueueFull as exc:
            return busy(str(exc), session_id=msg.session_id,
                        drain_s=self.stats.retry_hint(self.scheduler.queued, self.scheduler.max_batch))

    async def _forward(self, msg: Forward) -> list[Message]:
        work = self.submit(msg)
        return [work] if isinstance(work, Error) else await self.finish(work)

    async def finish(self, work: Work) -> list[Message]:
        """Wait for a submitted piece of work to run (running passes while none runs); its outputs,
        less those already sent on to the next hop."""
        try:
            while not work.done:
                if self._stepping:
                    await self._step_done.wait()
                else:
                    await self._step()
        finally:
            if not work.done:  # the caller gave up (cancelled) before its work ran
                self.scheduler.withdraw(work)
        return work.output if work.output is not None else []

    async def _step(self) -> None:
        """Run one pass of the scheduler's choosing, then wake everyone waiting."""
        self._stepping = True
        batch: list = []
        hops: set[NextHop] = set()
        try:
            if self.gather_s and len(self.endpoint.sessions) > self.scheduler.waiting() > 0:
                # other sessions' frames of the same upstream pass are arriving on their own streams
                # a moment apart: wait for them, so one pass takes them all (not 1, then the rest)
                await trio.sleep(self.gather_s)
            await self.reap()  # a session evicted meanwhile is not waited for
            await self._wait_for_due()
            batch = self.scheduler.schedule()
            if not batch:
                return
            t0 = time.perf_counter()
            outputs = await self.compute.run(self._pass, [w.payload for w in batch])
            self.scheduler.update_from_output(batch, outputs)
            done, batch = batch, []
            self.stats.account(time.perf_counter() - t0, done)
            for w in done:
                tap = self.taps.get((w.payload.session_id, w.payload.epoch))
                if tap is not None and w.output and isinstance(w.output[0], Forward):
                    tap(w.output[0])
            hops, forwarded = route_outputs(done, self.endpoint.sessions.links, self.stats.steps)
            self.forwarded += forwarded
            local = local_tokens(done, self.endpoint.sessions.links)
            if len(local) > 1:  # the entry here holds the whole route: these sessions come back together
                for key in local:
                    self.expect(key, ("local", self.stats.steps), len(local))
        finally:
            if batch:  # interrupted before its outputs arrived: its waiters must not wait forever
                self.scheduler.update_from_output(batch, [[] for _ in batch])
            self._stepping = False
            woken, self._step_done = self._step_done, trio.Event()
            woken.set()
        if hops:  # the next pass may start meanwhile: its outputs queue behind these
            await self.outputs.flush(hops)

    def _pass(self, frames: list[Forward]) -> list[list[Message]]:
        """One forward pass of these frames (on the compute thread): each frame's replies, or, where the
        pass itself failed, an `internal` Error for each (a bug in one pass must not take the daemon down)."""
        try:
            return self.endpoint.forward_batch(frames)
        except Exception as exc:
            log.exception("shard pass failed", sessions=len(frames))
            return [[Error(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}",
                           session_id=f.session_id)] for f in frames]

    def expect(self, key: tuple[bytes, int], group: tuple = (), size: int = 0) -> None:
        """Say that a session's next frame is on its way (its entry just got the token it answers),
        one of `size` tokens of the tail pass `group` that come here (see `meshd/hop/due.py`)."""
        self.due.expect(key, trio.current_time(), group, size)
        self._arrived.set()

    async def _wait_for_due(self) -> None:
        if not self.due.awaited(trio.current_time()) or not self.scheduler.waiting():
            return
        with trio.move_on_after(self.due.wait_s) as waited:
            while self.due.awaited(trio.current_time()):
                self._arrived = trio.Event()
                await self._arrived.wait()
        if waited.cancelled_caught:
            self.due.clear()

    @asynccontextmanager
    async def decode_run(self, frame_of: Callable[[int, int], Forward], token: int, steps: int,
                         stop: frozenset[int]) -> AsyncIterator[AsyncIterator[tuple[list[Message], float]]]:
        """Up to `steps` decode steps of one session run back to back on the compute thread, step i
        being `frame_of(i, token)` fed the token step i - 1 sampled (step 0 `token`): each step's replies
        and seconds, as they come. For an entry whose route is its own layers, with no other session
        here: a step then needs no trip through the event loop (two thread hand-offs and the entry's
        Python between passes cost ~0.4 ms of a 3.6 ms SmolLM2 step). The run ends after a stop token,
        an Error, when the caller leaves, when its caller has RUN_AHEAD steps unread (a slow client
        slows the generation, as between ordinary steps), or before a step when any other job waits for
        the compute thread (another session's pass, a message): that runs next, and the caller goes on
        with ordinary steps. The replies end with the run."""
        send, receive = trio.open_memory_channel(math.inf)
        halt = False
        posted = taken = 0  # steps handed over (written by the compute thread only) and read (by the caller only)
        trio_token = trio.lowlevel.current_trio_token()
        first = frame_of(0, token)
        self.due.arrived((first.session_id, first.epoch))  # its frames come this way, not through `submit`

        def arrived(item: tuple[list[Message], float]) -> None:  # on the event loop, in step order
            try:
                self.stats.account(item[1], [RUN_STEP])
                self.scheduler.stats.count(1, 1)
                self.scheduler.stats.run_passes += 1
                send.send_nowait(item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):  # its caller left: nobody reads
                pass
            except Exception:  # a callback's error would end the event loop (a metrics hook's bug, say)
                log.exception("a decode run's step could not be handed over")

        def run() -> None:  # on the compute thread
            nonlocal posted
            frame = first
            for i in range(steps):
                if halt or self.compute.waiting() or posted - taken >= RUN_AHEAD:
                    return
                t0 = time.perf_counter()
                replies = self._pass([frame])[0]
                try:
                    trio_token.run_sync_soon(arrived, (replies, time.perf_counter() - t0))
                except trio.RunFinishedError:  # the daemon is stopping
                    return
                posted += 1
                if not replies or not isinstance(replies[0], Token) or replies[0].token_id in stop:
                    return
                frame = frame_of(i + 1, replies[0].token_id)

        async def drive() -> None:
            async with send:  # `arrived` calls were queued before the job's own answer: all are in
                await self.compute.run(run)

        async def replies() -> AsyncIterator[tuple[list[Message], float]]:
            nonlocal taken
            async for item in receive:
                taken += 1
                yield item

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            try:
                yield replies()
            finally:
                halt = True

    async def release(self, key: tuple[bytes, int], keep: list[bytes] = ()) -> None:
        """Free a session's KV, or with `keep` keep it for a later session extending those tokens (see
        `ShardEndpoint.release`); safe while other sessions compute: it runs in order on the compute thread."""
        await self._end(key)
        await self.compute.run(self.endpoint.release, key, "completed" if keep else "failed", keep)
        await self.reap()

    async def serve_stream(self, stream) -> None:
        """The /meshd/shard/1.0.0 handler: serve a stream's frames until it ends (`meshd/hop/stream.py`)."""
        await serve_shard_stream(self, stream)
