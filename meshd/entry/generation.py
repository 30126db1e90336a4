"""Generation at an entry daemon: plan a route, open a session on every hop, pipeline, stream text.

Rules: the entry runs its own layers [0, k) and holds one long-lived stream per further hop (its
sessions, pings and errors). Hidden states go from hop to hop: each hop is told the next one and
sends its output there, and the tail's token comes back to the entry, one transfer a hop a token.
A hop that cannot reach its next hop sends its output back instead, and the entry passes it on.
Prefill chunks overlap across stages. Generations are spread over microbatches that hops never mix
in a pass, and a token's text goes to the client while its next step already runs. A hop that fails
makes the entry plan a new route (new epoch) without that peer and replay the prompt and the tokens
so far: the client sees a pause, not an error, while the mesh still covers the model
(`meshd/entry/policy.py` decides). Close, cancel or a vanished client release the KV on every hop.
A generation of a longrope model (Phi-3) that grows past its short RoPE table ends its try
(`SwitchTable`) and opens a route again on the long table, computing the whole sequence anew as
transformers does (`meshd/entry/state.py`).
Planning and opening a route are `meshd/entry/opening.py`'s; driving one is `meshd/entry/attempt.py`'s.

An `Entry` belongs to one loaded range (the daemon makes a new one when it moves): a generation that
began before a move reroutes from the layers it started with.
"""

from __future__ import annotations

import json
import time
from typing import Awaitable, Callable

import trio

from meshd.entry.affinity import Affinity
from meshd.entry.attempt import Attempt
from meshd.entry.checked import run_checked, settle_disagreement
from meshd.entry.checks import Check, Exclusions, chosen
from meshd.entry.drafts import DRAFT_MAX, Drafts, StepCosts, worth_drafting
from meshd.entry.errors import GenerationError, HopFailed, Moved, RoutesDisagree, SwitchTable, first_of, outcome_of
from meshd.entry.microbatch import Microbatches
from meshd.entry.opening import Routes
from meshd.entry.policy import BUSY_WAIT_S, Retries
from meshd.entry.route import Route
from meshd.entry.state import Generation, stop_ids
from meshd.node.log import get_logger
from meshd.shard import grammar, rope
from meshd.shard.sampler import SamplingParams
from meshd.shard.tokenizer import TextStream, encode_messages, encode_prompt
from meshd.wire import ErrorCode, GenerateRequest, Phase, StreamEvent

log = get_logger(__name__)
Emit = Callable[[StreamEvent], Awaitable[None]]


class Entry:
    """Runs generations on one loaded head range: its hop service (`service`, which runs layers
    [0, `end`)), the tokenizer, and the mesh view it plans routes on."""

    def __init__(self, service, tokenizer, config, model_fp: str, recipe_fp: str, mesh, open_stream, *,
                 end: int, busy_wait_s: float = BUSY_WAIT_S, forwarding: bool = True, microbatches: int = 2,
                 speculate: bool = True, draft_max: int = DRAFT_MAX, draft_model=None, ledger=None,
                 verify_rate: float = 0.0, exclusions: Exclusions | None = None, prefix_ttl_s: float = 0.0) -> None:
        self.service, self.tokenizer, self.config = service, tokenizer, config
        self.mesh, self.end = mesh, end
        self.busy_wait_s = busy_wait_s
        self.speculate, self.draft_max = speculate, draft_max  # drafts, at most so many a step
        self.draft_model = draft_model  # drafts from a model (--draft; meshd/entry/draftmodel.py), else prompt lookup
        self.drafted = self.accepted = 0  # draft tokens sent and accepted, all generations (status, metrics)
        self.microbatch_use = Microbatches()
        self.ledger = ledger  # the daemon's work ledger (meshd/node/ledger.py), when it keeps one
        self.verify_rate = verify_rate  # share of generations checked on a second route (meshd/entry/checked.py)
        self.exclusions = Exclusions() if exclusions is None else exclusions  # peers kept off routes (the
        # daemon's, shared by its entries across moves; its times are time.monotonic())
        self.checked = self.disagreed = 0  # generations checked on two routes, and of those, disagreements
        self.handovers = self.handover_fallbacks = 0  # routes moved off a leaving hop: its KV handed over, or replayed
        self.routes = Routes(service, mesh, open_stream, end=end, model_fp=model_fp, recipe_fp=recipe_fp,
                             forwarding=forwarding, microbatches=microbatches, microbatch_use=self.microbatch_use,
                             exclusions=self.exclusions,  # plans and opens this range's routes
                             affinity=Affinity(prefix_ttl_s) if prefix_ttl_s > 0 else None)

    def start(self, req: GenerateRequest) -> tuple[Generation, SamplingParams]:
        """The generation a request asks for, or the `bad_frame` GenerationError that refuses it."""
        try:
            tools = json.loads(req.tools) if req.tools else None  # OpenAI tool definitions the template renders
            ids = (encode_messages(self.tokenizer, json.loads(req.messages), tools, constrained=bool(req.grammar))
                   if req.messages else encode_prompt(self.tokenizer, req.prompt, req.chat))
            sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)
        except (ValueError, TypeError, KeyError) as exc:  # a bad conversation, no chat template, bad sampling
            raise GenerationError(ErrorCode.BAD_FRAME, f"bad request (prompt, conversation or sampling): {exc}") from None
        stop = stop_ids(self.config, self.tokenizer, req.ignore_eos)
        gen = Generation.start(ids, req.max_tokens, self.config.max_positions, stop,
                               rope.switch(self.config.rope_scaling))
        if req.grammar:  # compiled once here; the hop that samples compiles it again from the same text
            try:
                lltok = grammar.ll_tokenizer(self.tokenizer)
                grammar.check(req.grammar, lltok)
                gen.grammar, gen.guide = req.grammar, grammar.Constraint(req.grammar, lltok, len(ids))
            except grammar.GrammarError as exc:
                raise GenerationError(ErrorCode.BAD_FRAME, str(exc)) from None
        drafts = self.drafts_for(req)
        # a check runs without drafts (meshd/entry/checked.py), and a sampled generation's text depends on
        # which steps drafted: a check drawn at random takes only generations whose text it cannot change
        # (greedy, or without drafts anyway), so a seed gives the same text whether the draw fell or not
        rate = self.verify_rate if req.temperature == 0 or drafts is None else 0.0
        if chosen(rate, req.verify):
            gen.check = Check()
            gen.reuse = False  # a checked generation computes its whole prompt on both routes
        else:
            gen.drafts = drafts
        return gen, sampling

    def drafts_for(self, req: GenerateRequest) -> Drafts | None:
        """Where a generation's drafts come from (None: plain decoding)."""
        if not (self.speculate and req.speculate and self.draft_max > 0):
            return None
        # a greedy generation's drafts are weighed against trips as timed (its text is the same either
        # way); a sampled one's follow its acceptance alone, so a seed gives the same text whatever the load
        return Drafts(self.draft_max, self.draft_model.session() if self.draft_model is not None else None,
                      StepCosts() if req.temperature == 0 else None)

    async def propose(self, gen: Generation) -> list[int]:
        """The drafts for the generation's next step (a draft model runs on the compute thread)."""
        if gen.drafts is not None and gen.drafts.computes:
            return await self.service.compute.run(gen.propose)
        return gen.propose()

    async def generate(self, req: GenerateRequest, emit: Emit) -> dict:
        if req.grammar:  # the tokenizer as grammars see it: built once (~0.35 s), not on the event loop
            await trio.to_thread.run_sync(grammar.ll_tokenizer, self.tokenizer)
        gen, sampling = self.start(req)
        row = self.ledger.begin_generation(req.request_id) if self.ledger is not None else None
        failure = None
        try:
            return await self._generate(req, gen, sampling, emit)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if gen.drafts is not None and gen.drafts.computes:  # the draft model's KV of this generation
                with trio.CancelScope(shield=True):
                    await self.service.compute.run(gen.drafts.close)
            if self.ledger is not None:
                self.ledger.end_generation(row, self.mesh.peer_id, outcome_of(failure), len(gen.ids), len(gen.tokens),
                                           gen.work(), gen.reroutes, checked=gen.check is not None and gen.check.ran,
                                           agreed=gen.check.agreed if gen.check is not None else None)

    async def _generate(self, req: GenerateRequest, gen: Generation, sampling, emit: Emit) -> dict:
        text = TextStream(self.tokenizer)
        retries = Retries(deadline=trio.current_time() + self.busy_wait_s, busy_wait_s=self.busy_wait_s,
                          lapse_wait_s=self.mesh.ttl_s)
        disagreed: RoutesDisagree | None = None  # two routes' tokens differed: a third route must settle it
        moved: Moved | None = None  # a hop of the last try left: the next try's route and its hops' streams
        while True:
            try:
                try:
                    if disagreed is not None:
                        exc, disagreed = disagreed, None
                        await settle_disagreement(self, exc, req, gen, sampling, retries)
                    if gen.check is not None:
                        await run_checked(self, req, gen, sampling, retries, text, emit)
                    else:
                        after, moved = moved, None
                        await self.attempt(req, gen, sampling, retries, text, emit, *((after.route, after.channels)
                                                                                      if after else ()))
                except BaseExceptionGroup as group:  # trio wraps errors of concurrent tasks
                    raise first_of(group) from None
                break
            except RoutesDisagree as exc:  # nothing was emitted: settle it, then go on around the liar
                disagreed = exc
            except SwitchTable:  # the next try opens its sessions on the long table (see Routes.open_route)
                pass
            except Moved as exc:  # a hop left: its replica holds its KV (else the next route goes without it)
                retries.left(exc.peer_id)
                self.routes.suspects.failed(exc.peer_id, time.monotonic())  # new generations keep off it too
                handed = exc.route is not None
                moved, gen.resume = (exc if handed else None), handed
                gen.handovers += handed
                gen.handover_fallbacks += exc.tried and not handed
                self.handovers += handed
                self.handover_fallbacks += exc.tried and not handed
            except HopFailed as exc:
                if exc.busy_s is not None:
                    log.info("hop busy, trying another route", peer=exc.peer_id[-8:])
                else:
                    log.warning("hop failed, rerouting", error=str(exc), attempt=retries.failures)
                    self.routes.suspects.failed(exc.peer_id, time.monotonic())  # later generations avoid it a while
                retries.after_failure(exc)  # raises when the generation must give up
                gen.reroutes = retries.reroutes
            except GenerationError as exc:
                wait = retries.look_again(exc, self.mesh.lapsed_serving(self.end), trio.current_time())
                if wait is not None:  # a record may have lapsed, or never reached this view: look again
                    log.info("no route while a record that served it lapsed: waiting for its republish" if wait
                             else "no route in this daemon's view: refreshing it once", error=str(exc),
                             wait_s=round(wait, 2))
                    await trio.sleep(wait)
                    await self.mesh.refresh()
                    continue
                await trio.sleep(retries.after_refusal(exc, trio.current_time()))  # raises past the deadline
        stats = gen.stats()
        if gen.check is not None and gen.check.ran:
            self.checked += 1
            self.disagreed += gen.check.disagreements > 0
        self.drafted += gen.drafted
        self.accepted += gen.accepted_drafts
        log.info("generation done", tokens=stats["tokens"], prompt_tokens=len(gen.ids), reroutes=gen.reroutes,
                 seconds=round(time.perf_counter() - gen.started_at, 3))
        return {**stats, "route": gen.route, "reroutes": gen.reroutes,
                "entry_compute_s": round(gen.local_s, 3), "route_wait_s": round(gen.wait_s, 3)}

    def plan(self, failed: set[str], busy: set[str], avoid: set[str] = frozenset()) -> Route:
        """A route from this entry's layers on (see `Routes.plan`)."""
        return self.routes.plan(failed, busy, avoid)

    async def attempt(self, req, gen: Generation, sampling, retries: Retries, text, emit,
                      route: Route | None = None, channels: dict | None = None) -> None:
        """One try at the generation over `route` (else one planned around the failed and busy hops),
        its text emitted as it comes; `channels`: streams to some of its hops to open their sessions on."""
        route = (self.routes.plan(retries.failed, retries.busy, gen=gen, unreachable=retries.unreachable)
                 if route is None else route)
        gen.begin_attempt([[self.mesh.peer_id, 0, self.end]] + route.describe())
        async with self.routes.open_route(route, retries.epoch, req, gen, sampling, channels) as at:
            token = await self.first_token(at, gen)
            await self._decode(at, req, gen, text, [token], emit)
            at.completed = True

    @staticmethod
    async def first_token(at: Attempt, gen: Generation, extra=()) -> int:
        """The prompt through the route (on a longrope model's long table, with the tokens generated
        before it took over), then (after a reroute) the tokens so far: the token after them (`extra`
        tensors go with the last replayed frame: a sketch request)."""
        prefill, fed_back, start = gen.prefill_ids, gen.fed_back, gen.start_at
        if start >= len(prefill):  # the route holds the prompt and some generated tokens (a hand-over's KV)
            return await at.replay(fed_back[start - len(prefill):], start, extra)
        token = await at.prefill(prefill, start)  # from what every session of the route holds already
        if fed_back:  # a replay after rerouting feeds back what was generated
            token = await at.replay(fed_back, len(prefill), extra)
        return token

    async def _decode(self, at: Attempt, req, gen: Generation, text, tokens: list[int], emit) -> None:
        """Take the tokens the route gives until the generation is done: each step sends the last
        accepted token and the drafts proposed after it (none without speculation) at its position,
        and the tail answers with the drafts it accepts and the token after them."""
        while not gen.done:
            taken = []
            for token in tokens:
                taken.append(token)
                if gen.accept(token):
                    for t in taken:
                        await self.emit_token(req, gen, text, t, emit)
                    return
            if gen.past_switch:  # the next position needs the long table: this route's sessions cannot go on
                await self.emit_tokens(req, gen, text, taken, emit)
                raise SwitchTable(len(gen.ids) + len(gen.tokens), gen.switch)
            if at.move is not None:  # a hop left: the next route starts from the KV it handed over
                await self.emit_tokens(req, gen, text, taken, emit)
                raise at.move
            # greedy text is the same with drafts or without, so a greedy generation drafts only where
            # it pays; a sampled one's text depends on which steps drafted, and a seed must give the
            # same text whatever the load, so it drafts as its draft length says
            pays = req.temperature > 0 or worth_drafting(len(at.hops), sum(self.microbatch_use.counts()))
            began = time.perf_counter()
            # what a grammar forces comes as drafts, whatever the load: the tail would sample nothing else
            # (plain decoding, --no-speculate, sends none)
            forced = gen.forced(self.draft_max) if gen.check is None and req.speculate and self.speculate else []
            drafts = forced or (await self.propose(gen) if pays else [])
            position = len(gen.ids) + len(gen.tokens) - 1  # the last accepted token's
            if not drafts and (req.temperature == 0 or gen.drafts is None) and gen.check is None and at.alone_here():
                tokens = await self._run_here(at, req, gen, text, taken, position, emit)
                continue  # its tokens are taken already (but one, if it ran no step)
            # the next step is under way (submitted to this daemon's pass) before the client is
            # sent these tokens' text: writing to the client does not delay every pass here
            async with trio.open_nursery() as overlap:
                overlap.start_soon(self.emit_tokens, req, gen, text, taken, emit)
                reply = await at.advance(len(gen.tokens), Phase.VERIFY if drafts else Phase.DECODE, position,
                                         [gen.tokens[-1], *drafts])
            if pays and gen.drafts is not None and not forced:
                gen.drafts.observe(1 + len(drafts), time.perf_counter() - began)
            if drafts:
                gen.verified(len(drafts), reply.accepted, forced=bool(forced))
            tokens = [*drafts[:reply.accepted], reply.token_id]

    async def _run_here(self, at: Attempt, req, gen: Generation, text, taken: list[int], position: int,
                        emit) -> list[int]:
        """Plain decode steps back to back on this daemon's compute thread (`Attempt.run_here`): the route
        is this daemon's layers alone, and no other session shares them. Each token is taken and its
        text sent as it comes, while the next step computes; the run ends where the generation must
        (`Generation.plain_steps_left`, a stop token) or sooner, and `_decode` goes on from the last
        token taken. Only where the text cannot depend on it: greedy, or sampled without drafts (a run
        ends when other work comes, and a sampled generation's drafts would change its text). Returns
        the token of one ordinary step, not yet taken, where other work came before the run's first."""
        await self.emit_tokens(req, gen, text, taken, emit)
        ran = False
        async with at.run_here(len(gen.tokens), position, gen.tokens[-1], gen.plain_steps_left(), gen.stop) as tokens:
            async for token in tokens:
                ran = True
                gen.accept(token)
                await self.emit_token(req, gen, text, token, emit)
        if ran:
            return []
        reply = await at.advance(len(gen.tokens), Phase.DECODE, position, [gen.tokens[-1]])
        return [reply.token_id]

    async def emit_tokens(self, req, gen: Generation, text, tokens: list[int], emit) -> None:
        """The tokens' text, in order, all of it (they count as generated: see `emit_token`)."""
        with trio.CancelScope(shield=True):
            for token in tokens:
                await self.emit_token(req, gen, text, token, emit)

    @staticmethod
    async def emit_token(req, gen: Generation, text, token: int, emit) -> None:
        """Send a generated token's text to the client. Not cancelled half-way by a hop failing
        meanwhile: the token counts as generated, and a reroute does not send its text again."""
        piece = text.push(token)
        gen.streamed += 1
        if piece:  # how many tokens the text so far holds; the first text also how long the prompt was,
            first = {"prompt_tokens": len(gen.ids), "cached_tokens": gen.reused}  # and how much of it was reused
            stats = {"tokens": gen.streamed} | (first if not gen.emitted else {})
            gen.emitted = True
            with trio.CancelScope(shield=True):
                await emit(StreamEvent(request_id=req.request_id, kind="text", text=piece, token_id=token,
                                       stats=stats))
