"""Hole punching: a relayed connection between two daemons behind NAT becomes a direct one.

py-libp2p's DCUtR (`DCUtRProtocol`) does the work, measured in the test bed: every 2 s it looks for
relayed connections and, over the relay, both sides exchange their public address (the router's
IP, seen by identify on the direct connection to the relay, with the listen port) and dial each
other at the same moment from their listen port; behind routers that keep source ports (Linux
masquerade) that succeeds every time in ~0.7 s of exchange, behind symmetric NATs never (three
attempts per peer, then it gives up and the relay keeps carrying the traffic). New streams then
take the direct connection. Rules added here: no first plain dial at the addresses identify reports
(meshd's dialler tried the peer's record addresses already), punch dials get `DIAL_TIMEOUT`; py-libp2p closes
the relayed connection 60 s after an upgrade, resetting whatever still runs on it, so here it is
closed only once no session stream (`busy_protocols`) is left on it, or after `DRAIN_MAX_S`;
attempts and their outcome are counted for `meshctl status`. py-libp2p gives up on a peer after
three failed attempts for as long as the relayed connection lasts; here a peer whose attempts are
spent is tried again after a backoff (`retry_backoff`: 10 s, doubling up to 10 min), so a punch that
failed while the boxes were loaded, or before a router's mapping settled, is not given up for good.
"""

from __future__ import annotations

import time

import trio
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, RELAY_CLOSE_GRACE_PERIOD, DCUtRProtocol

from meshd.core.log import get_logger
from meshd.p2p.connections import is_relayed, live_connections

DIAL_TIMEOUT = 2
DRAIN_MAX_S = 600.0  # a relayed connection still carrying sessions is closed after this anyway
DRAIN_POLL_S = 2.0
RETRY_FIRST_S, RETRY_MAX_S = 10.0, 600.0
RENEW_POLL_S = 2.0  # how often spent peers are looked at (py-libp2p's auto-drive loop runs as often)
log = get_logger(__name__)


def retry_backoff(previous: float | None) -> float:
    """Seconds until a peer whose punches all failed is tried again: RETRY_FIRST_S, then twice the
    previous wait, at most RETRY_MAX_S."""
    return RETRY_FIRST_S if previous is None else min(RETRY_MAX_S, previous * 2)


class HolePuncher(DCUtRProtocol):
    def __init__(self, host, busy_protocols=(), grace_s: float = RELAY_CLOSE_GRACE_PERIOD) -> None:
        super().__init__(host, dial_timeout=DIAL_TIMEOUT)
        self.busy_protocols = {str(p) for p in busy_protocols}
        self.grace_s = grace_s
        self.attempts = self.upgraded = self.failed = 0
        self.seconds: list[float] = []  # duration of each successful punch
        self.retries = 0  # peers whose spent attempts were renewed after a backoff
        self._retry: dict = {}  # peer ID -> (clock time its attempts are renewed, that backoff)
        self.clock = time.monotonic

    def summary(self) -> dict:
        secs = sorted(self.seconds)
        return {"attempts": self.attempts, "upgraded": self.upgraded, "failed": self.failed,
                "in_progress": self.attempts - self.upgraded - self.failed, "retries": self.retries,
                "median_s": round(secs[len(secs) // 2], 3) if secs else None}

    async def initiate_hole_punch(self, peer_id) -> bool:
        if (await self._have_direct_connection(peer_id) or peer_id in self._in_progress
                or self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS):
            return await super().initiate_hole_punch(peer_id)  # nothing new is tried: not counted
        t0 = time.monotonic()
        self.attempts += 1
        try:
            ok = await super().initiate_hole_punch(peer_id)
        except Exception as exc:
            log.info("hole punch failed", peer=peer_id.to_base58()[-8:], error=f"{type(exc).__name__}: {exc}")
            ok = False
        if ok:
            self._retry.pop(peer_id, None)
            self.upgraded += 1
            self.seconds.append(time.monotonic() - t0)
            log.info("hole punched: direct connection", peer=peer_id.to_base58()[-8:],
                     seconds=round(time.monotonic() - t0, 3))
        else:
            self.failed += 1
            spent = self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS
            if spent:
                wait = retry_backoff(self._retry[peer_id][1] if peer_id in self._retry else None)
                self._retry[peer_id] = (self.clock() + wait, wait)
            log.info("hole punch did not get through", peer=peer_id.to_base58()[-8:],
                     attempt=self._hole_punch_attempts.get(peer_id, 0),
                     retry_in_s=self._retry[peer_id][1] if spent else None)
        return ok

    def renew_due(self, now: float) -> list:
        """Give the peers whose backoff is over their attempts again (the auto-drive loop, every 2 s,
        punches a relayed peer with attempts left); returns them."""
        due = [p for p, (at, _) in self._retry.items() if at <= now
               and self._hole_punch_attempts.get(p, 0) >= MAX_HOLE_PUNCH_ATTEMPTS]
        for p in due:
            self._hole_punch_attempts.pop(p, None)
            self.retries += 1
            log.info("hole punch: trying again", peer=p.to_base58()[-8:], after_s=self._retry[p][1])
        return due

    async def _auto_drive_loop(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_loop)
            await super()._auto_drive_loop()

    async def _renew_loop(self) -> None:
        while True:
            await trio.sleep(RENEW_POLL_S)
            self.renew_due(self.clock())

    async def _try_unilateral_upgrade(self, peer_id) -> bool:
        """DCUtR's step 0, a plain dial at the peer's other addresses, is skipped: meshd's dialler
        already tried them before it went through a relay, and the addresses identify reports are
        listen addresses (a 0.0.0.0 one made the dial reach this host's own listener and fail the
        Noise handshake, ~0.7 s a try; a private one of another home could hang to the timeout)."""
        return False

    def _busy(self, conn) -> bool:
        try:
            return any(str(s.get_protocol()) in self.busy_protocols for s in conn.get_streams())
        except Exception:
            return False

    async def _close_relayed_conns_after_grace(self, peer_id, grace: float = RELAY_CLOSE_GRACE_PERIOD) -> None:
        """After the grace period, wait for the relayed connection's sessions to end, then close it."""
        await trio.sleep(self.grace_s)
        deadline = time.monotonic() + DRAIN_MAX_S
        while time.monotonic() < deadline:
            conns = live_connections(self.host.get_network(), peer_id)
            if not any(is_relayed(c) and self._busy(c) for c in conns):
                break
            await trio.sleep(DRAIN_POLL_S)
        await super()._close_relayed_conns_after_grace(peer_id, grace=0)
