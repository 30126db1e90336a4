"""Reading other daemons' records: from our own store (pushed here), from the peer itself, or by a walk.

Rule: a record counts only once verified (`open_record`), each stored value verified once; a peer
is asked directly when connected or dialable (it always holds its newest record, and a walk can
stall on an unrelated dead peer), else found by a walk, each under its deadline.
"""

from __future__ import annotations

import time

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from meshd.dht.kad import KadWalker
from meshd.dht.record import CoverageRecord, RecordError, open_record, record_key
from meshd.p2p.addrs import strip_peer
from meshd.p2p.connections import forget_failed_dials

LOOKUP_TIMEOUT = 3.0  # a lookup through the DHT
DIRECT_TIMEOUT = 1.5  # asking a connected peer for its own record


class RecordReader:
    """Verified records of other peers for one host; `on_rtt(peer_id, seconds)` hears direct round trips."""

    def __init__(self, host, dht, walker: KadWalker, on_rtt, dial=None) -> None:
        self.host, self.dht, self.walker = host, dht, walker
        self.on_rtt, self.dial = on_rtt, dial
        self._opened: dict[str, tuple[bytes, CoverageRecord]] = {}  # key -> last verified value

    async def fetch(self, peer_id: str, known: CoverageRecord | None = None) -> CoverageRecord | None:
        """A fresh, verified record of peer_id: asked of the peer itself when it is connected or can
        be dialled (it always holds its newest record, and a walk can stall on an unrelated dead
        peer), else found by a walk; None if neither answers in time. `known`: the last record of it
        held, whose addresses a dial may use."""
        key = record_key(peer_id)
        pid = ID.from_base58(peer_id)
        value = None
        if pid not in self.host.get_connected_peers():
            await self._reconnect(pid, key, known)
        if pid in self.host.get_connected_peers():
            with trio.move_on_after(DIRECT_TIMEOUT):
                try:
                    t0 = time.perf_counter()
                    value = await self.walker.get_from(pid, key)
                    self.on_rtt(peer_id, time.perf_counter() - t0)
                except Exception:
                    value = None
        else:
            with trio.move_on_after(LOOKUP_TIMEOUT):
                try:
                    value = await self.walker.get(key)
                except Exception:
                    value = None
        if not isinstance(value, bytes):
            return None
        try:
            return open_record(value, key=key)
        except RecordError:
            return None

    def stored(self, peer_id: str, now: float) -> CoverageRecord | None:
        """The live record of peer_id held in our own store (pushed here), verified once per value."""
        key = record_key(peer_id)
        stored = self.dht.value_store.get(key.encode())
        if stored is None:
            self._opened.pop(key, None)
            return None
        cached = self._opened.get(key)
        if cached is not None and cached[0] == stored.value:
            rec = cached[1]
        else:
            try:
                rec = open_record(stored.value, key=key, allow_expired=True)
            except RecordError:
                return None
            self._opened[key] = (stored.value, rec)
        if rec.expired(now):  # useless to anyone (validators refuse it): it stops naming a candidate
            self.dht.value_store.remove(key.encode())
            self._opened.pop(key, None)
            return None
        return rec

    async def _reconnect(self, pid: ID, key: str, known: CoverageRecord | None) -> None:
        """Dial a peer we hold a record of (ours, or one stored at us), so it can be asked directly.

        A transient dial failure must not hide a peer: py-libp2p keeps a negative cache of peers
        whose addresses all failed once, so it is cleared before this deliberate retry.
        """
        stored = self.dht.value_store.get(key.encode())
        addrs = None
        if stored is not None:
            try:
                addrs = open_record(stored.value, key=key, allow_expired=True).dial_addrs
            except RecordError:
                addrs = None
        if addrs is None and known is not None:
            addrs = known.dial_addrs
        if not addrs:
            return
        forget_failed_dials(self.host.get_network(), pid)
        with trio.move_on_after(DIRECT_TIMEOUT if self.dial is None else DIRECT_TIMEOUT * 2):
            try:
                if self.dial is not None:
                    await self.dial(pid.to_base58(), addrs)
                else:
                    await self.host.connect(PeerInfo(pid, [multiaddr.Multiaddr(strip_peer(a)) for a in addrs]))
            except Exception:
                pass
