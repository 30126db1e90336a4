"""A private daemon's relays: reservations at `want` relays found in the mesh, kept fresh, replaced
when a relay goes, and published as circuit addresses in the daemon's record.

Rules: relays are peers whose record says they relay; the nearest (measured record round trip)
are tried first, one that refused or failed is left alone for a backoff that doubles up to a
minute; a reservation is renewed every `CHECK_S` (a relay that does not answer within
`RESERVE_TIMEOUT`, a frozen one whose connection still looks open, is dropped and disconnected), and
dropped as soon as the connection to its relay closes (a reservation lives only as long as that
connection), so a relay that dies is replaced within a tick (`TICK_S`) and the record republished
without it.
Choosing is a pure function (`choose_relays`); the loop only does what it says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import trio
from libp2p.peer.id import ID

from meshd.core.log import get_logger
from meshd.relay.circuit import Reserved, reserve
from meshd.p2p.connections import is_connected
from meshd.p2p.addrs import circuit_addr, is_circuit

TICK_S = 1.0
CHECK_S = 5.0  # a held relay is asked again this often: one that stopped answering (frozen) is dropped
MIN_BACKOFF_S, MAX_BACKOFF_S = 2.0, 60.0
RESERVE_TIMEOUT = 5.0
log = get_logger(__name__)


@dataclass(frozen=True)
class RelayCandidate:
    peer_id: str
    addrs: tuple[str, ...]  # its direct addresses (from its record)
    rtt: float | None  # measured record round trip, seconds


def relay_candidates(records, latency: Mapping[str, float], own_id: str, now: float) -> list[RelayCandidate]:
    """The relays a private daemon may reserve at, from the mesh's records: those that say they relay,
    are not leaving and not expired, other than this daemon, with their measured round trip if any."""
    return [RelayCandidate(r.peer_id, r.addrs, latency.get(r.peer_id))
            for r in records if r.relay and not r.leaving and not r.expired(now) and r.peer_id != own_id]


def choose_relays(candidates: list[RelayCandidate], held: set[str], backoff_until: dict[str, float], now: float,
                  want: int) -> list[str]:
    """Relays to try, in order, until `want` are held: not held already, not in backoff, with a direct
    address; measured ones nearest first, then unmeasured, ties by peer id (empty when enough are held)."""
    if len(held) >= want:
        return []
    usable = [c for c in candidates if c.peer_id not in held and c.addrs and backoff_until.get(c.peer_id, 0.0) <= now]
    usable.sort(key=lambda c: (c.rtt is None, c.rtt or 0.0, c.peer_id))
    return [c.peer_id for c in usable]


class RelayClient:
    def __init__(self, host, want: int, candidates, connect, active, on_change) -> None:
        """`candidates()`: RelayCandidates from the mesh; `connect(peer_id, addrs)`: dial directly;
        `active()`: whether this daemon needs relays now (it is not publicly reachable);
        `on_change()`: awaited when the circuit addresses changed (republish the record)."""
        self.host, self.want = host, want
        self.candidates, self.connect, self.active, self.on_change = candidates, connect, active, on_change
        self.held: dict[str, Reserved] = {}
        self.via: dict[str, tuple[str, ...]] = {}  # relay -> the direct addresses we reached it at
        self.backoff: dict[str, tuple[float, float]] = {}  # relay -> (until, seconds)
        self.lost = 0  # reservations lost because their relay went away
        self.replaced_in: list[float] = []  # seconds from losing a relay to holding `want` again
        self._lost_at: float | None = None  # monotonic time the first of the relays now missing went
        self._checked: dict[str, float] = {}  # relay -> monotonic time of its last answer

    def allowed(self) -> set[str]:
        """Relays this daemon accepts relayed connections from."""
        return set(self.held)

    def circuit_addrs(self) -> tuple[str, ...]:
        me = self.host.get_id().to_base58()
        return tuple(circuit_addr(a, relay, me) for relay in sorted(self.held) for a in self.via.get(relay, ())[:2])

    def summary(self) -> dict:
        now = time.time()
        return {"want": self.want if self.active() else 0,
                "relays": [{"peer_id": r, "expires_in_s": round(v.expires_at - now, 1)} for r, v in sorted(self.held.items())],
                "circuit_addrs": list(self.circuit_addrs()), "lost": self.lost,
                "replaced_in_s": [round(s, 2) for s in self.replaced_in[-5:]]}

    def _connected(self, relay: str) -> bool:
        return is_connected(self.host.get_network(), relay)

    async def tick(self) -> None:
        """One round: drop what is gone, renew what is due, reserve where short; republish on change."""
        before = self.circuit_addrs()
        now = time.time()
        if not self.active():
            self.held.clear()
        for relay, r in list(self.held.items()):
            if not self._connected(relay) or r.expires_at <= now:
                log.info("relay lost", relay=relay[-8:], connected=self._connected(relay))
                del self.held[relay]
                if not self._connected(relay):  # gone: not the first to try again (its record lingers a TTL)
                    self._back_off(relay)
                self.lost += 1
                self._lost_at = self._lost_at or time.monotonic()
        if self.active():
            for relay, r in list(self.held.items()):
                due = time.monotonic() - self._checked.get(relay, 0.0) >= CHECK_S
                if due or r.expires_at - now < 2 * CHECK_S:  # (a relay may grant less than CHECK_S)
                    if not await self._reserve(relay):
                        self.lost += 1
                        self._lost_at = self._lost_at or time.monotonic()
                        with trio.move_on_after(2.0):  # frozen or refusing: let go of it, circuits included
                            try:
                                await self.host.disconnect(ID.from_base58(relay))
                            except Exception:
                                pass
            backoff_until = {p: until for p, (until, _) in self.backoff.items()}
            cands = {c.peer_id: c for c in self.candidates()}
            for relay in choose_relays(list(cands.values()), set(self.held), backoff_until, now, self.want):
                if len(self.held) >= self.want:
                    break
                await self._reserve(relay, cands[relay].addrs)
            if len(self.held) >= self.want and self._lost_at is not None:
                self.replaced_in.append(time.monotonic() - self._lost_at)
                self._lost_at = None
        if self.circuit_addrs() != before:
            log.info("relays", held=[r[-8:] for r in sorted(self.held)], circuit_addrs=len(self.circuit_addrs()))
            await self.on_change()

    def _back_off(self, relay: str) -> float:
        """Leave `relay` alone for a while, twice as long as last time (up to a minute)."""
        seconds = min(MAX_BACKOFF_S, self.backoff.get(relay, (0.0, MIN_BACKOFF_S / 2))[1] * 2)
        self.backoff[relay] = (time.time() + seconds, seconds)
        return seconds

    async def _reserve(self, relay: str, addrs: tuple[str, ...] | None = None) -> bool:
        try:
            with trio.fail_after(RESERVE_TIMEOUT):
                if addrs is not None:
                    await self.connect(relay, addrs)
                got = await reserve(self.host, relay)
        except Exception as exc:
            seconds = self._back_off(relay)
            self.held.pop(relay, None)
            log.info("relay reservation failed", relay=relay[-8:], error=f"{type(exc).__name__}: {exc}",
                     retry_in_s=seconds)
            return False
        self.backoff.pop(relay, None)
        if addrs is not None:
            self.via[relay] = tuple(a for a in addrs if not is_circuit(a))
        if relay not in self.held:
            log.info("relay reserved", relay=relay[-8:], expires_in_s=round(got.expires_at - time.time(), 1))
        self.held[relay] = got
        self._checked[relay] = time.monotonic()
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("relay round failed")
            await trio.sleep(TICK_S)
