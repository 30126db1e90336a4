"""Where `--layers auto` daemons should be: the moves that fill gaps and even out redundancy.

Rules: a plan is a pure function of a coverage map (the claims of loading peers included), so every
daemon that sees the same map computes the same plan and applies only its own line of it; that is
the tie-break between daemons that joined at the same moment. Only peers that say they may move
(`auto_layers` > 0) are planned. A move never takes the last server off a layer, and goes only from
layers that would still be served at least once more than any layer of its target, so every move
raises the least-served layers and a plan cannot undo itself (no flapping on a steady map). The
order of movers: claims not yet loaded first (moving them costs nothing), then the peers whose
layers stay best served without them; ties go by peer id, the higher one moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshd.dht.coverage import CoverageMap, choose_range
from meshd.dht.record import CoverageRecord


@dataclass(frozen=True)
class Move:
    peer_id: str
    start: int  # the range it leaves
    end: int
    to: tuple[int, int]  # the range it takes
    reason: str  # for logs and `meshctl status`: "gap [22, 30)" or "balance: ..."

    def describe(self) -> str:
        return f"{self.start}:{self.end} -> {self.to[0]}:{self.to[1]}: {self.reason}"


def target(coverage: CoverageMap, record: CoverageRecord, want: int) -> tuple[tuple[int, int], str] | None:
    """Where `record`'s peer should go in `coverage` (which may or may not include it), and why;
    None when it should stay."""
    others = coverage.without(record.peer_id)
    counts = others.counts()
    left = min(counts[record.start:record.end])  # servers of its least-served layer once it leaves
    if left == 0:
        return None  # it is the last server of some layer
    gaps = others.gaps()
    w0, w1 = choose_range(others, want)
    if left < max(counts[w0:w1]) + 1:
        return None
    filled = [g for g in gaps if g[0] < w1 and w0 < g[1]]
    if filled:
        return (w0, w1), "gap " + ", ".join(f"[{a}, {b})" for a, b in filled)
    return (w0, w1), f"balance: layers {w0}:{w1} had {max(counts[w0:w1])} servers, {record.start}:{record.end} {left + 1}"


def plan_moves(coverage: CoverageMap) -> list[Move]:
    """Moves for the movable peers of `coverage`, each at most once, applied one after another
    to a working copy so that two peers never go to fill the same layers. Peers that are leaving
    (draining) count for nothing."""
    coverage = CoverageMap(coverage.n_layers, tuple(r for r in coverage.records if not r.leaving))
    def left(r: CoverageRecord) -> int:
        return min(coverage.without(r.peer_id).counts()[r.start:r.end])

    movers = sorted((r for r in coverage.records if r.auto_layers > 0), key=lambda r: r.peer_id, reverse=True)
    movers.sort(key=lambda r: (r.serving, -left(r)))  # stable: ties keep the higher peer id first
    working, moves = coverage, []
    for r in movers:
        found = target(working, r, r.auto_layers)
        if found is None:
            continue
        (a, b), reason = found
        moves.append(Move(r.peer_id, r.start, r.end, (a, b), reason))
        working = CoverageMap(working.n_layers, tuple(replace(x, start=a, end=b) if x.peer_id == r.peer_id else x
                                                      for x in working.records))
    return moves


def takes_part(takes_new_work: bool, now: float, cooldown_until: float) -> bool:
    """Whether a serving daemon is planned in this round: it takes new work and the cooldown of its
    last move is over (meanwhile its record says it stays put)."""
    return takes_new_work and now >= cooldown_until


def still_named(move: Move | None, aim: tuple[int, int]) -> bool:
    """After the random wait: the fresh plan still names this daemon, for the same target."""
    return move is not None and move.to == aim


def own_move(coverage: CoverageMap, peer_id: str) -> Move | None:
    """This peer's line of the plan, if it has one."""
    return next((m for m in plan_moves(coverage) if m.peer_id == peer_id), None)


@dataclass
class Persistence:
    """The hysteresis of a serving daemon's moves: a move is made only once the plan has named this
    daemon with the same target in `rounds` rounds in a row, over at least `min_s` seconds (a
    record TTL: a starved peer can miss a refresh and look dead for a moment). Fed one plan a
    round (`observe`), with the time; no clock of its own."""

    rounds: int
    min_s: float
    streak: int = 0
    aim: tuple[int, int] | None = None
    since: float = 0.0

    def observe(self, move: Move | None, now: float) -> Move | None:
        """This round's line of the plan; the move to make now, or None."""
        if move is None:
            self.reset()
            return None
        if move.to != self.aim:
            self.streak, self.aim, self.since = 0, move.to, now
        self.streak += 1
        if self.streak < self.rounds or now - self.since < self.min_s:
            return None
        self.streak = 0
        return move

    def reset(self) -> None:
        self.streak, self.aim = 0, None
