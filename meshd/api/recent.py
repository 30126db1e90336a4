"""The last generations through this daemon, as the dashboard shows them: timings and route only
(filled by `meshd/api/metrics.py`, which sees every generation at every front door).

Rule: a bounded ring (the oldest entry falls out) of numbers and peer ids; a prompt, an answer or
any text of a generation never enters it, so showing it to whoever holds the API token tells them
nothing of other users' conversations.
"""

from __future__ import annotations

import time
from collections import deque

RECENT = 20


class RecentGenerations:
    def __init__(self, size: int = RECENT) -> None:
        self._ring: deque[dict] = deque(maxlen=size)

    def record(self, stats: dict | None, outcome: str = "ok", ttft_s: float | None = None,
               seconds: float | None = None) -> None:
        """One generation that ended: `stats` as the entry returned them (None when it failed),
        `outcome` "ok" or the error code; the front door's own timings fill what stats lack."""
        stats = stats or {}
        self._ring.append({
            "ended_at": round(time.time(), 3),
            "outcome": outcome,
            "tokens": int(stats.get("tokens") or 0),
            "ttft_s": _round(stats.get("ttft_s", ttft_s)),
            "tok_per_s": _round(stats.get("decode_tok_per_s"), 2),
            "seconds": _round(seconds, 3),
            "route": [[str(p), int(a), int(b)] for p, a, b in _hops(stats.get("route"))],
            "reroutes": int(stats.get("reroutes") or 0),
        })

    def entries(self) -> list[dict]:
        """The newest first."""
        return list(reversed(self._ring))


def _round(value, digits: int = 4):
    return round(float(value), digits) if isinstance(value, (int, float)) else None


def _hops(route) -> list:
    """A route's hops as (peer id, start, end), dropping what is not one (a remote entry's stats)."""
    if not isinstance(route, (list, tuple)):
        return []
    return [h for h in route if isinstance(h, (list, tuple)) and len(h) == 3
            and all(isinstance(v, int) for v in h[1:])]
