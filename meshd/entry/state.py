"""One generation's state, apart from how its tokens are computed: the prompt, the limits, when it
stops, the RoPE table its sessions open with, what a replay after a reroute must feed back, and the
stats the client gets.

A longrope model (Phi-3) rotates a sequence of at most `switch` positions with its short table and a
longer one with its long table from position 0 (`meshd/shard/rope.py`), as transformers does: a prompt
already longer opens on the long table, and a generation that grows past the switch is opened again on
the long table and computes its whole sequence anew as a prefill, then samples on (`past_switch`).

Rule: the mesh's entry (`meshd/entry/generation.py`, its checked generations in `meshd/entry/lockstep.py`)
and `meshd local` (`meshd/entry/local.py`) all run a generation through this record, so they agree on
limits, stop tokens and stats; and every one of them decodes by `take`, the one decode loop's rule (which
tokens a step's answer adds, and whether the generation is done, must open its sessions again on the long
table, or takes another step), and moves its `course` (`meshd/entry/stages.py`) by what `take` says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshd.entry.checks import Check
from meshd.entry.drafts import Drafts
from meshd.entry.errors import GenerationError
from meshd.entry.stages import Course, Event
from meshd.shard import prefix, rope
from meshd.shard.grammar import Constraint, GrammarError
from meshd.shard.sampler import SamplingParams
from meshd.wire import ErrorCode, OpenSession


def stop_ids(config, tokenizer, ignore_eos: bool = False) -> frozenset[int]:
    """The tokens that end a generation: the model's and the tokenizer's end of sequence."""
    if ignore_eos:
        return frozenset()
    return frozenset(i for i in (config.eos_id, getattr(tokenizer, "eos_token_id", None)) if i is not None)


@dataclass
class Generation:
    ids: list[int]  # the prompt's tokens
    max_tokens: int  # tokens it may generate (already cut to the context)
    stop: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # generated so far (a reroute replays them)
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    route: list = field(default_factory=list)  # the current attempt's hops, [peer, start, end] each
    attempts: list[tuple[list, int]] = field(default_factory=list)  # every route taken, with the tokens
    # generated when it began (an attempt computes the prompt and every token up to the next one's start)
    reroutes: int = 0
    local_s: float = 0.0  # time in the entry's own layers
    wait_s: float = 0.0  # time waiting for the rest of the route
    emitted: bool = False  # some text has reached the client
    streamed: int = 0  # tokens whose text went to the client (a token may add none: its text comes with a later one)
    drafts: Drafts | None = None  # speculation: where the drafts come from (None: plain decoding)
    drafted: int = 0  # draft tokens sent down the route
    accepted_drafts: int = 0  # of those, accepted by the tail
    check: Check | None = None  # a checked generation's account (None: not chosen for checking)
    switch: int = 0  # longrope: a longer sequence runs on the long RoPE table from position 0 (0: one table)
    long_from: int | None = None  # tokens generated when the long table took over (None: not yet; 0: the prompt)
    reuse: bool = True  # its routes may start from KV hops kept of the same tokens (meshd/shard/prefix.py)
    reused: int = 0  # prompt positions the last route started with, kept from an earlier generation
    skipped: dict[int, int] = field(default_factory=dict)  # attempt -> prompt positions its route did not compute
    grammar: str = ""  # what every generated token keeps to (meshd/shard/grammar.py); the hop that samples masks
    guide: Constraint | None = None  # the grammar's state after the tokens so far, here: its forced tokens are drafts
    resume: bool = False  # the next route may start from KV of the generated tokens too (a hand-over's route)
    start_at: int = 0  # positions the current route started with (kept or handed-over KV): it computes from there
    handovers: int = 0  # routes switched because a hop left, its KV handed over (meshd/hop/handover.py)
    handover_fallbacks: int = 0  # ... and those whose hand-over failed: replayed on a route without it
    course: Course = field(default_factory=Course, compare=False)  # its stage (meshd/entry/stages.py)

    @classmethod
    def start(cls, ids: list[int], requested: int, max_positions: int, stop: frozenset[int] = frozenset(),
              switch: int = 0) -> "Generation":
        """A generation of at most `requested` tokens, cut to what the context leaves after the prompt."""
        room = max_positions - len(ids)
        if room <= 0:
            raise GenerationError(ErrorCode.BAD_FRAME, f"prompt of {len(ids)} tokens exceeds the context")
        return cls(ids=list(ids), max_tokens=max(0, min(requested, room)), stop=frozenset(stop), switch=switch)

    @property
    def max_length(self) -> int:
        """Positions a session of this generation may fill (its KV is promised for them)."""
        return len(self.ids) + self.max_tokens

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens or bool(self.tokens and self.tokens[-1] in self.stop)

    @property
    def position(self) -> int:
        """The last accepted token's position: the next decode step feeds that token there."""
        return len(self.ids) + len(self.tokens) - 1

    def take(self, tokens: list[int]) -> tuple[list[int], Event | None]:
        """Take the tokens a step answered, in order, while the generation may take more: those taken (their
        text goes to the client), and what ends the try: `Event.DONE` (the last one it may take was taken, or it
        was done already), `Event.SWITCHED` (its sequence is past a longrope model's short table: the sessions
        must open again on the long one, computing it anew), or None (the next decode step, at `position`)."""
        taken: list[int] = []
        if self.done:
            return taken, Event.DONE
        for token in tokens:
            taken.append(token)
            if self.accept(token):
                return taken, Event.DONE
        return taken, Event.SWITCHED if self.past_switch else None

    @property
    def rope_table(self) -> int:
        """The RoPE table this generation's sessions open with now."""
        return rope.SHORT if self.long_from is None else rope.LONG

    @property
    def past_switch(self) -> bool:
        """Whether the sequence to compute (the prompt and every token, the last one not yet fed) has grown
        past the short table: its sessions must be opened again on the long table (`take_table`)."""
        return bool(self.switch) and self.long_from is None and len(self.ids) + len(self.tokens) > self.switch

    def take_table(self) -> bool:
        """Settle the table for sessions about to open: the long one from here on once the sequence is past
        the switch. True when it switched now (the caller logs it)."""
        if not self.past_switch:
            return False
        self.long_from = len(self.tokens)
        return True

    @property
    def prefill_ids(self) -> list[int]:
        """What a route's sessions compute as a prefill: the prompt, and on the long table the tokens
        generated before it took over (computed anew with the prompt, as transformers does)."""
        return self.ids + self.tokens[:self.long_from or 0]

    @property
    def fed_back(self) -> list[int]:
        """The tokens a new route replays after the prefill, as the decode steps they first were."""
        return self.tokens[self.long_from or 0:]

    def prefix_asked(self, root: bytes) -> list[bytes]:
        """The chain of the tokens a route's sessions may start from, kept: the prefill but its last token
        (the tail must compute a position to sample from), and under a grammar the prompt's only (the
        sampling hop's grammar must be fed every generated token). Empty when reuse is off."""
        ids = (self.prefill_ids + self.fed_back if self.resume else self.prefill_ids)[:-1]
        return prefix.chain(ids[:len(self.ids)] if self.grammar else ids, root) if self.reuse else []

    def prefix_held(self, root: bytes) -> list[bytes]:
        """The chain of the tokens a route that computed this whole generation holds KV of: the prompt and
        every generated token but the last (sampled, never fed). Drafts the tail rejected are not in it."""
        return prefix.chain((self.ids + self.tokens)[:-1], root) if self.reuse else []

    def begin_attempt(self, route: list) -> None:
        """A new route for this generation (the first, or one after a reroute)."""
        self.route = route
        self.attempts.append((route, len(self.tokens)))

    def work(self) -> list[tuple[list, int]]:
        """Each route taken and the positions it computed: the prompt and the tokens fed back up to
        where the next route took over (the last token of all is sampled, never fed), less the prompt
        positions it started with (kept KV); the drafts the tail rejected were computed too (counted on
        the last route)."""
        ends = [began for _, began in self.attempts[1:]] + [max(0, len(self.tokens) - 1)
                                                            + self.drafted - self.accepted_drafts]
        return [(route, len(self.ids) + end - self.skipped.get(i, 0))
                for i, ((route, _), end) in enumerate(zip(self.attempts, ends))]

    def started_from(self, reused: int) -> None:
        """The route just opened holds the first `reused` positions already (kept KV, or handed over after a
        hop left: `resume`): it computes from there (the last position at least, to sample after it), and
        they are not counted as its work. `reused` (the client's cached prompt tokens) counts kept KV only."""
        total = len(self.prefill_ids) + (len(self.fed_back) if self.resume else 0)
        self.start_at = min(reused, max(0, total - 1))
        if not self.resume:
            self.reused = self.start_at
        self.resume = False
        if self.attempts:
            self.skipped[len(self.attempts) - 1] = self.start_at

    def accept(self, token: int) -> bool:
        """Take the next generated token; True when it is the last one."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        if self.guide is not None:
            try:
                self.guide.take(token)
            except GrammarError:  # the tail masks every token: only a stop token past the grammar's end gets here
                self.guide = None
        return self.done

    def retract(self, keep: int) -> None:
        """Forget the generated tokens from `keep` on (a check found the first of them wrong, or they were never
        checked): the next route computes from there. The grammar's local state is dropped: only drafts use it,
        and a checked generation has none (the hop that samples keeps its own)."""
        if keep < len(self.tokens):
            del self.tokens[keep:]
            self.guide = None
            self.streamed = min(self.streamed, keep)
            if self.drafts is not None:
                self.drafts.cut()

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar forces next (jump-forward drafts; [] without a grammar)."""
        if self.guide is None or not self.tokens:
            return []
        room = min(most, self.max_tokens - len(self.tokens) - 1)
        if self.switch and self.long_from is None:
            room = min(room, self.switch - len(self.ids) - len(self.tokens))
        return self.guide.forced()[:max(0, room)]

    def plain_steps_left(self) -> int:
        """Decode steps that may still run one after another, each fed the token the one before gave,
        before the generation ends or must open its sessions again: one a token it may still take, and
        on a short RoPE table none fed past the switch (a stop token ends it sooner). After the last of
        them, `done` or `past_switch` holds."""
        left = self.max_tokens - len(self.tokens)
        if self.switch and self.long_from is None:
            left = min(left, self.switch - len(self.ids) - len(self.tokens) + 1)
        return max(0, left)

    def propose(self) -> list[int]:
        """Drafts for the step after the last accepted token ([] for plain decoding)."""
        if self.drafts is None or not self.tokens:
            return []
        room = self.max_tokens - len(self.tokens) - 1
        if self.switch and self.long_from is None:  # a short session's step ends at the switch: drafts past it
            room = min(room, self.switch - len(self.ids) - len(self.tokens))  # would need the long table
        return self.drafts.propose(self.ids + self.tokens, room)

    def verified(self, drafted: int, accepted: int, forced: bool = False) -> None:
        """The tail accepted `accepted` of a step's `drafted` drafts (`forced`: the grammar's, which do not
        tell the draft source how it does)."""
        self.drafted += drafted
        self.accepted_drafts += accepted
        if self.drafts is not None and not forced:
            self.drafts.after(drafted, accepted)

    def stats(self, end: float | None = None) -> dict:
        """What the client is told when the generation is done."""
        end = time.perf_counter() if end is None else end
        n = len(self.tokens)
        first = self.first_token_at or end
        return {"ttft_s": round(first - self.started_at, 4), "tokens": n, "prompt_tokens": len(self.ids),
                "finish": "stop" if self.tokens and self.tokens[-1] in self.stop else "length",
                "cached_tokens": self.reused, "handovers": self.handovers,
                **({"handover_fallbacks": self.handover_fallbacks} if self.handover_fallbacks else {}),
                "decode_tok_per_s": round((n - 1) / (end - first), 2) if n > 1 and end > first else None,
                "drafted": self.drafted, "accepted": self.accepted_drafts,
                **(self.check.stats() if self.check is not None else {"checked": False, "verified": False}),
                **({"rope_table": "long" if self.long_from is not None else "short", "rope_switched_at": self.long_from}
                   if self.switch else {})}


def open_session(request_id: int, session_id: bytes, epoch: int, start: int, end: int, model_fp: str,
                 recipe_fp: str, max_length: int, sampling: SamplingParams, next_peer: str = "",
                 next_addrs: str = "", microbatch: int = 0, rope_table: int = rope.SHORT,
                 prefix_chain: bytes = b"", grammar: str = "", grammar_from: int = 0) -> OpenSession:
    """The frame that opens a generation's session on the layers [start, end) of one shard."""
    return OpenSession(request_id=request_id, session_id=session_id, epoch=epoch, start=start, end=end,
                       model_fingerprint=model_fp, recipe_fingerprint=recipe_fp, max_length=max_length,
                       temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                       seed=sampling.seed, next_peer=next_peer, next_addrs=next_addrs, microbatch=microbatch,
                       rope_table=rope_table, prefix=prefix_chain, grammar=grammar, grammar_from=grammar_from)
