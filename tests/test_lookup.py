"""Kademlia walks as a pure state machine, over made-up networks (no sockets)."""

import random

from meshd.dht.lookup import Lookup, closest, key_point, peer_point


def make_network(n: int, k: int, seed: int = 0):
    """n peers, each with a Kademlia routing table: up to k random peers per bucket (shared prefix length)."""
    rng = random.Random(seed)
    peers = [bytes(rng.getrandbits(8) for _ in range(34)) for _ in range(n)]
    tables = {}
    for p in peers:
        buckets: dict[int, list[bytes]] = {}
        for q in peers:
            if q != p:
                buckets.setdefault((peer_point(p) ^ peer_point(q)).bit_length(), []).append(q)
        tables[p] = [q for b in buckets.values() for q in rng.sample(b, min(k, len(b)))]
    return peers, tables


def walk(lookup: Lookup, tables, dead=frozenset(), max_steps=10_000):
    """Drive a lookup to its end, answering each query from the asked peer's table."""
    asked, peak = 0, 0
    for _ in range(max_steps):
        if lookup.done:
            return asked, peak
        batch = lookup.next_queries()
        peak = max(peak, len(lookup.waiting))
        assert batch or lookup.waiting, "a walk that is not done must have something to ask"
        for p in batch:
            asked += 1
            if p in dead:
                lookup.fail(p)
            else:
                lookup.answer(p, closest(lookup.target, tables[p], lookup.k))
    raise AssertionError("walk did not end")


def test_distance_is_xor_of_sha256_points_and_closest_sorts_by_it():
    a, b = b"\x00\x01", b"\x00\x02"
    assert peer_point(a) == key_point(a) and peer_point(a) != peer_point(b)
    target = key_point(b"/meshd/x")
    ranked = closest(target, [a, b, a], k=5)
    assert sorted(ranked) == sorted([a, b]) and len(ranked) == 2
    assert (peer_point(ranked[0]) ^ target) <= (peer_point(ranked[1]) ^ target)
    assert closest(target, [a, b], k=1) == ranked[:1]


def test_walks_from_three_seeds_find_the_true_k_closest_with_few_queries():
    peers, tables = make_network(400, k=8)
    rng = random.Random(1)
    for i in range(40):
        me = rng.choice(peers)
        target = key_point(f"/meshd/record-{i}".encode())
        lookup = Lookup(target, rng.sample(tables[me], 3), k=8, alpha=3, exclude=[me])
        asked, peak = walk(lookup, tables)
        truth = closest(target, [p for p in peers if p != me], 8)
        assert lookup.result() == truth
        assert peak <= 3 and asked < 80  # about log2(400) rounds of alpha, far below asking everyone


def test_dead_peers_fail_and_the_walk_routes_around_them():
    peers, tables = make_network(300, k=8, seed=2)
    rng = random.Random(3)
    dead = frozenset(rng.sample(peers, 60))
    live = [p for p in peers if p not in dead]
    for i in range(20):
        me = rng.choice(live)
        target = key_point(f"key-{i}".encode())
        lookup = Lookup(target, tables[me][:5], k=8, exclude=[me])
        walk(lookup, tables, dead)
        result = lookup.result()
        assert not set(result) & dead and len(result) == 8
        truth = closest(target, [p for p in live if p != me], 8)
        assert len(set(result) & set(truth)) >= 7  # a dead peer can hide a live one behind it, rarely


def test_a_walk_without_peers_is_done_at_once_and_never_asks_itself():
    assert Lookup(key_point(b"k")).done
    me = b"me-bytes-of-a-peer"
    lookup = Lookup(key_point(b"k"), [me], exclude=[me])
    assert lookup.done and lookup.next_queries() == [] and lookup.result() == []


def test_a_peer_named_again_is_not_asked_twice_and_an_answer_keeps_the_walk_open_until_the_front_answered():
    a, b, c = b"peer-a", b"peer-b", b"peer-c"
    lookup = Lookup(key_point(b"k"), [a], k=2, alpha=1)
    assert lookup.next_queries() == [a] and lookup.next_queries() == []  # alpha=1: one in flight
    assert not lookup.done
    lookup.answer(a, [a, b, c])
    asked = lookup.next_queries()
    assert len(asked) == 1 and asked[0] in (b, c)
    lookup.answer(asked[0], [a])
    # the front is the 2 closest of {a, b, c}: done only once both of them answered
    front = closest(lookup.target, [a, b, c], 2)
    while not lookup.done:
        for p in lookup.next_queries():
            lookup.answer(p)
    assert set(front) <= lookup.answered and lookup.result() == front


def test_a_get_settles_only_once_the_peers_closer_than_its_quorum_answered():
    """Stale copies far from the key (a replay stored everywhere) must not end a get before the
    peers closest to the key, which hold the newest copy, were asked."""
    peers, tables = make_network(200, k=8, seed=4)
    target = key_point(b"/meshd/replayed")
    ranked = closest(target, peers, len(peers))
    far, near = ranked[-3:], ranked[:5]
    lookup = Lookup(target, far, k=8, alpha=3)
    for p in lookup.next_queries():
        lookup.answer(p, near)
    holders = set(far)  # every far peer answered with a (stale) value
    assert sum(p in holders for p in lookup.front()) == 3  # three front peers hold one...
    assert not lookup.settled(holders, 3)  # ...but five peers closer than them were not asked yet
    rng = random.Random(5)
    for i in range(40):
        me = rng.choice(peers)
        target = key_point(f"/meshd/record-{i}".encode())
        truth = closest(target, [p for p in peers if p != me], 8)
        lookup = Lookup(target, rng.sample(tables[me], 3), k=8, alpha=3, exclude=[me])
        while not lookup.settled(lookup.answered, 3):  # every peer holds some copy
            batch = lookup.next_queries()
            assert batch or lookup.waiting
            for p in batch:
                lookup.answer(p, closest(target, tables[p], 8))
        assert set(truth[:3]) <= lookup.answered  # the newest copy, at the closest peers, was read
