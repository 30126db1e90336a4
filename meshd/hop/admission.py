"""Admission of sessions at a hop, as one pure function of the numbers that bound it: the sessions
open, the session limit, the KV bytes promised to them and the KV budget.

Rule: the same numbers answer both questions, "may this session open?" (`refusal`, the reason
behind a `busy` reply) and "how many more would fit?" (`free_sessions`, the record's free capacity
that entries and routes read), so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

TYPICAL_LENGTH = 2048  # positions of the session `free_sessions` counts in


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
