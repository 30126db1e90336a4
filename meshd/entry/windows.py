"""A generation checked by prefill, at the entry: the first route generates as an unchecked one does, each of
its hops adding a sketch of every step's output (`meshd/hop/sketch.py`); a second route of other daemons
recomputes each finished window of tokens in one pass and sketches every row of it, and the two are compared
row by row, token and sketches at every layer boundary both routes share. What is decided without I/O (the
next window, the first wrong row) is `meshd/entry/checks.py`'s; a disagreement is settled as a lockstep
check's is (`Lockstep.settle`: a third route, the liar excluded).

Rules:
- A window goes down the second route as a VERIFY frame whose drafts are the first route's tokens, with a
  `sketch.rows_request`: every hop computes its rows as the one-position steps they were on the first route
  (the bits are the same: `Shard.passes_equal_steps`), and the tail accepts a draft only where it samples
  that very token, so the answer says how many of the window's tokens the second route would have given.
  The window costs the rows of one pass, not a decode step each (a prefill row costs a fraction of a step).
- This daemon's own layers are not run again for a window: the rows they gave the first route's steps (read
  as they go out: `ShardService.taps`) go to the second route's first hop, with this daemon's sketches of
  them (an entry trusts itself; they are the bits its layers would give again).
- The check of a window runs while the first route generates the next; the first route runs at most two
  windows ahead of the check. The first route drafts as an unchecked greedy generation does (its steps'
  rows are sketched alike, and its tail held to the very token: a greedy tail's rule anyway); a sampled one
  decodes plainly, as its text must not depend on the check.
- The second route is drawn at random among the servers of each range that are not on the first route
  (`route.spread_weights`), so that checks reach every server of a range over time, not only the fastest two.
- The text goes out once its window is checked (`Checking.release` "checked": a window's latency), or at once
  ("at-once") with a `verified` event after each window, and a `retract` event from the first wrong token
  when a check fails (`Run.retract`). Tokens a try generated but did not check (a hop failed) are taken back
  the same way and generated again.
- Each window checked is recorded (`Check.window`), and the ledger keeps them with the generation.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch
import trio

from meshd.core.log import get_logger
from meshd.entry.attempt import Attempt, first_token
from meshd.entry.checks import Checking, differing_peers, first_wrong, next_window, unchecked_layers
from meshd.entry.decoding import Decoding
from meshd.entry.drafts import worth_drafting
from meshd.entry.lockstep import Disagreement
from meshd.entry.opening import Routes
from meshd.entry.route import Route, spread_weights
from meshd.entry.run import Run
from meshd.entry.stages import Event
from meshd.hop import sketch
from meshd.hop.endpoint import DRAFTS, FED, HIDDEN
from meshd.wire import Forward, Phase
from meshd.wire.tensors import Tensor

log = get_logger(__name__)
AHEAD = 2  # windows the first route may generate past the last one checked


@dataclass
class Made:
    """A token the first route gave, and its hops' sketches of the step that gave it."""

    token: int
    sketches: dict


@dataclass
class Tally:
    """One try's account between its two routes: the tokens the first made since the try began (`base`
    tokens were generated before it), how many of them are checked, how the first route's part ended, and
    the first wrong row the check found (its row, the check's token and sketches there, the layers)."""

    base: int
    made: list[Made] = field(default_factory=list)
    checked: int = 0
    event: Event | None = None
    wrong: tuple[int, int, dict, tuple[int, int] | None] | None = None
    changed: trio.Event = field(default_factory=trio.Event)

    own: dict[int, tuple] = field(default_factory=dict)  # position -> this daemon's output row of the first
    # route's step there, and its sketch of it: a window takes them instead of computing them again

    def own_rows(self, frame: Forward) -> None:
        """This daemon's layers' output of a first route's step (`ShardService.taps`), row by position."""
        if frame.phase not in (Phase.DECODE, Phase.VERIFY):
            return
        hidden = next((t for t in frame.tensors if t.name == HIDDEN), None)
        if hidden is None:
            return
        rows = hidden.to_torch()
        mine = next((t.to_torch() for t in frame.tensors if t.name.startswith(sketch.PREFIX)), None)
        for i in range(rows.shape[1]):
            self.own[frame.position + i] = (rows[:, i:i + 1], mine[i] if mine is not None and mine.dim() == 2
                                            and mine.shape[0] == rows.shape[1] else None)

    def window_frame(self, at: Attempt, step: int, position: int, fed: list[int], seed: int, name: str,
                     grammar: bool) -> Forward | None:
        """The frame of a window for the second route's first hop, built of this daemon's own rows of the first
        route's steps at its positions (and their sketches), as its layers would give them again (the same
        bits: one-position steps); None where a row is missing (then the window goes through its layers)."""
        rows = [self.own.get(position + i) for i in range(len(fed))]
        if any(r is None for r in rows):
            return None
        tensors = [Tensor.from_torch(HIDDEN, torch.cat([r[0] for r in rows], dim=1)),
                   Tensor.from_torch(DRAFTS, torch.tensor([fed[1:]], dtype=torch.int64)), sketch.rows_request(seed)]
        if grammar:  # the hop that samples takes the ids fed (meshd/hop/endpoint.py, `_fed`)
            tensors.append(Tensor.from_torch(FED, torch.tensor([fed], dtype=torch.int64)))
        if all(r[1] is not None for r in rows):
            tensors.append(Tensor.from_torch(name, torch.stack([r[1] for r in rows])))
        for p in [p for p in self.own if p < position]:
            del self.own[p]
        return Forward(session_id=at.sid, epoch=at.epoch, step=step, phase=Phase.VERIFY, position=position,
                       tensors=tuple(tensors))

    def wake(self) -> None:
        woken, self.changed = self.changed, trio.Event()
        woken.set()

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self.changed.wait()


class Windows:
    """Runs the generations an entry checks by prefill: its own hop is `peer_id`'s layers [0, `end`), routes
    planned and opened by `routes`, how windows are cut and text released by `checking`, drafts as its
    `decoding` proposes them, and `unchecked(run, route)` the entry's plain try on one route, for a generation no
    replica can check."""

    def __init__(self, peer_id: str, end: int, routes: Routes, checking: Checking, decoding: Decoding,
                 unchecked: Callable[[Run, Route], Awaitable[Event]]) -> None:
        self.peer_id, self.end, self.routes, self.checking = peer_id, end, routes, checking
        self.decoding = decoding  # the entry's: whether drafts pay, and where they come from
        self.unchecked = unchecked

    def described(self, route: Route) -> list:
        """`route` as the generation records it: this daemon's hop first."""
        return [[self.peer_id, 0, self.end]] + route.describe()

    async def run(self, run: Run) -> Event:
        """One try at a generation checked by prefill; how it ended (`Event.DISAGREED`: see `run.disagreement`).
        Falls back to one route (unchecked, and saying so) when the mesh has no other daemon for any layer."""
        gen, retries, check = run.gen, run.retries, run.gen.check
        if len(gen.tokens) > check.verified:  # the last try ended before checking them: they are generated again
            await run.retract(check.verified, "the route changed before these tokens were checked")
        first = self.routes.plan(retries.failed, retries.busy)
        second = self.routes.plan(retries.failed, retries.busy, avoid={h.peer_id for h in first.hops},
                                  weigh=spread_weights(random.Random()))
        a, b = self.described(first), self.described(second)
        check.unchecked = unchecked_layers(a, b, self.end)
        if not differing_peers(a, b):
            check.second = []
            log.info("no replica on the route: the generation runs unchecked", layers=check.unchecked)
            return await self.unchecked(run, first)
        check.second = b
        gen.begin_attempt(a + b[1:])  # both routes' hops computed every position (the ledger's credits)
        gen.route = a
        tally = Tally(base=len(gen.tokens))
        taps = self.routes.service.taps
        async with self.routes.open_route(first, retries.epoch, run.req, gen, run.sampling) as at_a, \
                self.routes.open_route(second, retries.epoch, run.req, gen, run.sampling) as at_b:
            taps[(at_a.sid, at_a.epoch)] = tally.own_rows
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._generate, run, at_a, tally)
                    nursery.start_soon(self._check, run, at_b, tally, b, nursery.cancel_scope)
            finally:
                taps.pop((at_a.sid, at_a.epoch), None)
        if tally.wrong is None:
            return tally.event
        row, token, theirs, where = tally.wrong
        made, position = tally.made[row], tally.base + row
        run.disagreement = Disagreement(position, (a, b), (made.token, token), first.hops + second.hops,
                                        (made.sketches, theirs), check.seed)
        log.warning("a check by prefill disagrees", position=position, tokens=[made.token, token],
                    layers=f"{where[0]}:{where[1]}" if where else None)
        await run.retract(position, f"a check found generated token {position} wrong: the text goes on from the"
                                    " token before it, on routes around the peer that gave it")
        return Event.DISAGREED

    async def _generate(self, run: Run, at: Attempt, tally: Tally) -> None:
        """The first route's part: decode steps (with drafts where a greedy generation's pay, as an unchecked
        one's), each hop sketching each row, at most AHEAD windows past the check; the text goes out at once
        where the check releases it so."""
        gen, seed = run.gen, run.gen.check.seed
        at_once = self.checking.release == "at-once"
        tokens = [await first_token(at, (sketch.request(seed),))]
        rows = [sketch.read(at.last_token.tensors) if at.last_token is not None else {}]
        while True:
            taken, event = gen.take(tokens)
            tally.made.extend(Made(token, rows[i]) for i, token in enumerate(taken))
            tally.wake()
            if event is not None:
                if at_once:
                    await run.emit_tokens(taken)
                tally.event = event
                tally.wake()
                return
            await tally.until(lambda: len(tally.made) - tally.checked < AHEAD * self.checking.window)
            drafts, began = await self.drafts(run, at), time.perf_counter()
            step, position, token = len(gen.tokens), gen.position, gen.tokens[-1]
            async with trio.open_nursery() as overlap:  # the text goes out while the route computes on
                if at_once:
                    overlap.start_soon(run.emit_tokens, taken)
                # every row sketched; drafts held to the very token sampled (a greedy one's rule anyway)
                reply = await at.advance(step, Phase.VERIFY if drafts else Phase.DECODE, position, [token, *drafts],
                                         extra=(sketch.rows_request(seed),))
            if gen.drafts is not None:  # a step's time and its drafts' fate: how many the next one carries
                gen.drafts.observe(1 + len(drafts), time.perf_counter() - began)
            if drafts:
                gen.verified(len(drafts), reply.accepted)
            every = sketch.read(reply.tensors)
            tokens = [*drafts[:reply.accepted], reply.token_id]
            rows = [sketch.row(every, i) for i in range(len(tokens))]

    async def drafts(self, run: Run, at: Attempt) -> list[int]:
        """The drafts of the first route's next step: a greedy generation's, where they pay (as
        `meshd/entry/decoding.py` decides for an unchecked one); none for a sampled one, whose text the
        check's rule for drafts (the very token sampled) would make differ from the unchecked text."""
        gen = run.gen
        if gen.drafts is None or run.req.temperature != 0 or not self.decoding.speculate:
            return []
        if not worth_drafting(len(at.hops), sum(self.decoding.microbatch_use.counts()) - 1):  # its check's route
            return []  # counts as a generation there
        return await self.decoding.propose(gen)

    async def _check(self, run: Run, at: Attempt, tally: Tally, route: list, cancel: trio.CancelScope) -> None:
        """The second route's part: the prompt (and the tokens of earlier tries) as the first route computed
        them, compared at the token after them; then every window as it is finished, until the first route's
        part has ended and all it made is checked, or a row disagrees (which ends the first route's part)."""
        gen, seed = run.gen, run.gen.check.seed
        token = await first_token(at, (sketch.request(seed),), generated=tally.base)
        theirs = sketch.read(at.last_token.tensors) if at.last_token is not None else {}
        await tally.until(lambda: bool(tally.made) or tally.event is not None)
        if not tally.made or not await self._judge(run, tally, (0, 1), [token], [theirs], route, cancel):
            return
        while True:
            await tally.until(lambda: next_window(tally.checked, len(tally.made), self.checking.window,
                                                  tally.event is not None) is not None or
                              (tally.event is not None and tally.checked == len(tally.made)))
            span = next_window(tally.checked, len(tally.made), self.checking.window, tally.event is not None)
            if span is None:
                return  # the first route's part ended, and everything it made is checked
            lo, hi = span
            first = tally.base + lo  # the window's first generated token; the frame feeds the one before it
            fed = gen.tokens[first - 1:first - 1 + hi - lo]
            position = len(gen.ids) + first - 1
            mine = f"{sketch.PREFIX}0:{self.end}"  # this daemon's sketches' name
            frame = tally.window_frame(at, first, position, fed, seed, mine, bool(gen.grammar)) if at.hops else None
            if frame is not None:  # this daemon's layers computed these rows once, for both routes
                reply = await at.past_here(frame)
            else:
                reply = await at.advance(first, Phase.VERIFY, position, fed, extra=(sketch.rows_request(seed),))
            rows = sketch.read(reply.tensors)
            tokens = [tally.made[lo + r].token if r < reply.accepted else reply.token_id if r == reply.accepted
                      else None for r in range(hi - lo)]
            if not await self._judge(run, tally, span, tokens, [sketch.row(rows, r) for r in range(hi - lo)],
                                     route, cancel):
                return

    async def _judge(self, run: Run, tally: Tally, span: tuple[int, int], tokens: list, sketches: list[dict],
                     route: list, cancel: trio.CancelScope) -> bool:
        """Compare the check of the made tokens [lo, hi) with what the first route gave; whether they agree.
        Agreeing, they are checked (their text goes out now, where it waits for the check); else the first
        wrong row is kept in `tally` and the first route's part is stopped."""
        lo, hi = span
        gen, check = run.gen, run.gen.check
        made = tally.made[lo:hi]
        wrong = first_wrong([m.token for m in made], [m.sketches for m in made], tokens, sketches)
        good = hi if wrong is None else lo + wrong[0]
        check.compared += good - lo
        check.verified = tally.base + good
        tally.checked = good
        check.window(tally.base + lo, tally.base + good, route[1:], "agreed" if wrong is None else "disagreed",
                     wrong[1] if wrong is not None else None)
        if self.checking.release == "checked":
            await run.emit_tokens(gen.tokens[gen.streamed:check.verified])
        elif good > lo:
            await run.verified(check.verified)
        if wrong is None:
            tally.wake()
            return True
        row = wrong[0]
        theirs = tokens[row] if tokens[row] is not None else made[row].token
        tally.wrong = (lo + row, theirs, sketches[row], wrong[1])
        cancel.cancel()
        return False
