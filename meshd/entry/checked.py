"""A checked generation at the entry: the same generation on two routes at once, a token emitted only
when both routes give it, and a third route to settle which one is wrong when they do not.

Rules: the second route avoids the first route's daemons wherever another daemon serves the layers
(`plan_route(avoid=...)`, the planner that already steps around failed and busy peers); where none
does, those layers run unchecked and the generation says so. Both routes run without drafts (a
checked generation does not speculate: both would have to be given the same drafts and accept alike,
which they do, but a step's output is then several tokens to compare; plain steps keep it one).
When the routes disagree nothing is emitted: the step runs again on both with a sketch request
(`meshd/hop/sketch.py`), whose first differing boundary names the range that diverged; `RoutesDisagree`
leaves both routes, a third route around that range's daemons replays the generation up to that step
(sketched alike), and the peers of the route it disagrees with (by sketch, else by token) are excluded
from this daemon's routes (`checks.Exclusions`); the generation then goes on over new routes around
them, so the client sees a pause, never a token two routes disagreed on.
"""

from __future__ import annotations

import random
import time

import trio

from meshd.entry.checks import Verdict, differing_peers, judge, settle, swapped, unchecked_layers
from meshd.entry.errors import GenerationError, RoutesDisagree, SwitchTable, first_of
from meshd.entry.route import Route
from meshd.entry.state import Generation
from meshd.hop import sketch
from meshd.node.log import get_logger
from meshd.wire import ErrorCode, Phase

log = get_logger(__name__)
MAX_DISAGREEMENTS = 3  # a generation whose routes disagree more often fails rather than loop


async def both(fn, items) -> list:
    """`fn(item)` for every item at once; their results in order."""
    out: list = [None] * len(items)

    async def one(i, item):
        out[i] = await fn(item)

    async with trio.open_nursery() as nursery:
        for i, item in enumerate(items):
            nursery.start_soon(one, i, item)
    return out


async def run_checked(entry, req, gen: Generation, sampling, retries, text, emit) -> None:
    """One try at a checked generation: two routes, in lockstep. Falls back to one route (the
    generation unchecked, and saying so) when the mesh has no other daemon for any layer."""
    own = [[entry.mesh.peer_id, 0, entry.end]]
    first = entry.plan(retries.failed, retries.busy)
    second = entry.plan(retries.failed, retries.busy, avoid={h.peer_id for h in first.hops})
    a, b = own + first.describe(), own + second.describe()
    gen.check.unchecked = unchecked_layers(a, b, entry.end)
    if not differing_peers(a, b):
        gen.check.second = []
        log.info("no replica on the route: the generation runs unchecked", layers=gen.check.unchecked)
        gen.drafts = gen.drafts or entry.drafts_for(req)  # one route: speculation as usual
        return await entry.attempt(req, gen, sampling, retries, text, emit, route=first)
    gen.check.second = b
    gen.begin_attempt(a + b[1:])  # both routes' hops computed every position (the ledger's credits)
    gen.route = a
    async with entry.routes.open_route(first, retries.epoch, req, gen, sampling) as at_a, \
            entry.routes.open_route(second, retries.epoch, req, gen, sampling) as at_b:
        tokens = await both(lambda at: entry.first_token(at, gen), [at_a, at_b])
        while True:
            if tokens[0] != tokens[1]:
                seed, sketches = await sketch_step(gen, (at_a, at_b)) if gen.tokens else (0, None)
                raise RoutesDisagree(len(gen.tokens), (a, b), (tokens[0], tokens[1]), first.hops + second.hops,
                                     sketches, seed)
            token = tokens[0]
            gen.check.compared += 1
            if gen.accept(token):
                await entry.emit_token(req, gen, text, token, emit)
                return
            if gen.past_switch:  # both routes open again on the long table (see Entry._decode)
                await entry.emit_token(req, gen, text, token, emit)
                raise SwitchTable(len(gen.ids) + len(gen.tokens), gen.switch)
            position = len(gen.ids) + len(gen.tokens) - 1
            step = len(gen.tokens)
            async with trio.open_nursery() as overlap:  # the text goes out while both routes compute on
                overlap.start_soon(entry.emit_tokens, req, gen, text, [token], emit)
                tokens = await both(lambda at: at.step(step, Phase.DECODE, position, [token]), [at_a, at_b])


async def settle_disagreement(entry, exc: RoutesDisagree, req, gen: Generation, sampling, retries) -> None:
    """Ask a third route, whose daemons differ where the two routes differed, for the token the two
    disagreed on; exclude the peers of the route it disagrees with. Raises the GenerationError the
    client gets when no such route exists or it agrees with neither."""
    gen.check.disagreements += 1
    if gen.check.disagreements > MAX_DISAGREEMENTS:
        raise GenerationError(ErrorCode.HOP_FAILED, f"checked routes disagreed {gen.check.disagreements} times and"
                              " excluding peers did not end it: no token is given that two routes do not agree on")
    a, b = exc.routes
    retries.epoch += 1
    log.warning("checked routes disagree: asking a third route", position=exc.position, tokens=list(exc.tokens),
                peers=sorted(p[-8:] for p in differing_peers(a, b)))
    where = sketch.first_divergence(*exc.sketches) if exc.sketches else None
    if where is not None:
        gen.check.diverged.append(list(where))
        log.warning("the routes' sketches part", layers=f"{where[0]}:{where[1]}")
    suspect = ({p for r in (a, b) for p, start, end in r if start < where[1] and end > where[0]} - {entry.mesh.peer_id}
               if where is not None else differing_peers(a, b))
    try:
        third = entry.plan(retries.failed, retries.busy, avoid=suspect)
    except GenerationError:
        third = None
    c = [[entry.mesh.peer_id, 0, entry.end]] + third.describe() if third is not None else None
    if c is None or not (differing_peers(a, c) and differing_peers(b, c)):
        raise GenerationError(ErrorCode.HOP_FAILED, f"two routes gave different tokens at generated token"
                              f" {exc.position} and no third server of the layers where they differ can settle it")
    extra = (sketch.request(exc.seed),) if exc.sketches else ()
    token, third_sketches = await token_on(entry, third, req, gen, sampling, retries, extra)
    verdict = judge((a, b), where, exc.sketches, c, third_sketches) if where is not None else None
    if verdict is None:  # no sketch to go by: the tokens decide
        verdict = settle((a, b), exc.tokens, c, token)
        if exc.sketches and where is None:  # every hop's sketch agreed within the tolerance: rounding, no liar
            log.warning("checked routes disagree on a token but their sketches agree: nobody excluded")
            verdict = Verdict(verdict.winner, frozenset())
    if verdict.winner is None:
        raise GenerationError(ErrorCode.HOP_FAILED, f"three routes gave three different tokens at generated token"
                              f" {exc.position}: the mesh cannot say which is right")
    suspects = await narrow(entry, exc, verdict, token, third, req, gen, sampling, retries)
    now = time.monotonic()  # the clock of `entry.exclusions`
    layers = {peer: [start, end] for peer, start, end in exc.routes[1 - verdict.winner]}
    for peer in sorted(suspects):
        reason = (f"layers {layers[peer][0]}:{layers[peer][1]} gave token {exc.tokens[1 - verdict.winner]} where two"
                  f" other routes gave {token} (generated token {exc.position})")
        excluded = entry.exclusions.exclude(peer, reason, now)
        gen.check.excluded.append(peer)
        log.warning("peer excluded from routes", peer=peer, reason=reason, times=excluded.times,
                    seconds=round(excluded.until - now, 1))
    retries.epoch += 1


async def token_on(entry, route: Route, req, gen: Generation, sampling, retries, extra=()) -> tuple[int, dict]:
    """The token `route` gives after the generation's accepted tokens (a replay on a fresh session),
    and its hops' sketches of that step when `extra` asks for them."""
    gen.begin_attempt([[entry.mesh.peer_id, 0, entry.end]] + route.describe())
    try:
        async with entry.routes.open_route(route, retries.epoch, req, gen, sampling) as at:
            token = await entry.first_token(at, gen, extra)
            return token, sketch.read(at.last_token.tensors) if extra and at.last_token is not None else {}
    except BaseExceptionGroup as group:
        raise first_of(group) from None


async def sketch_step(gen: Generation, attempts) -> tuple[int, tuple[dict, dict]]:
    """Both routes' hops' sketches of the step they disagreed on (run again, with a seed picked here)."""
    seed = random.getrandbits(62) + 1
    position, step = len(gen.ids) + len(gen.tokens) - 1, len(gen.tokens)
    replies = await both(lambda at: at.advance(step, Phase.DECODE, position, [gen.tokens[-1]],
                                               extra=(sketch.request(seed),)), attempts)
    return seed, (sketch.read(replies[0].tensors), sketch.read(replies[1].tensors))


async def narrow(entry, exc: RoutesDisagree, verdict, token: int, third: Route, req, gen: Generation, sampling,
                 retries) -> frozenset[str]:
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
        if (await token_on(entry, route, req, gen, sampling, retries))[0] != token:
            guilty.add(peer)
    log.info("suspects tried one at a time", suspects=len(verdict.suspects), guilty=len(guilty))
    return frozenset(guilty or verdict.suspects)
