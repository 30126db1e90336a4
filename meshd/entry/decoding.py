"""The decode loop of a try over one route, at the entry: from the token after the prompt (and the tokens
replayed) until the try ends. Each step sends the last accepted token and the drafts proposed after it
(speculation: prompt lookup, a draft model, or what a grammar forces; none for plain decoding) at its
position, and the tail answers with the drafts it accepts and the token after them; a route of this
daemon's layers alone, shared with no other session, runs plain steps back to back on the compute thread.

Rule: the loop ends only where `Generation.take` says (done, or past a longrope model's short table), the
one decode rule the checked (`meshd/entry/lockstep.py`) and local (`meshd/entry/local.py`) paths keep too,
or at a step boundary where a hop of the route left (`Attempt.move`); it says which by the event it
returns (`meshd/entry/stages.py`). A token's text goes to the client while the next step already runs.
"""

from __future__ import annotations

import time

import trio

from meshd.entry.attempt import Attempt
from meshd.entry.drafts import worth_drafting
from meshd.entry.microbatch import Microbatches
from meshd.entry.run import Run
from meshd.entry.stages import Event
from meshd.entry.state import Generation
from meshd.wire import Phase


class Decoding:
    """Decodes the tries of one entry's generations: its hop `service` (whose compute thread runs a draft
    model's proposals, and runs of plain steps), the microbatches in use (how loaded the entry is, which
    says whether drafts pay), and whether and how much it speculates."""

    def __init__(self, service, microbatch_use: Microbatches, speculate: bool, draft_max: int) -> None:
        self.service, self.microbatch_use = service, microbatch_use
        self.speculate, self.draft_max = speculate, draft_max

    async def propose(self, gen: Generation) -> list[int]:
        """The drafts for the generation's next step (a draft model runs on the compute thread)."""
        if gen.drafts is not None and gen.drafts.computes:
            return await self.service.compute.run(gen.propose)
        return gen.propose()

    async def run(self, run: Run, at: Attempt, tokens: list[int]) -> Event:
        """Take the tokens the route gives until the try ends (`Generation.take`; or a hop left: `Event.MOVED`,
        the next route starts from the KV it handed over): each step sends the last accepted token and the
        drafts proposed after it (none without speculation) at its position, and the tail answers with the
        drafts it accepts and the token after them."""
        req, gen = run.req, run.gen
        while True:
            taken, event = gen.take(tokens)
            if event is None and at.move is not None:
                event = Event.MOVED
            if event is not None:
                await run.emit_tokens(taken)
                return event
            # greedy text is the same with drafts or without, so a greedy generation drafts only where
            # it pays; a sampled one's text depends on which steps drafted, and a seed must give the
            # same text whatever the load, so it drafts as its draft length says
            pays = req.temperature > 0 or worth_drafting(len(at.hops), sum(self.microbatch_use.counts()))
            began = time.perf_counter()
            # what a grammar forces comes as drafts, whatever the load: the tail would sample nothing else
            # (plain decoding, --no-speculate, sends none)
            forced = gen.forced(self.draft_max) if gen.check is None and req.speculate and self.speculate else []
            drafts = forced or (await self.propose(gen) if pays else [])
            if not drafts and (req.temperature == 0 or gen.drafts is None) and gen.check is None and at.alone_here():
                tokens = await self._run_here(run, at, taken)
                continue  # its tokens are taken already (but one, if it ran no step)
            # the next step is under way (submitted to this daemon's pass) before the client is
            # sent these tokens' text: writing to the client does not delay every pass here
            async with trio.open_nursery() as overlap:
                overlap.start_soon(run.emit_tokens, taken)
                reply = await at.advance(len(gen.tokens), Phase.VERIFY if drafts else Phase.DECODE, gen.position,
                                         [gen.tokens[-1], *drafts])
            if pays and gen.drafts is not None and not forced:
                gen.drafts.observe(1 + len(drafts), time.perf_counter() - began)
            if drafts:
                gen.verified(len(drafts), reply.accepted, forced=bool(forced))
            tokens = [*drafts[:reply.accepted], reply.token_id]

    async def _run_here(self, run: Run, at: Attempt, taken: list[int]) -> list[int]:
        """Plain decode steps back to back on this daemon's compute thread (`Attempt.run_here`): the route
        is this daemon's layers alone, and no other session shares them. Each token is taken and its
        text sent as it comes, while the next step computes; the run ends where the generation must
        (`Generation.plain_steps_left`, a stop token) or sooner, and `run` goes on from the last
        token taken. Only where the text cannot depend on it: greedy, or sampled without drafts (a run
        ends when other work comes, and a sampled generation's drafts would change its text). Returns
        the token of one ordinary step, not yet taken, where other work came before the run's first."""
        gen = run.gen
        await run.emit_tokens(taken)
        ran, position = False, gen.position
        async with at.run_here(len(gen.tokens), position, gen.tokens[-1], gen.plain_steps_left(), gen.stop) as tokens:
            async for token in tokens:
                ran = True
                gen.accept(token)
                await run.emit_token(token)
        if ran:
            return []
        reply = await at.advance(len(gen.tokens), Phase.DECODE, position, [gen.tokens[-1]])
        return [reply.token_id]
