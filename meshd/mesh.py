"""The daemon's view of the mesh: its own signed record, publishing, and the coverage map.

Rules: the record is republished well before it expires (a third of its TTL), so a daemon that
dies shows as a gap within one TTL plus one refresh round (interval + round timeout); a connected
peer is asked for its own record directly, and a round never waits on a frozen peer past its
timeout; reads that must be fresh drop the local copy
first (py-libp2p's get_value answers from its local store and caches every read).
"""

from __future__ import annotations

import time
from dataclasses import replace

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from meshd.dht.coverage import CoverageMap
from meshd.dht.record import CoverageRecord, RecordError, bump, open_record, record_key, sign_record
from meshd.log import get_logger

COVERAGE_INTERVAL = 1.0
LOOKUP_TIMEOUT = 3.0  # a lookup through the DHT
DIRECT_TIMEOUT = 1.5  # asking a connected peer for its own record
ROUND_TIMEOUT = 3.5  # one refresh round; stragglers are cancelled and asked again next round
log = get_logger(__name__)


class MeshView:
    def __init__(self, host, dht, key_pair, record: CoverageRecord, ttl_s: float) -> None:
        self.host, self.dht, self.key_pair = host, dht, key_pair
        self.record, self.ttl_s = record, ttl_s
        self.known: dict[str, CoverageRecord] = {}
        self.latency: dict[str, float] = {}  # moving average of a record round trip per peer, seconds
        self.coverage = CoverageMap.build(record.n_layers, [record])

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    async def publish(self, **changes) -> None:
        """Sign and store the next version of this daemon's record."""
        self.record = bump(self.record, self.ttl_s, **changes)
        self._rebuild()
        value = sign_record(self.record, self.key_pair.private_key)
        with trio.move_on_after(LOOKUP_TIMEOUT * 2):
            try:
                await self.dht.put_value(record_key(self.peer_id), value)
            except Exception as exc:  # a failed store is retried at the next refresh
                log.warning("publishing record failed", error=str(exc))

    async def withdraw(self) -> None:
        """Publish a record that has already expired, so the range shows as free at once."""
        self.record = replace(self.record, seq=self.record.seq + 1, expires_at=time.time(), serving=False)
        value = sign_record(self.record, self.key_pair.private_key)
        key = record_key(self.peer_id)
        with trio.move_on_after(LOOKUP_TIMEOUT):
            try:
                self.dht.value_store.put(key.encode(), value)
                for peer in self.host.get_connected_peers():
                    with trio.move_on_after(1.0):
                        await self.dht.value_store._store_at_peer(peer, key.encode(), value)
            except Exception as exc:
                log.warning("withdrawing record failed", error=str(exc))

    async def publish_loop(self, live_fields=None) -> None:
        """Republish every third of the TTL; `live_fields()` supplies fresh throughput, load, capacity."""
        while True:
            await trio.sleep(self.ttl_s / 3)
            try:
                changes = live_fields() if live_fields else {}
            except Exception:  # a bad number must not stop the record from being refreshed
                log.exception("reading live record fields failed")
                changes = {}
            await self.publish(**changes)

    async def fetch(self, peer_id: str) -> CoverageRecord | None:
        """A fresh, verified record of peer_id: asked of the peer itself first (it always holds its
        newest record, and a lookup through the DHT can stall on an unrelated dead peer), then
        through the DHT; None if neither answers in time."""
        key = record_key(peer_id)
        pid = ID.from_base58(peer_id)
        value = None
        if pid not in self.host.get_connected_peers():
            await self._reconnect(pid, key)
        if pid in self.host.get_connected_peers():
            with trio.move_on_after(DIRECT_TIMEOUT):
                try:
                    t0 = time.perf_counter()
                    value = await self.dht.value_store._get_from_peer(pid, key.encode())
                    self._observe_rtt(peer_id, time.perf_counter() - t0)
                except Exception:
                    value = None
        else:
            self.dht.value_store.remove(key.encode())
            with trio.move_on_after(LOOKUP_TIMEOUT):
                try:
                    value = await self.dht.get_value(key)
                except Exception:
                    value = None
        if not isinstance(value, bytes):
            return None
        try:
            return open_record(value, key=key)
        except RecordError:
            return None

    async def refresh(self) -> CoverageMap:
        """Rebuild the coverage map from fresh records of every peer we know of.

        Each record is taken in as soon as it arrives, so one slow or frozen peer (whose lookup
        runs to its timeout) does not let everyone else's records age out meanwhile.
        """
        candidates = {p.to_base58() for p in self.dht.routing_table.get_peer_ids()}
        candidates |= {p.to_base58() for p in self.host.get_connected_peers()}
        candidates |= set(self.known)
        prefix = record_key("").encode()
        try:  # records other peers stored at this node: a discovery path that needs no connection
            candidates |= {k[len(prefix):].decode() for k in self.dht.value_store.get_keys() if k.startswith(prefix)}
        except Exception:
            pass
        candidates.discard(self.peer_id)

        async def one(pid: str) -> None:
            rec = await self.fetch(pid)
            if rec is not None and rec.model == self.record.model:
                old = self.known.get(pid)
                if old is None or rec.seq >= old.seq:
                    self.known[pid] = rec
                    self._rebuild()

        with trio.move_on_after(ROUND_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for pid in candidates:
                    nursery.start_soon(one, pid)
        now = time.time()
        for pid, rec in list(self.known.items()):  # forget peers whose records lapsed
            if rec.expired(now):
                del self.known[pid]
                self.latency.pop(pid, None)
        self._rebuild(now)
        return self.coverage

    async def _reconnect(self, pid: ID, key: str) -> None:
        """Dial a peer we hold a record of (ours, or one stored at us), so it can be asked directly.

        A transient dial failure must not hide a peer: py-libp2p keeps a negative cache of peers
        whose addresses all failed once, so it is cleared before this deliberate retry.
        """
        stored = self.dht.value_store.get(key.encode())
        addrs = None
        if stored is not None:
            try:
                addrs = open_record(stored.value, key=key, allow_expired=True).addrs
            except RecordError:
                addrs = None
        if addrs is None and pid.to_base58() in self.known:
            addrs = self.known[pid.to_base58()].addrs
        if not addrs:
            return
        try:
            self.host.get_network().unblock_peer(pid)
        except Exception:
            pass
        with trio.move_on_after(DIRECT_TIMEOUT):
            try:
                await self.host.connect(PeerInfo(pid, [multiaddr.Multiaddr(a.split("/p2p/")[0]) for a in addrs]))
            except Exception:
                pass

    def _observe_rtt(self, peer_id: str, seconds: float) -> None:
        """Fold one measured round trip into the peer's link latency (used by route planning)."""
        old = self.latency.get(peer_id)
        self.latency[peer_id] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def _rebuild(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        live = [r for r in self.known.values() if not r.expired(now)] + [self.record]
        self.coverage = CoverageMap.build(self.record.n_layers, live, model=self.record.model,
                                          recipe=self.record.recipe, now=now)

    async def coverage_loop(self) -> None:
        while True:
            await self.refresh()
            await trio.sleep(COVERAGE_INTERVAL)

    async def connect_bootstrap(self, addrs: list[str]) -> list[str]:
        """Dial each bootstrap address and add it to the DHT; returns the peers reached."""
        from meshd.p2p.host import connect

        reached = []
        for addr in addrs:
            try:
                pid = await connect(self.host, addr)
            except Exception as exc:
                log.warning("bootstrap peer unreachable", addr=addr, error=str(exc) or type(exc).__name__)
                continue
            await self.dht.add_peer(pid)
            reached.append(pid.to_base58())
        if reached:
            with trio.move_on_after(LOOKUP_TIMEOUT * 2):
                await self.dht.refresh_routing_table()
        return reached
