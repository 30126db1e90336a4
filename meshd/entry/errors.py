"""How a generation fails: a hop that failed or is full (`HopFailed`), or the generation itself
(`GenerationError`, with the wire's error code the client gets); and the one rule for how a generation
ended (`ending`), which the ledger, the metrics and the dashboard use alike. A try that ends on purpose
to start again (past the RoPE table's switch, a hop that left, routes that disagreed) says so with its
event (`meshd/entry/stages.py`), not with an exception."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Ending:
    """How a generation ended: its outcome (the ledger's word, and the stage it ends in: `meshd/entry/stages.py`)
    and the reason metrics and the dashboard show ("ok", the error code the client got, or "cancelled")."""

    outcome: str  # completed / cancelled / failed
    reason: str


def ending(exc: BaseException | None) -> Ending:
    """The one rule for how a generation that raised `exc` (None: returned) ended: completed (also when a stop
    sequence cut it on purpose), failed when the mesh said why (a `GenerationError`'s code, a hop that failed), and
    cancelled otherwise (the client went away, the daemon stopped it, or it was cut off without a code)."""
    if exc is None or ended_normally(exc):
        return Ending("completed", "ok")
    if isinstance(exc, BaseExceptionGroup):
        inner = first_of(exc)
        exc = inner if inner is not exc else exc.exceptions[0]
    if isinstance(exc, GenerationError):
        return Ending("failed", str(exc.code))
    if isinstance(exc, HopFailed):
        return Ending("failed", str(ErrorCode.HOP_FAILED))
    return Ending("cancelled", "cancelled")


def outcome_of(exc: BaseException | None) -> str:
    """The ledger's word for how a generation that raised `exc` ended (see `ending`)."""
    return ending(exc).outcome


def first_of(group: BaseExceptionGroup) -> BaseException:
    """The error that matters in a task group: a generation or hop error if any, else the group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = first_of(exc)
        if isinstance(exc, (HopFailed, GenerationError)):
            return exc
    return group


def ended_normally(exc: BaseException) -> bool:
    """Whether an exception (possibly wrapped in task groups) ended a generation on purpose, e.g. a
    stop sequence: its class says so with `ends_generation_normally = True`."""
    if isinstance(exc, BaseExceptionGroup):
        return any(ended_normally(e) for e in exc.exceptions)
    return getattr(exc, "ends_generation_normally", False)
