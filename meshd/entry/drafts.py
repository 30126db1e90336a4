"""Draft tokens at the entry: what a step proposes after the last accepted token, and how many.

Why: over real links a token costs the round trips through every hop, not the compute; a step that
carries k drafts verified in one pass down the route returns up to k + 1 tokens for one trip.

`PromptLookup` drafts without a model: the longest recent n-gram of the context (prompt and text so
far) that occurred earlier is continued as it went on then (text that quotes or edits its prompt
repeats long runs). `DraftLength` keeps k near what the generation's drafts have earned (the rule of
a sampled generation, whose text must not depend on timings): it grows while drafts are accepted,
shrinks as they fail, and falls to plain decoding (k = 0), trying one draft again after a pause
that doubles each time it fails, so a workload whose drafts keep failing costs about what plain
decoding costs. Both are pure: tokens in, tokens out.

`worth_drafting` says when a step carries drafts at all: a verification pass costs several rows of
compute, which pays only where a trip's round trips cost more than that compute. Within a greedy
generation `StepCosts` weighs the two as measured and picks k for the most tokens a second: a step
of k drafts costs a trip and k rows and returns 1 + a + a^2 + ... + a^k tokens expected, a being
the generation's measured chance that a draft stands once the drafts before it stood
(`DraftLength.stands`). Over slow links a row costs a percent or two of a trip, so about as many
drafts as the lookup offers go, up to `--draft-max`, while they stand; on loopback a few, and only
while most stand. Where none pay, plain steps for a pause, then one draft to measure again.
(Offline, `bench/draft_sim.py`: over the greedy texts of spec_bench.py's two quoting prompts,
with a 170 ms trip and a 2.5 ms row, 4.4 and 3.0 tokens a trip, where the acceptance rule alone
returned 3.3 and 2.5 with at most 8 drafts, and fewer with at most 16: its halving and pauses
after a miss cost the trips in which the text came back to the copy.)
"""

from __future__ import annotations

from meshd.core.settings import default

NGRAM_MAX = 3  # the longest suffix looked up
NGRAM_MIN = 2  # single tokens repeat too often by chance to be worth a draft
DRAFT_MAX = default("draft_max")  # drafts a step carries at most (--draft-max): a step's rows past the first
# come out of a hop's pass budget (meshd/hop/scheduler.py TOKEN_BUDGET, 256), and only a generation whose drafts
# stand and whose trips cost many rows sends so many
FIRST_K = 4
PAUSE_MIN, PAUSE_MAX = 4, 64  # plain steps before one draft is tried again at k = 0
WEIGHT = 0.25  # of the latest step in the running means of step times
KEEP = 0.9  # of the counts behind a draft's chance to stand, kept a step (the rest is the latest step's)


def worth_drafting(remote_hops: int, generations: int) -> bool:
    """Whether a step of a route with `remote_hops` other daemons on it, at an entry running
    `generations` generations (this one included), should carry drafts.

    A route that stays inside this daemon has no round trips to save: every draft is compute (one
    daemon holding 0:30, one session: 81.1 tok/s plain, 50.2 with drafts; p95 between tokens 21.8 ms
    against 80.7; `bench/batch_bench.py --speculate auto,off`, CPU: avx2). Where several generations
    share the passes, the passes are full already, and a draft's rows take the place of another
    session's token. Asked for greedy generations only: their text is the same with drafts or
    without, while a sampled generation's text depends on which steps drafted (and a seed must give
    the same text whatever the load)."""
    return remote_hops > 0 and generations <= 1


class PromptLookup:
    """Drafts from earlier occurrences in the context. The context only grows (accepted tokens are
    never taken back), so the n-grams seen so far are indexed once, each by its latest occurrence."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes {ngram_min}..{ngram_max}: 1 <= min <= max expected")
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.seen = 0  # continuations indexed: those starting before this position

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's longest
        indexed suffix, and where that runs out (the occurrence was near the end: a repeating run),
        what followed the suffix of the context and the tokens proposed so far ([] when nothing
        occurred, or k is 0)."""
        for end in range(max(self.seen, 1), len(context)):  # n-grams ending before `end`, followed by it
            for n in self.sizes:
                if end >= n:
                    self.index[tuple(context[end - n:end])] = end
        self.seen = max(self.seen, len(context))
        out: list[int] = []
        while len(out) < k:
            more = self._after(context, out, k - len(out))
            if not more:
                break
            out += more
        return out

    def _after(self, context: list[int], proposed: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest indexed suffix of context + proposed."""
        tail = (context[-self.sizes[0]:] if len(context) >= self.sizes[0] else context) + proposed
        for n in self.sizes:
            start = self.index.get(tuple(tail[-n:])) if len(tail) >= n else None
            if start is not None:
                return list(context[start:start + k])
        return []


class DraftLength:
    """How many drafts the next step asks for, from how the generation's drafts fared."""

    def __init__(self, most: int = DRAFT_MAX, first: int = FIRST_K) -> None:
        if most < 0:
            raise ValueError(f"at most {most} drafts: 0 or more expected")
        self.most = most
        self.k = min(first, most)
        self.pause = 0  # plain steps left before a draft is tried again
        self.next_pause = PAUSE_MIN
        self.stood, self.fell = 1.0, 1.0  # decayed counts: drafts accepted; steps where a draft was rejected

    def stands(self) -> float:
        """The chance that a draft is accepted once the drafts before it in its step were (drafts
        stand in runs: a copy goes on until the text leaves it), as measured so far."""
        return self.stood / (self.stood + self.fell)

    def wanted(self) -> int:
        """Drafts for the next step (call once a step)."""
        if self.most == 0:
            return 0
        if self.k > 0:
            return self.k
        if self.pause > 0:
            self.pause -= 1
            return 0
        return 1  # a probe

    def after(self, drafted: int, accepted: int) -> None:
        """A step carried `drafted` drafts and the tail accepted `accepted` of them."""
        if drafted <= 0:
            return
        self.stood = KEEP * self.stood + accepted
        self.fell = KEEP * self.fell + (accepted < drafted)
        if accepted >= drafted:
            self.k = min(self.most, max(self.k, drafted) + 2)
            self.next_pause = PAUSE_MIN
        elif accepted > 0:
            self.k = min(self.most, accepted + 1)
        else:
            self.k //= 2
            if self.k == 0:
                self._pause()

    def paying(self, k: int) -> int:
        """Drafts for the next step where measured costs chose `k` (call once a step): k, or where
        none pay at the chance measured, plain steps for a pause and then one draft, which keeps
        that chance measured (the pause doubles each time drafts still do not pay)."""
        if self.most == 0:
            return 0
        if k > 0:
            self.k, self.next_pause = min(k, self.most), PAUSE_MIN
            return self.k
        if self.k > 0:  # drafts stopped paying: a pause first
            self.k = 0
            self._pause()
        if self.pause > 0:
            self.pause -= 1
            return 0
        self._pause()
        return 1

    def _pause(self) -> None:
        self.pause = self.next_pause
        self.next_pause = min(PAUSE_MAX, 2 * self.next_pause)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class StepCosts:
    """What a step costs this entry, measured: a trip (a plain step: one row down the route and its
    token back) and each draft more (its proposal, and its row through every hop and the LM head).
    An accepted draft saves a trip, every draft costs a row: `best_k` weighs the two. For greedy
    generations only: a choice made on timings would change the text a seed gives a sampled one."""

    def __init__(self) -> None:
        self.trip: float | None = None  # seconds, running mean of plain steps
        self.row: float | None = None  # seconds a draft adds to a step, running mean

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` positions (1 + its drafts) took `seconds`, proposal included."""
        if rows <= 1:
            self.trip = _mean(self.trip, seconds)
        elif self.trip is not None:
            self.row = _mean(self.row, max(0.0, seconds - self.trip) / (rows - 1))

    def best_k(self, stands: float, most: int) -> int:
        """The number of drafts, 0 to `most`, whose step returns the most tokens a second when each
        draft stands with chance `stands` once those before it did: k drafts cost a trip and k rows
        and return 1 + stands + ... + stands^k tokens, expected (a trip and a row timed first)."""
        trip = max(self.trip, 1e-9)
        best, best_rate = 0, 1.0 / trip
        tokens, p = 1.0, 1.0
        for k in range(1, most + 1):
            p *= stands
            tokens += p
            rate = tokens / (trip + k * self.row)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class Drafts:
    """A generation's drafting: where drafts come from and how many, kept across reroutes (the drafts
    after a reroute are those the lost route would have been sent, so seeded text continues as it
    would). The source is prompt lookup, or a draft model's session (`meshd/entry/draftmodel.py`):
    anything with `propose(context, k)`; one that `computes` runs a model, so its proposals (and its
    `close`) go to the daemon's compute thread."""

    def __init__(self, most: int = DRAFT_MAX, source=None, costs: StepCosts | None = None) -> None:
        self.source = PromptLookup() if source is None else source
        self.computes = source is not None
        self.length = DraftLength(most)
        self.costs = costs  # weighs drafts against trips (greedy generations); None: by acceptance alone
        self.stopped = False  # a draft model whose context was cut back proposes no more

    def cut(self) -> None:
        """The generation's tokens were cut back (a check took some back): prompt lookup indexes the context
        anew; a draft model, whose session holds the tokens cut, proposes no more for this generation."""
        if self.computes:
            self.stopped = True
        else:
            self.source = PromptLookup()

    def propose(self, context: list[int], room: int) -> list[int]:
        """Drafts after the context, at most `room` (what the generation may still produce, less
        the token the step itself gives). With costs, the first step goes plain, timing a trip."""
        if self.stopped:
            return []
        if self.costs is None:
            k = self.length.wanted()
        elif self.costs.trip is None:
            k = 0
        elif self.costs.row is None:  # no draft step timed yet: as the acceptance says
            k = self.length.wanted()
        else:
            k = self.length.paying(self.costs.best_k(self.length.stands(), self.length.most))
        return self.source.propose(context, min(k, max(0, room)))

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` positions took `seconds` (see `StepCosts`); a draft model catching up on
        the prompt or on plain steps' tokens is a one-off, not what a draft costs."""
        if self.costs is not None:
            catch_up = getattr(self.source, "catch_up_s", 0.0)  # of the proposal just made
            self.costs.observe(rows, max(0.0, seconds - catch_up))

    def after(self, drafted: int, accepted: int) -> None:
        self.length.after(drafted, accepted)

    def close(self) -> None:
        """Let go of what the source holds (a draft model's KV)."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
