"""Admission of sessions at a hop, as one pure function of the numbers that bound it: the sessions
open, the session limit, the KV bytes promised to them and the KV budget.

Rule: the same numbers answer both questions, "may this session open?" (`refusal`, the reason
behind a `busy` reply) and "how many more would fit?" (`free_sessions`, the record's free capacity
that entries and routes read), so the two can never disagree. One peer (the daemon a session's
stream comes from) gets at most `share` of the sessions and of the KV budget (`peer_refusal`): the
rest is a floor for everybody else. Every refusal a hop sends for want of room is built by `busy`, with one
rule for when to try again.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.core.settings import default
from meshd.wire import Error, ErrorCode

TYPICAL_LENGTH = 2048  # positions of the session `free_sessions` counts in
PEER_SHARE = default("peer_share")  # of the sessions and the KV budget, what one peer may hold
BUSY_RETRY_S = 1.0  # when room for a session (sessions, KV, streams) may be free again: about a short generation


def busy(message: str, request_id: int = 0, session_id: bytes = b"", drain_s: float | None = None) -> Error:
    """The retriable `busy` refusal a hop sends. Its hint (`retry_after_s`) follows one rule: how long until
    what is refused may fit, where the refuser knows it (`drain_s`: the time the work ahead of a full queue
    takes, `PassStats.retry_hint`), else BUSY_RETRY_S: room frees as a session ends."""
    return Error(code=ErrorCode.BUSY, message=message, retriable=True, request_id=request_id, session_id=session_id,
                 retry_after_s=BUSY_RETRY_S if drain_s is None else drain_s)


@dataclass(frozen=True)
class Capacity:
    sessions: int  # open now
    max_sessions: int
    promised: int  # KV bytes the open sessions may grow to
    budget: int  # KV bytes this shard may hold

    def refusal(self, need: int) -> str | None:
        """Why a new session needing `need` KV bytes cannot open, or None when it can."""
        if self.sessions >= self.max_sessions:
            return f"this shard serves {self.sessions} sessions, its limit"
        if self.promised + need > self.budget:
            return (f"its KV budget ({self.budget} bytes) is promised to {self.sessions} sessions;"
                    f" this one needs {need}")
        return None

    def free_sessions(self, typical: int) -> int:
        """How many more sessions of `typical` KV bytes each would be admitted now."""
        room = max(0, self.budget - self.promised) // max(1, typical)
        return int(max(0, min(self.max_sessions - self.sessions, room)))

    def peer_refusal(self, peer_sessions: int, peer_promised: int, need: int, share: float = PEER_SHARE) -> str | None:
        """Why one more session for a peer that holds `peer_sessions` sessions and `peer_promised`
        KV bytes here cannot open (its share is full, or the shard is), or None when it can."""
        if peer_sessions >= max(1, int(self.max_sessions * share)):
            return f"this peer holds {peer_sessions} of this shard's {self.max_sessions} sessions, its share"
        if peer_promised + need > int(self.budget * share):
            return (f"this peer's sessions hold {peer_promised} bytes of this shard's KV budget ({self.budget}),"
                    f" its share; this one needs {need}")
        return self.refusal(need)
