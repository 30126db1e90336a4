"""MeshView over real hosts (Noise, Yamux, 127.0.0.1) in one process: pushed records, quiet rounds,
and a vanished peer's range turning into a gap within its record's TTL."""

import trio

from meshd.dht.view import COVERAGE_INTERVAL, ROUND_TIMEOUT, MeshView
from meshd.testing.dhtnet import open_swarm

TTL_S = 4.0


async def test_pushed_records_make_idle_rounds_silent_and_a_vanished_peer_leaves_within_its_ttl():
    with trio.fail_after(60):
        async with open_swarm(3, degree=2) as nodes:
            views = [MeshView(n.host, n.dht, n.key_pair, n.record(0, TTL_S, start=10 * i, end=10 * i + 10,
                                                                  serving=True), TTL_S) for i, n in enumerate(nodes)]
            for v in views:
                await v.publish()
            for v in views:
                await v.refresh()
            assert all(v.coverage.counts() == [1] * 30 for v in views)

            # republishing pushes to both peers; rounds then read the pushed copies and ask nobody
            asked = [v.walker.queries for v in views]
            for v in views:
                await v.publish()
            assert [v.walker.queries - a for v, a in zip(views, asked)] == [2, 2, 2]
            asked = [v.walker.queries for v in views]
            for _ in range(3):
                for v in views:
                    await v.refresh()
            assert [v.walker.queries for v in views] == asked
            assert all(v.coverage.counts() == [1] * 30 for v in views)

            # the third peer vanishes; the others keep publishing and refreshing
            async with trio.open_nursery() as nursery:
                for v in views[:2]:
                    nursery.start_soon(v.publish_loop)
                    nursery.start_soon(v.coverage_loop)
                await nodes[2].leave()
                with trio.fail_after(TTL_S + COVERAGE_INTERVAL + ROUND_TIMEOUT):
                    while not all(v.coverage.gaps() == [(20, 30)] for v in views[:2]):
                        await trio.sleep(0.1)
                assert all(v.coverage.counts()[:20] == [1] * 20 for v in views[:2])
                # a lapsed record is remembered for a TTL (a late republish is waited for; see below)
                for v in views[:2]:
                    await v.refresh()
                assert all(v.lapsed_serving(10) == {nodes[2].peer_id} and v.lapsed_serving(30) == set()
                           for v in views[:2])
                nursery.cancel_scope.cancel()


async def test_a_connected_peer_whose_record_lapsed_is_waited_for_until_it_republishes():
    with trio.fail_after(60):
        async with open_swarm(2, degree=1) as nodes:
            # a's own record outlives the test (a republishes nothing here); b's lapses after TTL_S
            a, b = (MeshView(n.host, n.dht, n.key_pair, n.record(0, ttl, start=10 * i, end=10 * i + 10, serving=True),
                             TTL_S) for i, (n, ttl) in enumerate(zip(nodes, (60.0, TTL_S))))
            await b.publish()
            await a.refresh()
            assert a.coverage.gaps() == [(20, 30)] and a.lapsed_serving(10) == set()
            # b stays connected but does not republish (a loaded box, a late timer): its record lapses
            with trio.fail_after(TTL_S + ROUND_TIMEOUT + 2):
                while a.coverage.gaps() != [(10, 30)]:
                    await a.refresh()
                    await trio.sleep(COVERAGE_INTERVAL / 4)
            assert a.lapsed_serving(10) == {b.peer_id}  # live and connected: worth waiting for
            assert a.lapsed_serving(20) == set()  # it never served layers from 20 on
            await b.publish()
            await a.refresh()
            assert a.coverage.gaps() == [(20, 30)] and a.lapsed_serving(10) == set()
