"""Signed records through a real Kademlia DHT (py-libp2p hosts on loopback, in one process):
meshd's walker asks, py-libp2p's KadDHT answers with meshd's validator."""

import logging
import time
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.tools.anyio_service import background_trio_service

from meshd.dht.kad import MeshDHT
from meshd.dht.record import CoverageRecord, open_record, record_key, sign_record
from meshd.p2p.host import connect, full_addrs, open_host


async def open_dht_nodes(stack: AsyncExitStack, n: int):
    nodes = []
    for _ in range(n):
        kp = create_new_key_pair()
        host = await stack.enter_async_context(open_host(kp, ["/ip4/127.0.0.1/tcp/0"]))
        dht = MeshDHT(host)
        await stack.enter_async_context(background_trio_service(dht))
        nodes.append((kp, host, dht))
    boot = full_addrs(nodes[0][1])[0]
    for kp, host, dht in nodes[1:]:
        pid = await connect(host, boot)
        await dht.add_peer(pid)
        await nodes[0][2].add_peer(host.get_id())
    for _, host, dht in nodes:
        await dht.walker.find_peers(host.get_id())
    return nodes


def make_record(host, seq, ttl=30.0):
    pid = host.get_id().to_base58()
    return CoverageRecord(peer_id=pid, addrs=tuple(full_addrs(host)), model="m", recipe="r", start=0, end=10,
                          n_layers=30, seq=seq, expires_at=time.time() + ttl)


async def fresh_get(dht, key):
    dht.value_store.remove(key.encode())
    return await dht.walker.get(key)


@pytest.mark.trio
async def test_records_propagate_forgeries_and_rollbacks_do_not(caplog):
    caplog.set_level(logging.WARNING, logger="libp2p")
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            (kp0, h0, d0), (kp1, h1, d1), (kp2, h2, d2) = await open_dht_nodes(stack, 3)
            key = record_key(h1.get_id().to_base58())
            v1 = sign_record(make_record(h1, seq=1), kp1.private_key)
            assert await d1.walker.put(key, v1) == 2
            assert open_record(await fresh_get(d2, key)).seq == 1
            # the owner's update propagates (py-libp2p's default validator would keep the first value)
            v2 = sign_record(make_record(h1, seq=2), kp1.private_key)
            assert await d1.walker.put(key, v2) == 2
            assert open_record(await fresh_get(d2, key)).seq == 2
            # node 2 forges node 1's record: its own store refuses, and a direct store at node 0 is refused
            forged = sign_record(make_record(h1, seq=9), kp2.private_key)
            with pytest.raises(ValueError, match="another key"):
                await d2.walker.put(key, forged)
            assert await d2.walker.store_at([h0.get_id()], key, forged) == 0
            assert open_record(d0.value_store.get(key.encode()).value).seq == 2
            # an older sequence number does not replace a newer one
            assert await d2.walker.store_at([h0.get_id()], key, v1) == 0
            assert open_record(d0.value_store.get(key.encode()).value).seq == 2
            # an expired record is refused by the network
            expired = sign_record(make_record(h1, seq=3, ttl=-1), kp1.private_key)
            assert await d1.walker.store_at([h0.get_id()], key, expired) == 0
            assert open_record(d0.value_store.get(key.encode()).value).seq == 2
    # no record key went where a peer id belongs (py-libp2p warns of each one it receives)
    assert not [r for r in caplog.records if "is not a valid PeerId" in r.getMessage()]
