"""Lightweight DHT nodes for tests and benches: real libp2p hosts (Noise, Yamux) on 127.0.0.1,
each with py-libp2p's KadDHT answering and meshd's walker asking; no model, no daemon.

Rule: a node is opened with `open_dht_node` and closed by leaving its context, so a test can make an
owner vanish in the middle of a run; every node of a swarm knows only the few peers it dialled.
"""

from __future__ import annotations

import random
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.tools.anyio_service import background_trio_service

from meshd.dht.kad import KadWalker, MeshDHT
from meshd.dht.lookup import K
from meshd.dht.record import CoverageRecord, record_key, sign_record
from meshd.p2p.host import connect, full_addrs, open_host


@dataclass
class DhtNode:
    key_pair: object
    host: object
    dht: MeshDHT

    @property
    def walker(self) -> KadWalker:
        return self.dht.walker

    @property
    def peer_id(self) -> str:
        return self.host.get_id().to_base58()

    @property
    def key(self) -> str:
        return record_key(self.peer_id)

    def record(self, seq: int, ttl: float, **changes) -> CoverageRecord:
        fields = dict(peer_id=self.peer_id, addrs=tuple(full_addrs(self.host)), model="m", recipe="r", start=0,
                      end=1, n_layers=30, seq=seq, expires_at=time.time() + ttl)
        return CoverageRecord(**{**fields, **changes})

    def signed(self, seq: int, ttl: float, **changes) -> bytes:
        return sign_record(self.record(seq, ttl, **changes), self.key_pair.private_key)


@asynccontextmanager
async def open_dht_node(k: int = K) -> AsyncIterator[DhtNode]:
    kp = create_new_key_pair()
    async with open_host(kp, ["/ip4/127.0.0.1/tcp/0"]) as host:
        dht = MeshDHT(host, k=k)
        async with background_trio_service(dht):
            yield DhtNode(kp, host, dht)


async def open_swarm(stack: AsyncExitStack, n: int, degree: int = 3, seed: int = 0,
                     k: int = K) -> list[tuple[DhtNode, AsyncExitStack]]:
    """n nodes, each dialling `degree` random earlier ones and then looking itself up (a Kademlia
    join); returns each node with the stack that closes it."""
    rng = random.Random(seed)
    nodes: list[tuple[DhtNode, AsyncExitStack]] = []
    for _ in range(n):
        own = await stack.enter_async_context(AsyncExitStack())
        node = await own.enter_async_context(open_dht_node(k))
        for boot, _ in rng.sample(nodes, min(degree, len(nodes))):
            pid = await connect(node.host, full_addrs(boot.host)[0])
            await node.dht.add_peer(pid)
        nodes.append((node, own))
    for node, _ in nodes:
        await node.walker.find_peers(node.host.get_id())
    return nodes
