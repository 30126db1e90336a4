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
(`Event.SWITCHED`) and opens a route again on the long table, computing the whole sequence anew as
transformers does (`meshd/entry/state.py`).
The generation moves through its stages by the table of `meshd/entry/stages.py`: each stage (a try, a
settlement, a wait) returns the event that ends it, and `_stage` is the one place where a hop's failure
or a refusal, which come as exceptions, become theirs. Planning and opening a route are
`meshd/entry/opening.py`'s; driving one is `meshd/entry/attempt.py`'s; a checked generation's two routes
are `meshd/entry/windows.py`'s (checked by prefill) or `meshd/entry/lockstep.py`'s (in lockstep).

An `Entry` belongs to one loaded range (the daemon makes a new one when it moves): a generation that
began before a move reroutes from the layers it started with.
"""

from __future__ import annotations

import json
import time

import trio

from meshd.core.settings import default
from meshd.entry.affinity import Affinity
from meshd.entry.attempt import first_token
from meshd.entry.checks import Check, Checking, Exclusions, chosen
from meshd.entry.decoding import Decoding
from meshd.entry.drafts import DRAFT_MAX, Drafts, StepCosts
from meshd.entry.errors import GenerationError, HopFailed, ending, first_of
from meshd.entry.lockstep import Lockstep
from meshd.entry.microbatch import Microbatches
from meshd.entry.opening import Routes
from meshd.entry.policy import BUSY_WAIT_S, Retries
from meshd.entry.route import Route
from meshd.entry.run import Emit, Run
from meshd.entry.stages import Event, Stage
from meshd.entry.state import Generation, stop_ids
from meshd.entry.windows import Windows
from meshd.core.log import get_logger
from meshd.shard import grammar, rope
from meshd.shard.sampler import SamplingParams
from meshd.shard.tokenizer import TextStream, encode_messages, encode_prompt
from meshd.wire import ErrorCode, GenerateRequest

log = get_logger(__name__)


class Entry:
    """Runs generations on one loaded head range: its hop service (`service`, which runs layers
    [0, `end`)), the tokenizer, and the mesh view it plans routes on."""

    def __init__(self, service, tokenizer, config, model_fp: str, recipe_fp: str, mesh, open_stream, *,
                 end: int, busy_wait_s: float = BUSY_WAIT_S, forwarding: bool = True,
                 microbatches: int = default("microbatches"), speculate: bool = True, draft_max: int = DRAFT_MAX,
                 draft_model=None, ledger=None, verify_rate: float = 0.0, exclusions: Exclusions | None = None,
                 prefix_ttl_s: float = 0.0, chunk_tokens: int = default("chunk_tokens"),
                 encoding: str = default("wire_encoding"), checking: Checking = Checking()) -> None:
        self.service, self.tokenizer, self.config = service, tokenizer, config
        self.mesh, self.end, self.busy_wait_s = mesh, end, busy_wait_s
        self.speculate, self.draft_max = speculate, draft_max  # drafts, at most so many a step
        self.draft_model = draft_model  # drafts from a model (--draft; meshd/entry/draftmodel.py), else prompt lookup
        self.microbatch_use = Microbatches()
        self.ledger = ledger  # the daemon's work ledger (meshd/node/ledger.py), when it keeps one
        self.verify_rate = verify_rate  # share of generations checked on a second route
        self.checking = checking  # how: by prefill (meshd/entry/windows.py) or in lockstep (meshd/entry/lockstep.py)
        self.exclusions = Exclusions() if exclusions is None else exclusions  # peers kept off routes (the
        # daemon's, shared by its entries across moves; its times are time.monotonic())
        self.checked = self.disagreed = 0  # generations checked on two routes, and of those, disagreements
        self.handovers = self.handover_fallbacks = 0  # routes moved off a leaving hop: its KV handed over, or replayed
        self.routes = Routes(service, mesh, open_stream, end=end, model_fp=model_fp, recipe_fp=recipe_fp,
                             forwarding=forwarding, microbatches=microbatches, microbatch_use=self.microbatch_use,
                             exclusions=self.exclusions,  # plans and opens this range's routes
                             affinity=Affinity(prefix_ttl_s) if prefix_ttl_s > 0 else None,
                             chunk_tokens=chunk_tokens, encoding=encoding)
        self.decoding = Decoding(service, self.microbatch_use, speculate, draft_max)  # a try's decode loop
        self.lockstep = Lockstep(mesh.peer_id, end, self.routes, self.exclusions, self._unchecked)  # checked ones,
        self.windows = Windows(mesh.peer_id, end, self.routes, checking, self.decoding,
                               self._unchecked)  # and the lockstep settles them all

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
        # a check runs without drafts (meshd/entry/lockstep.py), and a sampled generation's text depends on
        # which steps drafted: a check drawn at random takes only generations whose text it cannot change
        # (greedy, or without drafts anyway), so a seed gives the same text whether the draw fell or not
        rate = self.verify_rate if req.temperature == 0 or drafts is None else 0.0
        if chosen(rate, req.verify):
            gen.check = Check(by=self.checking.by)
            gen.reuse = False  # a checked generation computes its whole prompt on both routes
            if self.checking.by == "prefill" and req.temperature == 0:
                gen.drafts = drafts  # its first route drafts as an unchecked one (meshd/entry/windows.py)
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
            end = ending(failure)
            if gen.drafts is not None and gen.drafts.computes:  # the draft model's KV of this generation
                with trio.CancelScope(shield=True):
                    await self.service.compute.run(gen.drafts.close)
            if self.ledger is not None:
                self.ledger.end_generation(row, self.mesh.peer_id, end.outcome, len(gen.ids), len(gen.tokens),
                                           gen.work(), gen.reroutes, checked=gen.check is not None and gen.check.ran,
                                           agreed=gen.check.agreed if gen.check is not None else None,
                                           windows=gen.check.windows if gen.check is not None else ())
            gen.course.end(end.outcome)

    async def _generate(self, req: GenerateRequest, gen: Generation, sampling, emit: Emit) -> dict:
        """Move the generation through its stages (`meshd/entry/stages.py`) until it completes; the client's stats."""
        run = Run(req, gen, sampling, Retries(deadline=trio.current_time() + self.busy_wait_s,
                                              busy_wait_s=self.busy_wait_s, lapse_wait_s=self.mesh.ttl_s),
                  TextStream(self.tokenizer), emit)
        while not gen.course.ended:
            gen.course.to(await self._stage(run))
        return self._done(run)

    async def _stage(self, run: Run) -> Event:
        """Run the generation's current stage; the event that ends it. A hop that fails and a refusal come as
        exceptions from beneath, and become their events here (or the GenerationError the client gets)."""
        stage = run.gen.course.stage
        try:
            try:
                if stage is Stage.SETTLING:  # nothing was emitted: settle it, then go on around the liar
                    return await self.lockstep.settle(run)
                if stage is Stage.WAITING:
                    return await self._wait(run)
                return await self._try(run)
            except BaseExceptionGroup as group:  # trio wraps errors of concurrent tasks
                raise first_of(group) from None
        except HopFailed as exc:
            return self._hop_failed(run, exc)
        except GenerationError as exc:
            return self._refused(run, exc)

    async def _try(self, run: Run) -> Event:
        """One try: on two routes when the generation is checked, else on one (where a hop of the last try left
        with its KV handed over, the same hops with its replica)."""
        if run.gen.check is not None:
            event = await (self.windows if run.gen.check.by == "prefill" else self.lockstep).run(run)
        else:
            after, run.moved = run.moved, None
            event = await self.attempt(run, *((after.route, after.channels) if after else ()))
        if event is Event.MOVED:
            self._moved(run)
        return event

    def _moved(self, run: Run) -> None:
        """A hop left: its replica holds its KV (else the next route goes without it)."""
        move, gen = run.moved, run.gen
        run.retries.left(move.peer_id)
        self.routes.suspects.failed(move.peer_id, time.monotonic())  # new generations keep off it too
        handed, fallback = move.route is not None, move.tried and move.route is None
        run.moved, gen.resume = (move if handed else None), handed
        gen.handovers, gen.handover_fallbacks = gen.handovers + handed, gen.handover_fallbacks + fallback
        self.handovers, self.handover_fallbacks = self.handovers + handed, self.handover_fallbacks + fallback

    def _hop_failed(self, run: Run, exc: HopFailed) -> Event:
        """A hop failed or is full: the next try plans around it (or the GenerationError that gives up)."""
        if exc.busy_s is not None:
            log.info("hop busy, trying another route", peer=exc.peer_id[-8:])
        else:
            log.warning("hop failed, rerouting", error=str(exc), attempt=run.retries.failures)
            self.routes.suspects.failed(exc.peer_id, time.monotonic())  # later generations avoid it a while
        run.retries.after_failure(exc)  # raises when the generation must give up
        run.gen.reroutes = run.retries.reroutes
        return Event.HOP_FAILED

    def _refused(self, run: Run, exc: GenerationError) -> Event:
        """No route, or no room: how long to wait before the next try (or the GenerationError that gives up)."""
        wait = run.retries.look_again(exc, self.mesh.lapsed_serving(self.end), trio.current_time())
        if wait is not None:  # a record may have lapsed, or never reached this view: look again
            log.info("no route while a record that served it lapsed: waiting for its republish" if wait
                     else "no route in this daemon's view: refreshing it once", error=str(exc), wait_s=round(wait, 2))
            run.wait = (wait, True)
        else:
            run.wait = (run.retries.after_refusal(exc, trio.current_time()), False)  # raises past the deadline
        return Event.REFUSED

    async def _wait(self, run: Run) -> Event:
        await trio.sleep(run.wait[0])
        if run.wait[1]:  # then the mesh view is refreshed
            await self.mesh.refresh()
        return Event.WAITED

    def _done(self, run: Run) -> dict:
        """The client's stats of a completed generation (and this entry's counts of checks)."""
        gen, stats = run.gen, run.gen.stats()
        if gen.check is not None and gen.check.ran:
            self.checked += 1
            self.disagreed += gen.check.disagreements > 0
        log.info("generation done", tokens=stats["tokens"], prompt_tokens=len(gen.ids), reroutes=gen.reroutes,
                 seconds=round(time.perf_counter() - gen.started_at, 3))
        return {**stats, "route": gen.route, "reroutes": gen.reroutes,
                "entry_compute_s": round(gen.local_s, 3), "route_wait_s": round(gen.wait_s, 3)}

    def plan(self, failed: set[str], busy: set[str], avoid: set[str] = frozenset()) -> Route:
        """A route from this entry's layers on (see `Routes.plan`)."""
        return self.routes.plan(failed, busy, avoid)

    async def attempt(self, run: Run, route: Route | None = None, channels: dict | None = None) -> Event:
        """One try at the generation over `route` (else one planned around the failed and busy hops),
        its text emitted as it comes; how it ended. `channels`: streams to some of its hops to open their
        sessions on."""
        gen, retries = run.gen, run.retries
        route = (self.routes.plan(retries.failed, retries.busy, gen=gen, unreachable=retries.unreachable)
                 if route is None else route)
        gen.begin_attempt([[self.mesh.peer_id, 0, self.end]] + route.describe())
        async with self.routes.open_route(route, retries.epoch, run.req, gen, run.sampling, channels) as at:
            event = await self.decoding.run(run, at, [await first_token(at)])
            at.completed = event is Event.DONE
            if event is Event.MOVED:
                run.moved = at.move
        return event

    async def _unchecked(self, run: Run, route: Route) -> Event:
        """A checked generation's try on one route, no replica serving any of its layers: speculation as usual."""
        run.gen.drafts = run.gen.drafts or self.drafts_for(run.req)
        return await self.attempt(run, route)
