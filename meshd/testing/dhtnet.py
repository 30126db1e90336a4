"""Lightweight DHT nodes for tests and benches: real libp2p hosts (Noise, Yamux) on 127.0.0.1,
each with py-libp2p's KadDHT answering and meshd's walker asking; no model, no daemon.

Rule: every node of a swarm runs as its own task, so a test can make one vanish (`leave`) in the
middle of a run; every node of a swarm knows only the few peers it dialled, then what its walks teach it.
"""

from __future__ import annotations

import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

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
    _scope: trio.CancelScope | None = None
    _closed: trio.Event = field(default_factory=trio.Event)

    async def leave(self) -> None:
        """Vanish without a word: the host closes, its connections drop."""
        self._scope.cancel()
        await self._closed.wait()

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


@asynccontextmanager
async def open_swarm(n: int, degree: int = 3, seed: int = 0, k: int = K) -> AsyncIterator[list[DhtNode]]:
    """n nodes joining one after another: each dials `degree` random earlier ones, then looks itself
    up (a Kademlia join)."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        nodes: list[DhtNode] = []
        for _ in range(n):
            node = await nursery.start(_serve_node, k)
            for boot in rng.sample(nodes, min(degree, len(nodes))):
                pid = await connect(node.host, full_addrs(boot.host)[0])
                await node.dht.add_peer(pid)
            await node.walker.find_peers(node.host.get_id())
            nodes.append(node)
        yield nodes
        nursery.cancel_scope.cancel()


async def _serve_node(k: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        try:
            async with open_dht_node(k) as node:
                node._scope = scope
                task_status.started(node)
                await trio.sleep_forever()
        finally:
            if "node" in locals():
                node._closed.set()


async def run_all(jobs, limit: int) -> list:
    """Await each of `jobs` (zero-argument async callables), at most `limit` at a time; results in order."""
    results: list = [None] * len(jobs)
    limiter = trio.CapacityLimiter(limit)

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await jobs[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(one, i)
    return results
