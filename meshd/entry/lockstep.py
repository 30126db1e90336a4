"""A checked generation at the entry, run: the same generation on two routes in lockstep, a token emitted
only when both routes give it, and a third route to settle which one is wrong when they do not (what is
decided without I/O, whom to check and whom to blame, is `meshd/entry/checks.py`'s).

Rules: the second route avoids the first route's daemons wherever another daemon serves the layers
(`plan_route(avoid=...)`, the planner that already steps around failed and busy peers); where none
does, those layers run unchecked and the generation says so. Both routes run without drafts (a
checked generation does not speculate: both would have to be given the same drafts and accept alike,
which they do, but a step's output is then several tokens to compare; plain steps keep it one).
When the routes disagree nothing is emitted: the step runs again on both with a sketch request
(`meshd/hop/sketch.py`), whose first differing boundary names the range that diverged; the try ends
(`Event.DISAGREED`, its `Disagreement`), a third route around that range's daemons replays the generation
up to that step (sketched alike), and the peers of the route it disagrees with (by sketch, else by token) are excluded
from this daemon's routes (`checks.Exclusions`); the generation then goes on over new routes around
them, so the client sees a pause, never a token two routes disagreed on. `Lockstep` is given what it uses
of its entry (its own hop, the entry's `Routes`, the exclusions, and a plain try for a generation no replica
can check), never the entry itself.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from meshd.entry.attempt import first_token
from meshd.entry.checks import Exclusions, Verdict, differing_peers, judge, settle, swapped, unchecked_layers
from meshd.entry.errors import GenerationError, first_of
from meshd.entry.opening import Routes
from meshd.entry.route import Route
from meshd.entry.run import Run
from meshd.entry.stages import Event
from meshd.hop import sketch
from meshd.core.log import get_logger
from meshd.wire import ErrorCode, Phase

log = get_logger(__name__)
MAX_DISAGREEMENTS = 3  # a generation whose routes disagree more often fails rather than loop


@dataclass(frozen=True)
class Disagreement:
    """The two routes of a checked generation gave different tokens after the same accepted ones:
    neither token reaches the client until a third route settles which route is wrong."""

    position: int  # generated tokens before the one they disagree on
    routes: tuple[list, list]
    tokens: tuple[int, int]
    hops: tuple = ()  # the routes' planned `Hop`s (addresses), to build trial routes from
    sketches: tuple[dict, dict] | None = None  # each route's hops' sketches of the step (meshd/hop/sketch.py)
    seed: int = 0


async def both(fn, items) -> list:
    """`fn(item)` for every item at once; their results in order."""
    out: list = [None] * len(items)

    async def one(i, item):
        out[i] = await fn(item)

    async with trio.open_nursery() as nursery:
        for i, item in enumerate(items):
            nursery.start_soon(one, i, item)
    return out


class Lockstep:
    """Runs the checked generations of an entry whose own hop is `peer_id`'s layers [0, `end`): routes planned
    and opened by `routes`, peers that lose a settlement kept off them by `exclusions`, and `unchecked(run,
    route)` the entry's plain try on one route, for a generation no replica can check."""

    def __init__(self, peer_id: str, end: int, routes: Routes, exclusions: Exclusions,
                 unchecked: Callable[[Run, Route], Awaitable[Event]]) -> None:
        self.peer_id, self.end, self.routes, self.exclusions = peer_id, end, routes, exclusions
        self.unchecked = unchecked

    def described(self, route: Route) -> list:
        """`route` as the generation records it: this daemon's hop first."""
        return [[self.peer_id, 0, self.end]] + route.describe()

    async def run(self, run: Run) -> Event:
        """One try at a checked generation: two routes, in lockstep; how it ended (`Event.DISAGREED`: see
        `run.disagreement`). Falls back to one route (the generation unchecked, and saying so) when the mesh has
        no other daemon for any layer."""
        gen, retries = run.gen, run.retries
        first = self.routes.plan(retries.failed, retries.busy)
        second = self.routes.plan(retries.failed, retries.busy, avoid={h.peer_id for h in first.hops})
        a, b = self.described(first), self.described(second)
        gen.check.unchecked = unchecked_layers(a, b, self.end)
        if not differing_peers(a, b):
            gen.check.second = []
            log.info("no replica on the route: the generation runs unchecked", layers=gen.check.unchecked)
            return await self.unchecked(run, first)  # one route: speculation as usual
        gen.check.second = b
        gen.begin_attempt(a + b[1:])  # both routes' hops computed every position (the ledger's credits)
        gen.route = a
        async with self.routes.open_route(first, retries.epoch, run.req, gen, run.sampling) as at_a, \
                self.routes.open_route(second, retries.epoch, run.req, gen, run.sampling) as at_b:
            tokens = await both(first_token, [at_a, at_b])
            while True:
                if tokens[0] != tokens[1]:
                    seed, sketches = await sketch_step(gen, (at_a, at_b)) if gen.tokens else (0, None)
                    run.disagreement = Disagreement(len(gen.tokens), (a, b), (tokens[0], tokens[1]),
                                                    first.hops + second.hops, sketches, seed)
                    return Event.DISAGREED
                gen.check.compared += 1
                taken, event = gen.take(tokens[:1])
                if event is not None:  # done, or both routes open again on the long table
                    await run.emit_tokens(taken)
                    return event
                step, position, token = len(gen.tokens), gen.position, gen.tokens[-1]
                async with trio.open_nursery() as overlap:  # the text goes out while both routes compute on
                    overlap.start_soon(run.emit_tokens, taken)
                    tokens = await both(lambda at: at.step(step, Phase.DECODE, position, [token]), [at_a, at_b])

    async def settle(self, run: Run) -> Event:
        """Ask a third route, whose daemons differ where the two routes differed, for the token the two
        disagreed on (`run.disagreement`); exclude the peers of the route it disagrees with. Raises the
        GenerationError the client gets when no such route exists or it agrees with neither."""
        gen, retries = run.gen, run.retries
        exc, run.disagreement = run.disagreement, None
        gen.check.disagreements += 1
        if gen.check.disagreements > MAX_DISAGREEMENTS:
            raise GenerationError(ErrorCode.HOP_FAILED, f"checked routes disagreed {gen.check.disagreements} times"
                                  " and excluding peers did not end it: no token is given that two routes do not"
                                  " agree on")
        a, b = exc.routes
        retries.epoch += 1
        log.warning("checked routes disagree: asking a third route", position=exc.position, tokens=list(exc.tokens),
                    peers=sorted(p[-8:] for p in differing_peers(a, b)))
        where = sketch.first_divergence(*exc.sketches) if exc.sketches else None
        if where is not None:
            gen.check.diverged.append(list(where))
            log.warning("the routes' sketches part", layers=f"{where[0]}:{where[1]}")
        suspect = ({p for r in (a, b) for p, start, end in r if start < where[1] and end > where[0]} - {self.peer_id}
                   if where is not None else differing_peers(a, b))
        try:
            third = self.routes.plan(retries.failed, retries.busy, avoid=suspect)
        except GenerationError:
            third = None
        c = self.described(third) if third is not None else None
        if c is None or not (differing_peers(a, c) and differing_peers(b, c)):
            raise GenerationError(ErrorCode.HOP_FAILED, f"two routes gave different tokens at generated token"
                                  f" {exc.position} and no third server of the layers where they differ can settle it")
        extra = (sketch.request(exc.seed),) if exc.sketches else ()
        token, third_sketches = await self.token_on(third, run, extra)
        verdict = judge((a, b), where, exc.sketches, c, third_sketches) if where is not None else None
        if verdict is None and exc.tokens[0] == exc.tokens[1]:  # a check by prefill whose sketches part on a token
            verdict = Verdict(0, frozenset())  # both gave: no sketch of a third decides it, so nobody is blamed
            log.warning("the routes' sketches part where their tokens agree and no third sketch decides: nobody"
                        " excluded")
        if verdict is None:  # no sketch to go by: the tokens decide
            verdict = settle((a, b), exc.tokens, c, token)
            if exc.sketches and where is None:  # every hop's sketch agreed within the tolerance: rounding, no liar
                log.warning("checked routes disagree on a token but their sketches agree: nobody excluded")
                verdict = Verdict(verdict.winner, frozenset())
        if verdict.winner is None:
            raise GenerationError(ErrorCode.HOP_FAILED, f"three routes gave three different tokens at generated"
                                  f" token {exc.position}: the mesh cannot say which is right")
        self.exclude(exc, verdict, token, await self.narrow(exc, verdict, token, third, run), gen)
        retries.epoch += 1
        return Event.SETTLED

    def exclude(self, exc: Disagreement, verdict: Verdict, token: int, suspects: frozenset[str], gen) -> None:
        """Keep the suspects of the route that lost off this daemon's routes."""
        now = time.monotonic()  # the clock of `self.exclusions`
        layers = {peer: [start, end] for peer, start, end in exc.routes[1 - verdict.winner]}
        for peer in sorted(suspects):
            reason = (f"layers {layers[peer][0]}:{layers[peer][1]} gave token {exc.tokens[1 - verdict.winner]} where"
                      f" two other routes gave {token} (generated token {exc.position})")
            excluded = self.exclusions.exclude(peer, reason, now)
            gen.check.excluded.append(peer)
            log.warning("peer excluded from routes", peer=peer, reason=reason, times=excluded.times,
                        seconds=round(excluded.until - now, 1))

    async def token_on(self, route: Route, run: Run, extra=()) -> tuple[int, dict]:
        """The token `route` gives after the generation's accepted tokens (a replay on a fresh session),
        and its hops' sketches of that step when `extra` asks for them."""
        run.gen.begin_attempt(self.described(route))
        try:
            async with self.routes.open_route(route, run.retries.epoch, run.req, run.gen, run.sampling) as at:
                token = await first_token(at, extra)
                return token, sketch.read(at.last_token.tensors) if extra and at.last_token is not None else {}
        except BaseExceptionGroup as group:
            raise first_of(group) from None

    async def narrow(self, exc: Disagreement, verdict: Verdict, token: int, third: Route, run: Run) -> frozenset[str]:
        """Of several suspects, those that give a wrong token among honest hops: each is tried alone in
        the winning route in place of the hops on its layers (a suspect that cannot be swapped in stays
        suspect). One suspect needs no trial."""
        if len(verdict.suspects) < 2:
            return verdict.suspects
        winner, loser = exc.routes[verdict.winner], exc.routes[1 - verdict.winner]
        planned = {(h.peer_id, h.start, h.end): h for h in (*exc.hops, *third.hops)}
        guilty = set()
        for peer in sorted(verdict.suspects):
            hop = next(h for h in loser if h[0] == peer)
            trial = swapped(winner, hop)
            if trial is None or any(tuple(h) not in planned for h in trial[1:]):
                guilty.add(peer)
                continue
            route = Route(tuple(planned[tuple(h)] for h in trial[1:]), 0.0)
            if (await self.token_on(route, run))[0] != token:
                guilty.add(peer)
        log.info("suspects tried one at a time", suspects=len(verdict.suspects), guilty=len(guilty))
        return frozenset(guilty or verdict.suspects)


async def sketch_step(gen, attempts) -> tuple[int, tuple[dict, dict]]:
    """Both routes' hops' sketches of the step they disagreed on (run again, with a seed picked here)."""
    seed = random.getrandbits(62) + 1
    position, step = gen.position, len(gen.tokens)
    replies = await both(lambda at: at.advance(step, Phase.DECODE, position, [gen.tokens[-1]],
                                               extra=(sketch.request(seed),)), attempts)
    return seed, (sketch.read(replies[0].tensors), sketch.read(replies[1].tensors))
