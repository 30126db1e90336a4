"""Record walks over py-libp2p's Kademlia wire protocol: meshd asks, py-libp2p's KadDHT answers.

Why: py-libp2p 0.8.1 looks a record up with FIND_NODE messages carrying the record key where a
peer id belongs; its peers refuse them, so its lookups never leave the peers a node already knows
(NOTES-libp2p 14). Here a walk towards a record key sends GET_VALUE (whose key is the record key,
and whose every answer names the responder's peers closest to SHA-256 of it), a walk towards a
peer sends FIND_NODE with that peer's id, and a record is stored with PUT_VALUE at the k closest
peers a walk found. Which peer to ask next is `meshd.dht.lookup`, one question and its answer
`meshd.dht.kadclient`; this module runs the walks, each under a deadline. A value counts only if
the DHT's validator accepts it.
`MeshDHT` is py-libp2p's KadDHT (the answering side, with meshd's record validator) whose upkeep
walks with this walker instead of with py-libp2p's own lookups.
"""

from __future__ import annotations

import os

import multiaddr
import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID

from meshd.dht.kadclient import KadClient
from meshd.dht.lookup import ALPHA, K, Lookup, key_point, peer_point
from meshd.dht.record import NAMESPACE
from meshd.dht.validator import CoverageValidator
from meshd.core.log import get_logger

QUERY_TIMEOUT = 2.0  # one question to one peer, dial included
WALK_TIMEOUT = 6.0  # one walk; whatever answered by then is the result
GET_QUORUM = 3  # a get ends once this many of the k closest peers known returned a valid value and
# every peer known closer than them answered (`Lookup.settled`)
ADDR_TTL = 600  # seconds the addresses learnt from an answer stay in the peerstore
UPKEEP_S = 600.0  # routing-table refresh and expired-entry cleanup (py-libp2p's own period)
INBOUND_STREAMS = 64  # Kademlia streams a node serves at once (py-libp2p: 12); each republishing
# peer keeps one open (idle, waiting in a read), so py-libp2p's cap would refuse the 13th pusher
log = get_logger(__name__)


class MeshDHT(KadDHT):
    """py-libp2p's KadDHT in server mode with meshd's validator and walker.

    Its own upkeep is replaced: py-libp2p refreshes the routing table with lookups of ten queries
    in flight from every node at start (a burst that grows with the swarm), and republishes
    records by looking their keys up with FIND_NODE. meshd republishes its records itself.
    """

    def __init__(self, host, k: int = K) -> None:
        super().__init__(host, DHTMode.SERVER)
        self.register_validator(NAMESPACE, CoverageValidator())
        self.walker = KadWalker(host, self, k=k)
        self._inbound_limiter = trio.CapacityLimiter(INBOUND_STREAMS)

    async def _run_main_loop(self) -> None:
        while self.manager.is_running:
            await trio.sleep(UPKEEP_S)
            with trio.move_on_after(WALK_TIMEOUT * 2):
                await self.walker.refresh_table()
            self.value_store.cleanup_expired()
            self.provider_store.cleanup_expired()


class KadWalker:
    """Walks, gets and puts for one host, answered by the KadDHT services of its peers."""

    def __init__(self, host, dht, k: int = K, alpha: int = ALPHA, query_timeout: float = QUERY_TIMEOUT,
                 walk_timeout: float = WALK_TIMEOUT) -> None:
        self.host, self.dht = host, dht
        self.k, self.alpha = k, alpha
        self.query_timeout, self.walk_timeout = query_timeout, walk_timeout
        self.me = host.get_id().to_bytes()
        self.client = KadClient(host, query_timeout)  # `client.dial` reaches peers through relays

    @property
    def queries(self) -> int:
        """Questions sent, for benches and tests."""
        return self.client.queries

    async def get(self, key: str, quorum: int = GET_QUORUM) -> bytes | None:
        """The best valid value stored under `key` (ours included), by a walk towards it; None if none."""
        values: dict[bytes, bytes] = {}
        own = self.dht.value_store.get(key.encode())
        if own is not None and self._valid(key, own.value):
            values[self.me] = own.value

        def enough(lookup: Lookup) -> bool:
            return lookup.settled(values, quorum)

        async def ask(peer: bytes) -> list[Message.Peer]:
            value, closer = await self._get_value(ID(peer), key)
            if value is not None:
                values[peer] = value
            return closer

        await self._walk(key_point(key.encode()), ask, enough)
        if not values:
            return None
        found = list(values.values())
        return found[self.dht.validator.select(key, found)]

    async def get_from(self, peer: ID, key: str) -> bytes | None:
        """The value `peer` holds under `key` (one question, no walk), if valid; raises if it does not answer."""
        return (await self._get_value(peer, key))[0]

    async def _get_value(self, peer: ID, key: str) -> tuple[bytes | None, list[Message.Peer]]:
        """GET_VALUE: the valid value `peer` holds under `key` (or None) and the peers it names closer."""
        reply = await self.client.ask(peer, Message(type=Message.MessageType.GET_VALUE, key=key.encode()))
        value = reply.record.value if reply.HasField("record") and reply.record.value else None
        return (value if value is not None and self._valid(key, value) else None), list(reply.closerPeers)

    async def put(self, key: str, value: bytes) -> int:
        """Store `value` here and at the k closest peers a walk towards `key` finds; returns how many
        peers took it (a peer's validator may refuse it, e.g. when it holds a newer one)."""
        self.dht.validator.validate(key, value)
        self.store_local(key, value)
        return await self.store_at(await self.find_closest(key), key, value)

    async def find_closest(self, key: str) -> list[ID]:
        """The k peers closest to a record key (a GET_VALUE walk: no record key goes in a FIND_NODE)."""
        async def ask(peer: bytes) -> list[Message.Peer]:
            return (await self._get_value(ID(peer), key))[1]

        lookup = await self._walk(key_point(key.encode()), ask)
        return [ID(p) for p in lookup.result()]

    async def store_at(self, peers: list[ID], key: str, value: bytes, on_rtt=None, keep: bool = False) -> int:
        """PUT_VALUE at each peer (concurrently, each under the query deadline); returns the count
        stored; `on_rtt(peer_id, seconds)` hears each answered round trip. With `keep` (a record
        republished to the same peers), streams stay open for the next time, to these peers only."""
        stored = 0
        if keep:
            await self.client.close_kept(set(peers))

        async def one(peer: ID) -> None:
            nonlocal stored
            request = Message(type=Message.MessageType.PUT_VALUE, key=key.encode())
            request.record.key, request.record.value = key.encode(), value
            t0 = trio.current_time()
            try:
                reply = await self.client.ask(peer, request, keep=keep)
            except Exception:
                return
            if on_rtt is not None:
                on_rtt(peer.to_base58(), trio.current_time() - t0)
            stored += reply.type == Message.MessageType.PUT_VALUE and reply.key == key.encode()

        async with trio.open_nursery() as nursery:
            for peer in peers:
                if peer.to_bytes() != self.me:
                    nursery.start_soon(one, peer)
        return stored

    def store_local(self, key: str, value: bytes) -> None:
        """Keep our own copy; py-libp2p would republish a key it marks local with a FIND_NODE of the
        record key, so the mark is taken off (meshd republishes its records itself)."""
        self.dht.value_store.put(key.encode(), value)
        self.dht.value_store.local_keys.discard(key.encode())

    async def find_peers(self, peer: ID) -> list[ID]:
        """The k peers closest to `peer` (FIND_NODE walk); joining nodes look themselves up to fill
        their routing table and to be known by the peers closest to them."""
        lookup = await self._walk(peer_point(peer.to_bytes()), self._find_node_asker(peer.to_bytes()))
        return [ID(p) for p in lookup.result()]

    async def refresh_table(self) -> None:
        """Kademlia's upkeep: look ourselves up (the peers closest to us learn of us, we of them),
        then a random point, so buckets far from us are filled too."""
        await self.find_peers(self.host.get_id())
        key = os.urandom(32)
        await self._walk(key_point(key), self._find_node_asker(key))

    def _find_node_asker(self, key: bytes):
        async def ask(p: bytes) -> list[Message.Peer]:
            reply = await self.client.ask(ID(p), Message(type=Message.MessageType.FIND_NODE, key=key))
            return list(reply.closerPeers)
        return ask

    async def _walk(self, target: int, ask, enough=None) -> Lookup:
        """Run a lookup to its end, to `enough(lookup)`, or to the walk deadline."""
        seeds = {p.to_bytes() for p in self.dht.routing_table.get_peer_ids()}
        seeds |= {p.to_bytes() for p in self.host.get_connected_peers()}
        lookup = Lookup(target, seeds, k=self.k, alpha=self.alpha, exclude=[self.me])
        changed = trio.Event()

        async def query(peer: bytes) -> None:
            try:
                closer = await ask(peer)
            except trio.TooSlowError:  # busy or frozen: not asked again in this walk, kept in the table
                lookup.fail(peer)
            except Exception:  # refused or unreachable: out of the table, as the spec asks (back when heard from)
                lookup.fail(peer)
                self.dht.routing_table.remove_peer(ID(peer))
            else:
                lookup.answer(peer, self._learn(closer))
                await self._remember(ID(peer))
            changed.set()

        with trio.move_on_after(self.walk_timeout):
            async with trio.open_nursery() as nursery:
                while not lookup.done and not (enough and enough(lookup)):
                    for peer in lookup.next_queries():
                        nursery.start_soon(query, peer)
                    await changed.wait()
                    changed = trio.Event()
                nursery.cancel_scope.cancel()
        return lookup

    def _learn(self, peers: list[Message.Peer]) -> list[bytes]:
        """Ids of the peers an answer named; their addresses go to the peerstore so they can be dialled."""
        out = []
        store = self.host.get_peerstore()
        for p in peers:
            try:
                pid = ID(p.id)
                addrs = [multiaddr.Multiaddr(a) for a in p.addrs]
            except Exception:  # a malformed entry is skipped, the rest of the answer still counts
                continue
            if addrs and pid.to_bytes() != self.me:
                store.add_addrs(pid, addrs, ADDR_TTL)
            out.append(pid.to_bytes())
        return out

    async def _remember(self, peer: ID) -> None:
        """A peer that answered a Kademlia question serves the DHT: keep it in the routing table."""
        try:
            with trio.move_on_after(self.query_timeout):
                await self.dht.routing_table.add_peer(peer, skip_server_mode_check=True)
        except Exception:
            pass

    def _valid(self, key: str, value: bytes) -> bool:
        try:
            self.dht.validator.validate(key, value)
            return True
        except Exception:
            return False
