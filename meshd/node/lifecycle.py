"""A daemon's lifecycle as one table: its states, the moves between them, and what each state allows.

Rule (as h11's `_state.py` keeps it): this module is the only place that names a state or says
whether a daemon serves, drains or leaves. Everything else asks (`accepts_generations`,
`takes_new_work`, `is_leaving`) and moves it with `to(...)`, which refuses a move the table does
not list, so a daemon can never, say, go back from draining to serving.
"""

from __future__ import annotations

from enum import Enum

import trio

from meshd.core.log import get_logger

log = get_logger(__name__)


class State(str, Enum):
    STARTING = "starting"  # identity, host, the control socket
    CHOOSING = "choosing layers"  # --layers auto: watching the mesh before claiming a range
    LOADING = "loading"  # weights going into memory; the record says not serving yet
    SERVING = "serving"
    MOVING = "moving layers"  # --layers auto: serving a new range while the old one's sessions leave it
    DRAINING = "draining"  # leaving gently: no new work, open sessions and generations finish
    STOPPING = "stopping"  # the record is withdrawn, the nursery is cancelled

    def __str__(self) -> str:
        return self.value


MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.CHOOSING, State.LOADING, State.SERVING, State.STOPPING}),
    State.CHOOSING: frozenset({State.LOADING, State.SERVING, State.STOPPING}),
    State.LOADING: frozenset({State.SERVING, State.STOPPING}),
    State.SERVING: frozenset({State.MOVING, State.DRAINING, State.STOPPING}),
    State.MOVING: frozenset({State.SERVING, State.DRAINING, State.STOPPING}),
    State.DRAINING: frozenset({State.STOPPING}),
    State.STOPPING: frozenset(),
}


class BadMove(RuntimeError):
    """A lifecycle move the table does not allow (a bug in the caller)."""


class Lifecycle:
    """Where a daemon stands; starts at STARTING."""

    def __init__(self) -> None:
        self.state = State.STARTING
        self.reason = ""  # why the daemon drains or stops (for `meshctl status`)

    def to(self, state: State, reason: str = "") -> bool:
        """Move to `state`; False (and no change) when already there, BadMove when not allowed."""
        if state == self.state:
            return False
        if state not in MOVES[self.state]:
            raise BadMove(f"a daemon that is {self.state} cannot become {state}")
        self.state = state
        if reason:
            self.reason = reason
        return True

    @property
    def accepts_generations(self) -> bool:
        """Generation requests are taken (a draining daemon still forwards them to another entry)."""
        return self.state in (State.SERVING, State.MOVING, State.DRAINING)

    @property
    def takes_new_work(self) -> bool:
        """New sessions, new generations run here: while serving (a moving daemon serves its new range)."""
        return self.state in (State.SERVING, State.MOVING)

    @property
    def may_move(self) -> bool:
        """A move of layers may begin: only while plainly serving."""
        return self.state == State.SERVING

    @property
    def is_leaving(self) -> bool:
        """Its layers are as good as gone: plans and routes go without it."""
        return self.state in (State.DRAINING, State.STOPPING)

    @property
    def stops_at_once(self) -> bool:
        """A stop asked for now ends the process without a drain (there is nothing to drain yet)."""
        return self.state == State.STARTING

    @property
    def range_known(self) -> bool:
        """The record's layer range is this daemon's choice (not the placeholder of a daemon choosing)."""
        return self.state not in (State.STARTING, State.CHOOSING)

    def __str__(self) -> str:
        return str(self.state)


class StopRequest:
    """A stop asked for from any thread (a signal, `meshctl drain --exit`): the first one makes the
    daemon drain and leave, a second one while it drains cuts the drain short."""

    def __init__(self) -> None:
        self.event: trio.Event | None = None  # set once asked (None until the event loop runs)
        self.drain_scope = trio.CancelScope()  # a drain runs inside it; a second request cancels it
        self._token = None

    def arm(self) -> None:
        """Called on the event loop once it runs; a request before that cannot be taken."""
        self.event, self._token = trio.Event(), trio.lowlevel.current_trio_token()

    @property
    def armed(self) -> bool:
        return self.event is not None

    def request(self, reason: str) -> None:
        """Thread-safe: ask for the stop (asked again while it drains: stop at once)."""
        def stop() -> None:
            log.info("stop requested", reason=reason)
            if self.event.is_set():
                self.drain_scope.cancel()
            self.event.set()

        try:
            self._token.run_sync_soon(stop)
        except (AttributeError, trio.RunFinishedError):
            pass
