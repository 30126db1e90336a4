"""The entry's decisions as pure code: what to do after a hop fails or is full, and which other entry
takes a request this daemon cannot run. No I/O, no clock of their own: tests feed made-up inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.core.settings import default
from meshd.entry.errors import BUSY_RETRY_S, GenerationError, HopFailed
from meshd.wire import ErrorCode

MAX_ATTEMPTS = 3  # routes tried after hop failures (busy hops do not count)
MAX_UNREACHED = 8  # hops that could not even be reached to open a session (a peer that just died, its record
# not yet lapsed): they do not count as attempts, each is left out of later routes, and so many end the generation
BUSY_WAIT_S = default("busy_wait")  # how long a generation waits for a full mesh before "mesh busy"
LOAD_WEIGHT_S = 0.1  # an entry whose KV is all in use ranks as if 100 ms further away
UNMEASURED_S = 0.05  # the latency assumed for an entry never measured
LAPSE_POLL_S = 1.0  # how often a generation waiting on a lapsed record looks at the mesh again


SUSPECT_S = 10.0  # how long later generations avoid a hop that failed one (a frozen or dying peer whose record
# still stands): a SIGSTOPped hop is given up within the silence threshold once, not by every generation after


class Suspects:
    """Hops that failed a generation lately: later routes go through one only where no other serves its layers,
    for SUSPECT_S seconds or until it opens a session again. Times are the caller's clock (time.monotonic)."""

    def __init__(self, hold_s: float = SUSPECT_S) -> None:
        self.hold_s = hold_s
        self.until: dict[str, float] = {}

    def failed(self, peer: str, now: float) -> None:
        self.until[peer] = now + self.hold_s

    def answered(self, peer: str) -> None:
        self.until.pop(peer, None)

    def active(self, now: float) -> set[str]:
        for peer in [p for p, t in self.until.items() if t <= now]:
            del self.until[peer]
        return set(self.until)


@dataclass
class Retries:
    """One generation's account of its routes: the hops that failed (never tried again), those that
    said they are full (skipped until the next wait), the epoch of the next attempt, and until when
    a full mesh is waited for. `after_failure` and `after_refusal` either say to go on or raise the
    `GenerationError` the client gets."""

    deadline: float  # (trio) time after which a full mesh is "mesh busy"
    busy_wait_s: float = BUSY_WAIT_S
    max_attempts: int = MAX_ATTEMPTS
    failed: set[str] = field(default_factory=set)
    busy: set[str] = field(default_factory=set)
    failures: int = 0
    unreached: int = 0  # hops that could not be reached to open a session (not counted in `failures`)
    unreachable: set[str] = field(default_factory=set)  # ... their peers: tried again last (`plan_around`)
    epoch: int = 0
    reroutes: int = 0
    refreshed: bool = False
    lapse_wait_s: float = default("record_ttl")  # how long after the first "no route" a lapsed record is waited for
    # (one record TTL)
    lapse_deadline: float | None = None

    def look_again(self, exc: GenerationError, lapsed: set[str], now: float) -> float | None:
        """No route and no hop said busy: the seconds to wait before refreshing the mesh view and
        planning again, or None to give up. While `lapsed` peers (whose serving records of the missing
        layers lapsed lately) may republish, every LAPSE_POLL_S up to `lapse_wait_s` from the first
        wait: a live peer's republish that came late (a loaded box, a slow link) must not fail the
        generation. That holds for a peer this generation saw fail too: when a relay dies, the private
        daemons behind it fail mid-stream and their records lapse here together (their pushes ran
        through it), while they reserve at another relay and republish (seen in CI: both hops behind
        a killed relay failed, their records lapsed, and the generation failed with both alive). A
        dead peer costs the wait. Then one refresh at once, once a generation (a record this view
        never read); a layer nobody serves fails after it."""
        if exc.code != ErrorCode.NO_ROUTE or self.busy:
            return None
        if lapsed:
            if self.lapse_deadline is None:
                self.lapse_deadline = now + self.lapse_wait_s
            if self.lapse_deadline > now:
                return min(LAPSE_POLL_S, self.lapse_deadline - now)
        if self.refreshed:
            return None
        self.refreshed = True
        return 0.0

    def after_failure(self, exc: HopFailed) -> None:
        """A hop failed or is full: the next attempt plans without it (at once)."""
        self.epoch += 1
        if exc.busy_s is not None:  # alive but full: another route now, else wait for room
            self.busy.add(exc.peer_id)
            return
        # a hop that could not be reached before anything ran there is passed over for another replica or
        # route (a route exists while the plan finds one) without spending an attempt; so many such end it
        if exc.opening and exc.peer_id not in self.unreachable and self.unreached < MAX_UNREACHED:
            self.unreached += 1  # also a hop that failed before (a dead one retried for want of another)
            self.unreachable.add(exc.peer_id)
        else:
            self.failures += 1
        if not exc.retriable or self.failures == self.max_attempts:
            raise GenerationError(ErrorCode.HOP_FAILED, str(exc))
        self.failed.add(exc.peer_id)
        self.reroutes += 1

    def left(self, peer: str) -> None:
        """A hop left on purpose (`meshd/entry/opening.py`, `Moved`): later routes go without it, and it is no failure."""
        self.epoch += 1
        self.failed.add(peer)

    def after_refusal(self, exc: GenerationError, now: float) -> float:
        """No route had room (every route left runs through a full hop, or this daemon's own layers
        are full): the seconds to wait before trying again, the busy hops forgiven."""
        if not (exc.code == ErrorCode.BUSY or (exc.code == ErrorCode.NO_ROUTE and self.busy)):
            raise exc
        left = self.deadline - now
        if left <= 0:  # the daemons are alive and full: say so, not that nobody serves the layers
            why = (f"the daemons serving these layers are alive and full ({len(self.busy)} said busy)"
                   if exc.code == ErrorCode.NO_ROUTE else str(exc))
            raise GenerationError(ErrorCode.BUSY, f"mesh busy: no route had room within {self.busy_wait_s:g} s"
                                  f" ({why})")
        self.epoch += 1
        self.busy.clear()
        return min(left, BUSY_RETRY_S)


def choose_entry(records, latency: dict[str, float], own_id: str, exclude=()):
    """The entry a request is handed to: a serving peer holding layer 0, not leaving, not this daemon
    and not one already tried; those with a free session first, then the nearest once its load is
    priced in (`LOAD_WEIGHT_S`). Ties break by peer id, so the choice is deterministic."""
    entries = [r for r in records if r.start == 0 and r.end > 0 and r.serving and not r.leaving
               and r.peer_id != own_id and r.peer_id not in exclude]
    if not entries:
        return None
    return min(entries, key=lambda r: (r.free_sessions <= 0, latency.get(r.peer_id, UNMEASURED_S)
                                       + LOAD_WEIGHT_S * r.load, r.peer_id))
