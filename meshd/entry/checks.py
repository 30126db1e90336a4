"""Checked generations as pure decisions: which generations are checked and how (`Checking`), which
layers two routes compute on different daemons, the windows a check by prefill cuts and the first row
where it disagrees (`next_window`, `first_wrong`), who is to blame when routes disagree, and how long a
peer that disagreed with two others stays off this daemon's routes.

Rules: a checked generation runs on two routes (in lockstep, or the second recomputing each window of the
first's tokens in one pass) and a token counts only when both give it; replicas of one recipe on one kind of CPU compute bit for bit alike (the sampler draws from
(seed, position)), so any difference is a fault, not rounding. Layers both routes run on the same
daemon are unchecked, and the generation says so. When two routes disagree, a third route whose
hops differ where the two differed settles it, by its hops' sketch of the range where the two
routes' sketches part (`judge`), else by its token (`settle`): the hops of the route that lost that
are on neither other route are the suspects. No I/O and no clock of its own: callers pass `now`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from meshd.hop import sketch

EXCLUDE_S = 300.0  # a peer's first exclusion; each repeat doubles it
EXCLUDE_MAX_S = 7 * 86400.0  # the longest one exclusion lasts
FORGET_S = 86400.0  # a peer with no new exclusion for this long after its last one ends starts over


BY = ("prefill", "lockstep")  # how a checked generation is checked (meshd/entry/windows.py, meshd/entry/lockstep.py)
RELEASES = ("checked", "at-once")  # when its text goes out: once checked, or at once with how far it is checked


@dataclass(frozen=True)
class Checking:
    """How an entry checks the generations it checks: `by` prefill (a second route recomputes each finished
    window of `window` tokens in one pass) or lockstep (both routes decode every step); a prefill check's text
    goes out once its window is checked (`release` "checked") or at once, with how far it is checked and a
    retraction where a check fails ("at-once"). Refuses what it cannot run by the flag's name."""

    by: str = "prefill"
    window: int = 16
    release: str = "checked"

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise ValueError(f"--verify-by must be one of {', '.join(BY)}, not {self.by!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 1 <= self.window <= 256:
            raise ValueError(f"--verify-window must be a whole number of tokens from 1 to 256, not {self.window!r}")
        if self.release not in RELEASES:
            raise ValueError(f"--verify-release must be one of {', '.join(RELEASES)}, not {self.release!r}")


def next_window(checked: int, made: int, size: int, finished: bool) -> tuple[int, int] | None:
    """The tokens a check recomputes next, [from, to) of those generated: `size` of them once that many past
    `checked` are made, the rest once the generation's try has finished; None: wait for more."""
    if made - checked >= size:
        return checked, checked + size
    if finished and made > checked:
        return checked, made
    return None


def first_wrong(tokens: list[int], sketches: list[dict], their_tokens: list[int | None], their_sketches: list[dict],
                tol: float = sketch.TOLERANCE) -> tuple[int, tuple[int, int] | None] | None:
    """The first row of a window where a check disagrees with the route that generated it, and the layers
    [from, to) where the two routes' sketches of that row part (None: they agree, and only the tokens
    differ); None when every row agrees. Row i: the first route's token and its hops' sketches of the step
    that gave it, against the check's token there (None: not known, the check's tail stopped comparing
    before it) and its hops' sketches of that row."""
    for i, token in enumerate(tokens):
        where = sketch.first_divergence(sketches[i], their_sketches[i], tol) if i < len(their_sketches) else None
        if where is not None:
            return i, where
        if i < len(their_tokens) and their_tokens[i] is not None and their_tokens[i] != token:
            return i, None
    return None


def chosen(rate: float, requested: bool, draw: float | None = None) -> bool:
    """Whether a generation is checked: asked for by the request, or drawn at `rate` (0: never)."""
    if requested:
        return True
    if rate <= 0:
        return False
    return (random.random() if draw is None else draw) < rate


def check_rate(rate) -> float:
    """A --verify-rate, or the ValueError that refuses it."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"--verify-rate must be a number from 0 to 1 (0: never check), not {rate!r}")
    return float(rate)


def layer_peers(hops: list[list]) -> dict[int, str]:
    """layer -> the peer that computes it, for a route given as [[peer, start, end], ...]."""
    return {layer: peer for peer, start, end in hops for layer in range(start, end)}


def spans(layers: list[int]) -> list[list[int]]:
    """Sorted layers as runs [start, end)."""
    out: list[list[int]] = []
    for layer in sorted(layers):
        if out and out[-1][1] == layer:
            out[-1][1] += 1
        else:
            out.append([layer, layer + 1])
    return out


def unchecked_layers(first: list[list], second: list[list], start: int = 0) -> list[list[int]]:
    """Layers at or after `start` that both routes compute on the same daemon, as runs [start, end)."""
    a, b = layer_peers(first), layer_peers(second)
    return spans([layer for layer, peer in a.items() if layer >= start and b.get(layer) == peer])


def differing_peers(first: list[list], second: list[list]) -> set[str]:
    """Peers that compute some layer on one route that the other route computes elsewhere."""
    a, b = layer_peers(first), layer_peers(second)
    return {peer for x, y in ((a, b), (b, a)) for layer, peer in x.items() if y.get(layer) != peer}


@dataclass(frozen=True)
class Verdict:
    """What a third route said about two that disagreed: the index (0 or 1) of the route it agreed
    with, or None when it agreed with neither; and the peers of the losing route to exclude."""

    winner: int | None
    suspects: frozenset[str]


def settle(routes: tuple[list[list], list[list]], tokens: tuple[int, int], third: list[list],
           third_token: int) -> Verdict:
    """Decide between two routes that gave different tokens at one position, by a third route's
    token there. The suspects are the losing route's peers on layers where the other two routes
    agree on a daemon other than it (so an honest hop the routes share is never blamed)."""
    if third_token not in tokens:
        return Verdict(None, frozenset())
    winner = tokens.index(third_token)
    loser = layer_peers(routes[1 - winner])
    good, other = layer_peers(routes[winner]), layer_peers(third)
    suspects = {peer for layer, peer in loser.items() if good.get(layer) != peer and other.get(layer) != peer}
    return Verdict(winner, frozenset(suspects))


def judge(routes: tuple[list[list], list[list]], where: tuple[int, int], sketches: tuple[dict, dict],
          third: list[list], third_sketches: dict, tol: float = sketch.TOLERANCE) -> Verdict | None:
    """Decide between two routes whose sketches first part at layers [from, to) (`where`) by a third
    route's sketch of layer `to`'s output: the route it matches wins, and the suspects are the losing
    route's peers on those layers that neither other route ran there. None when the third route has
    no sketch there or matches both or neither (the caller then goes by tokens)."""
    start, end = where
    at_end = [{e: s for (_, e), s in sk.items()}.get(end) for sk in (*sketches, third_sketches)]
    if any(s is None for s in at_end):
        return None
    agree = [sketch.close(at_end[i], at_end[2], tol) for i in (0, 1)]
    if agree.count(True) != 1:
        return None
    winner = agree.index(True)
    loser, good, other = layer_peers(routes[1 - winner]), layer_peers(routes[winner]), layer_peers(third)
    suspects = {peer for layer, peer in loser.items()
                if start <= layer < end and good.get(layer) != peer and other.get(layer) != peer}
    return Verdict(winner, frozenset(suspects)) if suspects else None


def swapped(route: list[list], hop: list) -> list[list] | None:
    """`route` with `hop` ([peer, start, end]) in place of its hops that cover exactly those layers
    (to try one suspect among honest hops); None when no hops of `route` start and end there."""
    _, start, end = hop
    i = next((k for k, h in enumerate(route) if h[1] == start), None)
    j = next((k for k, h in enumerate(route) if h[2] == end), None)
    if i is None or j is None or j < i:
        return None
    return route[:i] + [list(hop)] + route[j + 1:]


@dataclass
class Excluded:
    peer: str
    reason: str
    until: float
    times: int  # exclusions so far, this one included


@dataclass
class Exclusions:
    """Peers kept off this daemon's routes after they disagreed with two others: for EXCLUDE_S the
    first time, doubling with each repeat (up to EXCLUDE_MAX_S); a peer clean for FORGET_S after its
    last exclusion ended starts over."""

    base_s: float = EXCLUDE_S
    max_s: float = EXCLUDE_MAX_S
    forget_s: float = FORGET_S
    entries: dict[str, Excluded] = field(default_factory=dict)
    total: int = 0  # exclusions made, all peers (metrics)

    def exclude(self, peer: str, reason: str, now: float) -> Excluded:
        old = self.entries.get(peer)
        times = 1 if old is None or now >= old.until + self.forget_s else old.times + 1
        span = min(self.max_s, self.base_s * 2 ** (times - 1))
        entry = Excluded(peer, reason, max(now + span, old.until if old and times > 1 else 0.0), times)
        self.entries[peer] = entry
        self.total += 1
        return entry

    def active(self, now: float) -> set[str]:
        """The peers routes must avoid now."""
        return {p for p, e in self.entries.items() if now < e.until}

    def listing(self, now: float) -> list[dict]:
        """The peers excluded now, for status and metrics: why, how many times, seconds left."""
        return [{"peer": e.peer, "reason": e.reason, "times": e.times, "left_s": round(e.until - now, 1)}
                for e in sorted(self.entries.values(), key=lambda e: e.peer) if now < e.until]

    def prune(self, now: float) -> None:
        """Forget peers whose last exclusion ended more than `forget_s` ago."""
        for peer in [p for p, e in self.entries.items() if now >= e.until + self.forget_s]:
            del self.entries[peer]


@dataclass
class Check:
    """A checked generation's account: its second route (empty: none ran, nothing differed from
    the first), the layers both routes ran on one daemon, the tokens compared and the disagreements."""

    second: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)
    compared: int = 0  # tokens both routes gave alike
    disagreements: int = 0
    excluded: list[str] = field(default_factory=list)  # peers this generation excluded
    diverged: list = field(default_factory=list)  # per disagreement: the layers [from, to) the sketches located
    by: str = "lockstep"  # how it is checked: lockstep, or prefill (windows of tokens recomputed in one pass)
    seed: int = field(default_factory=lambda: random.getrandbits(62) + 1)  # its sketches' (every route's alike)
    verified: int = 0  # generated tokens checked so far (by prefill: a prefix of them)
    windows: list = field(default_factory=list)  # per window checked: its tokens, the check's route, the verdict
    retracted: int = 0  # tokens whose text went out and was taken back (a check failed, or a route changed)

    @property
    def ran(self) -> bool:
        return bool(self.second)

    @property
    def agreed(self) -> bool | None:
        """For the ledger: the routes never disagreed (None: no second route ran)."""
        return self.disagreements == 0 if self.ran else None

    def stats(self) -> dict:
        """`verified`: every token came from two routes that agree, each layer on two daemons."""
        return {"checked": self.ran, "verified": self.ran and not self.unchecked and self.compared > 0,
                "unchecked_layers": self.unchecked, "compared": self.compared,
                "disagreements": self.disagreements, "excluded": self.excluded, "diverged_layers": self.diverged,
                "checked_by": self.by, "verified_through": self.verified, "windows": len(self.windows),
                "retracted": self.retracted}

    def window(self, start: int, end: int, route: list, verdict: str, layers: tuple[int, int] | None = None) -> None:
        """A window of tokens checked on `route` ([[peer, start, end], ...]), by its verdict: "agreed" (tokens
        [start, end) all agree), or "disagreed" (those agree, token `end` does not: where the sketches part,
        `layers`, if they do)."""
        self.windows.append({"start": start, "end": end, "route": route, "verdict": verdict,
                             "layers": list(layers) if layers else None})
