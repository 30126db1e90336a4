"""The daemon's view of the mesh: its own signed record, publishing, and the coverage map.

Rules: the record is republished at half its TTL (a copy with under a third left is pulled, so one
lost push costs nothing) and pushed, over streams kept open between pushes, to the k
peers closest to its key (found by a Kademlia walk, `meshd.dht.kad`; in a mesh of up to k daemons,
every peer), so a refresh round reads the records pushed to it from its own store, without asking
anyone, and a daemon that dies shows as a gap within one TTL plus one round (1 s). A record not
pushed here, or one about to lapse, is asked of its peer directly when connected, else found by a
walk; such a pull is not repeated for a peer sooner than a third of the TTL, later still while the
peer stays unheard of. A round never waits on a frozen peer past its timeout.
"""

from __future__ import annotations

import time

import multiaddr
import trio
from libp2p.peer.id import ID

from meshd.dht.coverage import CoverageMap
from meshd.dht.kad import KadWalker
from meshd.dht.pull import LOOKUP_TIMEOUT, RecordReader
from meshd.dht.record import CoverageRecord, bump, needs_pull, record_key, republish_every, sign_record
from meshd.core.log import get_logger

COVERAGE_INTERVAL = 1.0  # a round that reads only pushed records costs no network traffic
ROUND_TIMEOUT = 3.5  # one refresh round; stragglers are cancelled and asked again next round
REWALK_S = 60.0  # a publish walks for the closest peers this often, or when the set of peers changed
MAX_PULL_BACKOFF_S = 60.0  # longest wait between pulls of a peer nobody holds a live record of
log = get_logger(__name__)


class MeshView:
    """This daemon's record and its publishing, the records of the peers it knows, and the coverage map."""

    def __init__(self, host, dht, key_pair, record: CoverageRecord, ttl_s: float, dial=None) -> None:
        """`dial(peer_id, addrs)`: the daemon's dialler (direct or through a relay); default: direct only."""
        self.host, self.dht, self.key_pair = host, dht, key_pair
        self.record, self.ttl_s = record, ttl_s
        self.known: dict[str, CoverageRecord] = {}
        self.lapsed: dict[str, CoverageRecord] = {}  # records that expired in the last TTL, by peer
        self.latency: dict[str, float] = {}  # moving average of a record round trip per peer, seconds
        self.coverage = CoverageMap.build(record.n_layers, [record])
        self.walker: KadWalker = getattr(dht, "walker", None) or KadWalker(host, dht)
        self._targets: list[ID] = []  # where the last walk said this daemon's record belongs
        self._targets_at, self._targets_seen = 0.0, frozenset()
        self._next_pull: dict[str, tuple[float, float]] = {}  # peer -> (monotonic time, backoff s)
        self.records = RecordReader(host, dht, self.walker, self._observe_rtt, dial)

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    async def publish(self, **changes) -> None:
        """Sign and store the next version of this daemon's record."""
        self.record = bump(self.record, self.ttl_s, **changes)
        self._rebuild()
        value = sign_record(self.record, self.key_pair.private_key)
        key = record_key(self.peer_id)
        self.walker.store_local(key, value)
        with trio.move_on_after(LOOKUP_TIMEOUT * 2):
            try:
                await self.walker.store_at(await self._publish_targets(), key, value, on_rtt=self._observe_rtt,
                                           keep=True)
            except Exception as exc:  # a failed store is retried at the next republish
                log.warning("publishing record failed", error=str(exc))

    async def _publish_targets(self) -> list[ID]:
        """The k peers closest to our key: walked for when the peers we know changed or REWALK_S
        passed (half a TTL while the coverage has gaps: a peer behind NAT is found only by walking,
        through the relays its neighbours' answers name), else the last walk's answer (a republish
        in a settled mesh costs no walk)."""
        seen = frozenset(self.dht.routing_table.get_peer_ids()) | frozenset(self.host.get_connected_peers())
        now = time.monotonic()
        every = REWALK_S if self.coverage.complete else self.ttl_s / 2  # a mesh with gaps looks for peers harder
        if not self._targets or seen != self._targets_seen or now - self._targets_at > every:
            self._targets = await self.walker.find_closest(record_key(self.peer_id))
            self._targets_at, self._targets_seen = now, seen
        return self._targets

    async def withdraw(self) -> None:
        """Publish a live record that says "not serving", so peers take the range as free at their next
        read (a record that had already expired would be refused by every validator, and the old one
        would stand until it lapsed). Later republishing keeps saying so."""
        self.record = bump(self.record, self.ttl_s, serving=False)
        value = sign_record(self.record, self.key_pair.private_key)
        key = record_key(self.peer_id)
        with trio.move_on_after(LOOKUP_TIMEOUT):
            try:
                self.walker.store_local(key, value)
                await self.walker.store_at(list(set(self.host.get_connected_peers()) | set(self._targets)), key, value)
            except Exception as exc:
                log.warning("withdrawing record failed", error=str(exc))

    async def publish_loop(self, live_fields=None) -> None:
        """Republish every half TTL; `live_fields()` supplies fresh throughput, load, capacity."""
        while True:
            await trio.sleep(republish_every(self.ttl_s))
            try:
                changes = live_fields() if live_fields else {}
            except Exception:  # a bad number must not stop the record from being refreshed
                log.exception("reading live record fields failed")
                changes = {}
            await self.publish(**changes)

    async def refresh(self) -> CoverageMap:
        """Rebuild the coverage map from fresh records of every peer we know of.

        Records pushed here are read from the local store; the others are pulled, each taken in as
        soon as it arrives, so one slow or frozen peer (whose pull runs to its timeout) does not
        let everyone else's records age out meanwhile.
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
        now, clock = time.time(), time.monotonic()

        def take(pid: str, rec: CoverageRecord | None) -> None:
            if rec is not None and rec.model == self.record.model:
                old = self.known.get(pid)
                if old is None or rec.seq >= old.seq:
                    self.known[pid] = rec
                    self.lapsed.pop(pid, None)
                    self._rebuild()
                    if rec.relay_addrs and (old is None or old.relay_addrs != rec.relay_addrs):
                        self._note_circuits(rec)

        async def pull(pid: str) -> None:
            rec = await self.records.fetch(pid, self.known.get(pid))
            take(pid, rec)
            backoff = self._next_pull.get(pid, (0.0, 0.0))[1]
            backoff = self.ttl_s / 3 if rec is not None else min(MAX_PULL_BACKOFF_S, max(self.ttl_s / 3, 2 * backoff))
            self._next_pull[pid] = (time.monotonic() + backoff, backoff)

        with trio.move_on_after(ROUND_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for pid in candidates:
                    pushed = self.records.stored(pid, now)
                    take(pid, pushed)
                    if not needs_pull(pushed, now, self.ttl_s):
                        continue  # pushed and fresh: its owner republishes long before it lapses
                    if self._next_pull.get(pid, (0.0, 0.0))[0] <= clock:
                        nursery.start_soon(pull, pid)
        for pid in set(self._next_pull) - candidates:
            del self._next_pull[pid]
        for pid, rec in list(self.known.items()):  # forget peers whose records lapsed
            if rec.expired(now):
                del self.known[pid]
                self.latency.pop(pid, None)
                self.lapsed[pid] = rec
        for pid, rec in list(self.lapsed.items()):
            if now - rec.expires_at > self.ttl_s:
                del self.lapsed[pid]
        self._rebuild(now)
        return self.coverage

    def lapsed_serving(self, start: int) -> set[str]:
        """Peers whose serving records of layers past `start` lapsed within the last TTL (neither
        withdrawn nor leaving): a live peer's late republish (a loaded box, a slow link), which a
        generation finding no route waits for. A dead peer cannot be told apart here (py-libp2p 0.8.1
        keeps listing a peer whose host closed as connected): the wait is bounded by the TTL."""
        now = time.time()
        lapsed = [*self.lapsed.values(), *(r for r in self.known.values() if r.expired(now))]
        return {r.peer_id for r in lapsed
                if r.serving and not r.leaving and r.end > start and now - r.expires_at <= self.ttl_s}

    def _note_circuits(self, rec: CoverageRecord) -> None:
        """Keep a peer's circuit addresses in the peerstore, so the DHT's answers about it carry them
        (py-libp2p never dials them itself; a daemon walking towards it dials through the relay)."""
        try:
            maddrs = [multiaddr.Multiaddr(a) for a in rec.relay_addrs]
            self.host.get_peerstore().add_addrs(ID.from_base58(rec.peer_id), maddrs, max(60, int(self.ttl_s * 4)))
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
        if reached:  # a Kademlia join: look ourselves up, so the peers closest to us learn of us
            with trio.move_on_after(LOOKUP_TIMEOUT * 2):
                await self.walker.find_peers(self.host.get_id())
        return reached
