"""A generation's course at its entry as one table: the stages it passes through, the events that move
it between them, and the one place that says which moves are allowed.

Rule (as `meshd/node/lifecycle.py` keeps it for the daemon): a generation is in one stage at a time and
moves only by `Course.to(event)`, which refuses a move the table does not list. A try on a route says how
it ended by returning its event (done, past the RoPE table's switch, a hop that left, routes that
disagreed), never by raising it; what fails beneath it (a hop, a refusal) arrives as an exception
(`meshd/entry/errors.py`) that the entry's driver (`meshd/entry/generation.py`) turns into its event in one
place. The plain, speculative, checked and local paths all end their decoding by `Generation.take`
(`meshd/entry/state.py`). The three ends are the outcomes of the ending rule (`errors.ending`), which the
ledger, the metrics and the dashboard use alike.
"""

from __future__ import annotations

from enum import Enum


class Stage(str, Enum):
    TRYING = "trying"  # a route planned, opened and driven: the prompt, then decode steps (two routes when checked)
    SETTLING = "settling"  # a checked generation's routes disagreed: a third route says which one is wrong
    WAITING = "waiting"  # no route had room, or the view lacks a record: a pause, then a new try
    COMPLETED = "completed"  # every token it may take was taken (or the client's stop sequence cut it)
    CANCELLED = "cancelled"  # the client went away, or the daemon stopped it
    FAILED = "failed"  # the error the client gets: no route, the mesh busy past its wait, hops failing

    def __str__(self) -> str:
        return self.value


class Event(str, Enum):
    DONE = "done"  # the last token was taken
    SWITCHED = "switched"  # the sequence grew past a longrope model's short RoPE table: the next try opens on the long
    MOVED = "moved"  # a hop left on purpose: the next try goes over its replica (its KV handed over), else replays
    HOP_FAILED = "hop failed"  # a hop failed or was full: the next try plans around it
    DISAGREED = "disagreed"  # a checked generation's two routes gave different tokens
    SETTLED = "settled"  # a third route said which route was wrong; that route's suspects are excluded
    REFUSED = "refused"  # no route, or no room: the mesh is waited for
    WAITED = "waited"
    GAVE_UP = "gave up"  # the retry policy ends it with the error the client gets
    STOPPED = "stopped"  # the client went away, or the daemon stopped it

    def __str__(self) -> str:
        return self.value


RUNNING = (Stage.TRYING, Stage.SETTLING, Stage.WAITING)
MOVES: dict[tuple[Stage, Event], Stage] = {
    (Stage.TRYING, Event.DONE): Stage.COMPLETED,
    (Stage.TRYING, Event.SWITCHED): Stage.TRYING,
    (Stage.TRYING, Event.MOVED): Stage.TRYING,
    (Stage.TRYING, Event.HOP_FAILED): Stage.TRYING,
    (Stage.TRYING, Event.DISAGREED): Stage.SETTLING,
    (Stage.TRYING, Event.REFUSED): Stage.WAITING,
    (Stage.SETTLING, Event.SETTLED): Stage.TRYING,
    # a hop of the third route failed, or it found no room: the disagreement is dropped, and the generation goes
    # on checked on new routes (which disagree again if a liar is still on them)
    (Stage.SETTLING, Event.HOP_FAILED): Stage.TRYING,
    (Stage.SETTLING, Event.REFUSED): Stage.WAITING,
    (Stage.WAITING, Event.WAITED): Stage.TRYING,
    **{(stage, Event.GAVE_UP): Stage.FAILED for stage in RUNNING},
    **{(stage, Event.STOPPED): Stage.CANCELLED for stage in RUNNING},
}
ENDED_BY = {"completed": Event.DONE, "cancelled": Event.STOPPED, "failed": Event.GAVE_UP}  # an outcome's event


class BadMove(RuntimeError):
    """A move of a generation the table does not allow (a bug in the caller)."""


class Course:
    """Where a generation stands; starts TRYING."""

    def __init__(self) -> None:
        self.stage = Stage.TRYING

    def to(self, event: Event) -> Stage:
        """Move by `event`; the stage it leads to, or BadMove when the table does not list it."""
        stage = MOVES.get((self.stage, event))
        if stage is None:
            raise BadMove(f"a generation {self.stage} cannot take the event {event}")
        self.stage = stage
        return stage

    def end(self, outcome: str) -> bool:
        """The generation ended with `outcome` (`errors.ending`): move to that end unless it is there already."""
        if self.ended:
            return False
        self.to(ENDED_BY[outcome])
        return True

    @property
    def ended(self) -> bool:
        return self.stage not in RUNNING

    def __str__(self) -> str:
        return str(self.stage)
