"""A 64-node DHT of real libp2p hosts (Noise, Yamux, 127.0.0.1) in one trio run, no model.

Each node dials 3 random earlier nodes and looks itself up; records are found by Kademlia walks
only. Checked: every node finds every record; a record whose owner vanished is gone within its
TTL; a flood of forged records (foreign signer, broken signature, wrong key, replayed older
sequence) changes nothing. Lookup rate and success rate are printed (`pytest -s`).
"""

import random
import time

import msgpack
import pytest
import trio

from meshd.dht.record import open_record
from meshd.testing.dhtnet import open_swarm, run_all

N_NODES = 64
K_SWARM = 8  # replication and walk width: a record lives at 8 of 64 nodes, so lookups must walk
N_OWNERS = 6  # nodes that publish a live record (the rest only route and store)
N_VANISH = 2  # owners that publish a short-lived record, then leave
N_ATTACKED = 2  # owners whose records the attacker forges, at every node
TTL_S, SHORT_TTL_S = 120.0, 10.0
LIMIT = 6  # operations in flight at once: one process shares this machine's cores among 64 nodes


async def get_all(nodes, keys, limit=LIMIT):
    """Every node looks every key up; returns {(node index, key): value or None} and the seconds taken."""
    jobs = [(i, k) for i, n in enumerate(nodes) for k in keys if k != n.key]
    t0 = time.perf_counter()
    values = await run_all([lambda i=i, k=k: nodes[i].walker.get(k) for i, k in jobs], limit)
    return dict(zip(jobs, values)), time.perf_counter() - t0


def tampered(value: bytes, **changes) -> bytes:
    """The owner's signed value with its payload edited and the owner's old signature kept."""
    payload, pub, sig = msgpack.unpackb(value, raw=False)
    fields = {**msgpack.unpackb(payload, raw=False), **changes}
    return msgpack.packb([msgpack.packb(fields, use_bin_type=True), pub, sig], use_bin_type=True)


@pytest.mark.trio
async def test_64_nodes_find_every_record_forget_vanished_ones_and_ignore_forgeries():
    rng = random.Random(11)
    with trio.fail_after(170):
        t0 = time.perf_counter()
        async with open_swarm(N_NODES, degree=3, seed=11, k=K_SWARM) as nodes:
            t_join = time.perf_counter() - t0
            picked = rng.sample(range(N_NODES), N_OWNERS + N_VANISH + 1)
            owners = [nodes[i] for i in picked[:N_OWNERS]]
            leaving = [nodes[i] for i in picked[N_OWNERS:-1]]
            attacker = nodes[picked[-1]]

            # the leaving owners publish short-lived records, are found, then vanish without a word
            short = {n.key: n.signed(1, SHORT_TTL_S) for n in leaving}
            await run_all([lambda n=n: n.walker.put(n.key, short[n.key]) for n in leaving], LIMIT)
            expires = time.time() + SHORT_TTL_S
            askers = rng.sample([n for n in nodes if n.key not in short], 8)
            seen, _ = await get_all(askers, list(short))
            missed = [(i, k) for (i, k), v in seen.items() if v != short[k]]
            assert not missed, f"short-lived records not found right after their put: {missed}"
            for n in leaving:
                await n.leave()

            # live owners publish twice (seq 1, then seq 2): only seq 2 may be found
            old = {n.key: n.signed(1, TTL_S) for n in owners}
            new = {n.key: n.signed(2, TTL_S) for n in owners}
            stored = await run_all([lambda n=n: n.walker.put(n.key, old[n.key]) for n in owners], LIMIT)
            stored += await run_all([lambda n=n: n.walker.put(n.key, new[n.key]) for n in owners], LIMIT)
            assert min(stored) >= K_SWARM // 2, stored  # each put reached most of its key's k closest peers

            live = [n for n in nodes if all(n is not m for m in leaving)]
            found, seconds = await get_all(live, list(new))
            ok = sum(v == new[k] for (_, k), v in found.items())
            print(f"\n{N_NODES} nodes joined in {t_join:.1f} s; {len(found)} lookups in {seconds:.1f} s "
                  f"({len(found) / seconds:.1f}/s), {ok / len(found):.1%} found the newest record")
            assert ok == len(found)

            # a flood of forgeries at every node: each is refused (stores 0), or, for a replay of an
            # older record, taken only where no newer one is held; lookups still find the newest
            others = [n.host.get_id() for n in live if n is not attacker]
            attacked = owners[:N_ATTACKED]
            for owner in attacked:
                key = owner.key
                foreign = attacker.signed(9, TTL_S, peer_id=owner.peer_id)  # owner's record, attacker's key
                broken = tampered(new[key], seq=9, start=5, end=6)  # owner's signature over other bytes
                wrong_key = attacker.signed(9, TTL_S)  # a valid record, of another peer
                for forged in (foreign, broken, wrong_key):
                    assert await attacker.walker.store_at(others, key, forged) == 0
                await attacker.walker.store_at(others, key, old[key])
            after, _ = await get_all(live, [n.key for n in attacked])
            stale = {(i, k): v and open_record(v).seq for (i, k), v in after.items() if v != new[k]}
            assert not stale, f"lookups after the forgeries that missed the newest record (seq found): {stale}"

            # the vanished owners' records are gone once their TTL has passed
            await trio.sleep(max(0.0, expires - time.time()))
            gone, _ = await get_all(rng.sample(live, 8), list(short))
            kept = [ik for ik, v in gone.items() if v is not None]
            assert not kept, f"vanished owners' records still found past their TTL: {kept}"
