"""How a generation fails: a hop that failed or is full (`HopFailed`), or the generation itself
(`GenerationError`, with the wire's error code the client gets); and how a try at it ends on purpose
to start again (`SwitchTable`, `Moved`)."""

from __future__ import annotations

import trio

from meshd.wire import Error, ErrorCode

BUSY_RETRY_S = 0.5  # the wait before trying a full mesh again, when a busy hop gives no hint


class HopFailed(RuntimeError):
    def __init__(self, peer_id: str, reason: str, retriable: bool = True, busy_s: float | None = None,
                 opening: bool = False):
        self.peer_id, self.retriable = peer_id, retriable
        self.busy_s = busy_s  # set when the hop is alive but full: try again after this long
        self.opening = opening  # it could not be reached to open a session (dial, reset): nothing ran there
        super().__init__(f"hop {peer_id[-8:]} {'is busy' if busy_s is not None else 'failed'}: {reason}")


class GenerationError(RuntimeError):
    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


def hop_error(peer_id: str, err: Error, retriable: bool = False) -> HopFailed:
    """The HopFailed an Error frame from a hop means: `busy` is not a failure of the hop."""
    if err.code == ErrorCode.BUSY:
        return HopFailed(peer_id, err.message, busy_s=err.retry_after_s or BUSY_RETRY_S)
    return HopFailed(peer_id, f"{err.code}: {err.message}",
                     retriable=retriable or err.retriable or err.code == ErrorCode.UNKNOWN_SESSION)


def outcome_of(exc: BaseException | None) -> str:
    """How a generation that raised `exc` (None: returned) ended, for the ledger: completed (also a
    stop sequence's cut), cancelled (the client went away, or the daemon stopped it), or failed."""
    if exc is None or ended_normally(exc):
        return "completed"
    if isinstance(exc, BaseExceptionGroup):
        inner = first_of(exc)
        exc = inner if inner is not exc else exc.exceptions[0]
    if isinstance(exc, (trio.Cancelled, trio.BrokenResourceError, trio.ClosedResourceError, KeyboardInterrupt)):
        return "cancelled"
    return "failed"


def first_of(group: BaseExceptionGroup) -> BaseException:
    """The error that matters in a task group: a generation or hop error if any, else the group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = first_of(exc)
        if isinstance(exc, (HopFailed, GenerationError, RoutesDisagree, SwitchTable, Moved)):
            return exc
    return group


def ended_normally(exc: BaseException) -> bool:
    """Whether an exception (possibly wrapped in task groups) ended a generation on purpose, e.g. a
    stop sequence: its class says so with `ends_generation_normally = True`."""
    if isinstance(exc, BaseExceptionGroup):
        return any(ended_normally(e) for e in exc.exceptions)
    return getattr(exc, "ends_generation_normally", False)


class RoutesDisagree(RuntimeError):
    """The two routes of a checked generation gave different tokens after the same accepted ones:
    neither token reaches the client until a third route settles which route is wrong."""

    def __init__(self, position: int, routes: tuple[list, list], tokens: tuple[int, int], hops=(),
                 sketches: tuple[dict, dict] | None = None, seed: int = 0):
        self.position, self.routes, self.tokens = position, routes, tokens
        self.hops = tuple(hops)  # the routes' planned `Hop`s (addresses), to build trial routes from
        self.sketches, self.seed = sketches, seed  # each route's hops' sketches of the step (meshd/hop/sketch.py)
        super().__init__(f"routes disagree at generated token {position}: {tokens[0]} against {tokens[1]}")


class SwitchTable(Exception):
    """A generation's sequence grew past its longrope model's short RoPE table: the try ends, its sessions
    are released, and the next try opens them on the long table and computes the sequence anew
    (`meshd/entry/state.py`). Not a failure: nothing is retried or blamed."""

    def __init__(self, length: int, switch: int):
        self.length, self.switch = length, switch
        super().__init__(f"the sequence of {length} positions is past the short RoPE table's {switch}")


class Moved(Exception):
    """A hop of the route leaves on purpose (`Leaving`): the try ends at a step boundary, and the next one goes
    over `route`, the same hops but the leaving one's replica, which holds the KV it handed over
    (`meshd/hop/handover.py`): only the positions since are computed. With `route` None the hand-over failed
    (`reason`), and the next try is planned without the leaving hop and replays. Not a failure of any hop."""

    def __init__(self, peer_id: str, route=None, positions: int = 0, reason: str = "", tried: bool = True):
        self.peer_id, self.route, self.positions, self.reason = peer_id, route, positions, reason
        self.tried = tried  # a hand-over was tried (False: replaying was as cheap, under a block computed)
        self.channels: dict = {}  # the streams of the hops that stay, each carrying its old session's Close before
        # the next try's OpenSession (so the KV it keeps is there to start from: meshd/entry/opening.py)
        super().__init__(f"hop {peer_id[-8:]} leaves: " + (f"{positions} positions handed over" if route is not None
                                                           else f"hand-over failed ({reason})"))
