"""What a relay admits: reservations and circuits under an operator's limits (pure: time is passed in).

Rules: a peer holds at most one reservation (reserving again refreshes it); a circuit goes only to
a peer with a live reservation; circuits open at once are bounded in all and per peer (a peer is
counted as source and as destination), so one peer opening many circuits is refused at its share
while others keep theirs; each circuit carries at most `circuit_bytes` (both directions together)
for at most `circuit_s` seconds, then it is cut. Defaults are sized for meshd's traffic: a
generation moves ~1-2 KB per token per hop (SmolLM2, bfloat16), so a 1 GiB circuit carries hundreds
of thousands of tokens; a circuit that is cut costs its sessions a reroute, not their output.
Circuit addresses are read and written by meshd/p2p/addrs.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from meshd.core.settings import default



@dataclass(frozen=True)
class RelayLimits:
    reservations: int = default("relay_reservations")  # peers holding a reservation at once
    circuits: int = default("relay_circuits")  # circuits open at once, all peers together
    circuits_per_peer: int = default("relay_circuits_per_peer")  # circuits open at once from or to one peer
    circuit_bytes: int = default("relay_circuit_mb") << 20  # bytes one circuit carries, both directions together
    circuit_s: float = default("relay_circuit_s")  # seconds one circuit lasts
    reservation_s: int = 300        # a reservation lapses unless refreshed within this


@dataclass
class Circuit:
    src: str
    dst: str
    opened: float
    bytes: int = 0


@dataclass
class RelayLedger:
    limits: RelayLimits
    reservations: dict[str, float] = field(default_factory=dict)  # peer -> expiry (unix time)
    circuits: dict[int, Circuit] = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)  # reason -> count
    served: int = 0  # circuits opened since start
    relayed_bytes: int = 0  # over closed and open circuits
    _next: int = 0

    def reserve(self, peer: str, now: float) -> float | str:
        """The new expiry of `peer`'s reservation, or why it is refused."""
        self._lapse(now)
        if peer not in self.reservations and len(self.reservations) >= self.limits.reservations:
            return self._refuse("reservations full")
        self.reservations[peer] = now + self.limits.reservation_s
        return self.reservations[peer]

    def drop(self, peer: str) -> None:
        """`peer` is gone (its connection closed): its reservation ends with it."""
        self.reservations.pop(peer, None)

    def open(self, src: str, dst: str, now: float) -> int | str:
        """A circuit id, or why the circuit `src` -> `dst` is refused."""
        self._lapse(now)
        if dst not in self.reservations:
            return self._refuse("no reservation")
        if src == dst:
            return self._refuse("circuit to itself")
        if len(self.circuits) >= self.limits.circuits:
            return self._refuse("circuits full")
        for peer in (src, dst):
            if self.open_for(peer) >= self.limits.circuits_per_peer:
                return self._refuse("per-peer limit")
        self._next += 1
        self.circuits[self._next] = Circuit(src, dst, now)
        self.served += 1
        return self._next

    def carry(self, cid: int, n: int) -> bool:
        """Count `n` more bytes on a circuit; False once it is past its byte limit (cut it)."""
        c = self.circuits.get(cid)
        if c is None:
            return False
        c.bytes += n
        self.relayed_bytes += n
        if c.bytes > self.limits.circuit_bytes:
            self.refused["byte limit"] += 1
            return False
        return True

    def close(self, cid: int) -> None:
        self.circuits.pop(cid, None)

    def open_for(self, peer: str) -> int:
        return sum(1 for c in self.circuits.values() if peer in (c.src, c.dst))

    def summary(self, now: float) -> dict:
        self._lapse(now)
        return {"reservations": len(self.reservations), "circuits": len(self.circuits), "served": self.served,
                "relayed_bytes": self.relayed_bytes, "refused": dict(self.refused),
                "limits": {"reservations": self.limits.reservations, "circuits": self.limits.circuits,
                           "circuits_per_peer": self.limits.circuits_per_peer,
                           "circuit_bytes": self.limits.circuit_bytes, "circuit_s": self.limits.circuit_s}}

    def _lapse(self, now: float) -> None:
        for peer in [p for p, t in self.reservations.items() if t <= now]:
            del self.reservations[peer]

    def _refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason
