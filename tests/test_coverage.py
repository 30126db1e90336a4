"""Signed records, the DHT validator, coverage maps, `--layers auto` and route planning (no network)."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from meshd.dht.coverage import CoverageMap, choose_range
from meshd.dht.record import CoverageRecord, RecordError, best_index, open_record, record_key, sign_record
from meshd.dht.validator import CoverageValidator
from meshd.entry.route import DEFAULT_LATENCY, NoRoute, link_latency, plan_route


def keypair():
    kp = create_new_key_pair()
    return kp, ID.from_pubkey(kp.public_key).to_base58()


def record(pid, start, end, n=30, seq=1, ttl=60.0, model="m", **kw):
    return CoverageRecord(peer_id=pid, addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), model=model, recipe="r",
                          start=start, end=end, n_layers=n, seq=seq, expires_at=time.time() + ttl, **kw)


def test_signed_record_round_trips_and_validates():
    kp, pid = keypair()
    value = sign_record(record(pid, 0, 12), kp.private_key)
    assert open_record(value, key=record_key(pid)).end == 12
    CoverageValidator().validate(record_key(pid), value)


def test_record_signed_by_another_key_is_refused():
    kp, pid = keypair()
    other, _ = keypair()
    forged = sign_record(record(pid, 0, 12), other.private_key)
    with pytest.raises(RecordError, match="another key"):
        open_record(forged)
    with pytest.raises(ValueError):
        CoverageValidator().validate(record_key(pid), forged)
    # and a valid record stored under someone else's key is refused too
    _, pid2 = keypair()
    with pytest.raises(RecordError, match="wrong key"):
        open_record(sign_record(record(pid, 0, 12), kp.private_key), key=record_key(pid2))


def test_tampered_and_garbage_records_are_refused():
    kp, pid = keypair()
    value = bytearray(sign_record(record(pid, 0, 12), kp.private_key))
    value[10] ^= 0xFF
    with pytest.raises(RecordError):
        open_record(bytes(value))
    for junk in (b"", b"\x00" * 10, b"\x93\x01\x02\x03"):
        with pytest.raises(RecordError):
            open_record(junk)


def test_higher_sequence_wins_and_expired_does_not_count():
    kp, pid = keypair()
    old = sign_record(record(pid, 0, 12, seq=1), kp.private_key)
    new = sign_record(record(pid, 0, 12, seq=2), kp.private_key)
    assert best_index([old, new]) == 1 and best_index([new, old]) == 0
    assert CoverageValidator().select(record_key(pid), [old, new]) == 1
    expired = sign_record(record(pid, 0, 12, seq=3, ttl=-1), kp.private_key)
    with pytest.raises(RecordError, match="expired"):
        open_record(expired)
    # an expired newer record still blocks replay of an older one, but a live one beats it
    assert best_index([old, expired]) == 1
    live = sign_record(record(pid, 0, 12, seq=4), kp.private_key)
    assert best_index([expired, live]) == 1
    cov = CoverageMap.build(30, [record(pid, 0, 12, ttl=-1)])
    assert cov.counts() == [0] * 30


def test_coverage_counts_and_gaps():
    cov = CoverageMap.build(30, [record("a", 0, 12), record("b", 10, 20), record("c", 25, 30),
                                 record("d", 0, 30, model="other")], model="m")
    assert cov.counts()[:13] == [1] * 10 + [2, 2, 1]
    assert cov.gaps() == [(20, 25)]
    assert not cov.complete
    # only the newest record of a peer counts
    cov = CoverageMap.build(30, [record("a", 0, 10, seq=1), record("a", 5, 30, seq=2)])
    assert cov.counts() == [0] * 5 + [1] * 25 and cov.gaps() == [(0, 5)]


def test_choose_range_fills_the_largest_gap_first():
    assert choose_range(CoverageMap.build(30, []), 10) == (0, 10)
    assert choose_range(CoverageMap.build(30, [record("a", 0, 12)]), 10) == (12, 22)
    cov = CoverageMap.build(30, [record("a", 0, 12), record("b", 12, 22)])
    assert choose_range(cov, 10) == (22, 30)  # the gap [22, 30) is short: take exactly it
    full = CoverageMap.build(30, [record("a", 0, 12), record("b", 12, 22), record("c", 20, 30)])
    assert choose_range(full, 10) == (0, 10)  # redundancy to the least-served window, earliest
    assert choose_range(full, 100) == (0, 30)
    largest = CoverageMap.build(30, [record("a", 3, 10), record("b", 12, 20)])
    assert choose_range(largest, 4) == (20, 24)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 29), st.integers(1, 30)), max_size=6), st.integers(1, 30))
def test_auto_choice_never_leaves_a_fillable_gap_unfilled(spans, want):
    recs = [record(f"p{i}", min(a, b - 1), max(a + 1, b)) for i, (a, b) in enumerate(spans)]
    cov = CoverageMap.build(30, recs)
    a, b = choose_range(cov, want)
    assert 0 <= a < b <= 30 and b - a <= want
    if cov.gaps():  # inside the largest gap, overlapping nobody
        assert any(g0 <= a and b <= g1 for g0, g1 in cov.gaps())
        assert all(c == 0 for c in cov.counts()[a:b])
        assert b - a == min(want, max(g1 - g0 for g0, g1 in cov.gaps()))
    else:
        assert b - a == min(want, 30)


def test_route_prefers_fast_short_chains_and_enters_mid_range():
    cov = CoverageMap.build(30, [record("a", 0, 10), record("b", 10, 20), record("c", 20, 30),
                                 record("big", 5, 30, throughput=10000.0)])
    route = plan_route(cov, 10)
    assert [(h.peer_id, h.start, h.end) for h in route.hops] == [("big", 10, 30)]
    slow = {"big": 5.0}
    route = plan_route(cov, 10, latency=slow)
    assert [(h.peer_id, h.start, h.end) for h in route.hops] == [("b", 10, 20), ("c", 20, 30)]
    with pytest.raises(NoRoute, match=r"layers \[10, 20\)"):
        plan_route(cov, 10, exclude={"big", "b"})
    assert plan_route(cov, 30).hops == ()


def test_a_relayed_hop_is_priced_by_its_latency_and_a_direct_peer_covering_the_same_layers_wins():
    circuit = lambda relay, pid: f"/ip4/198.18.0.10/tcp/4690/p2p/{relay}/p2p-circuit/p2p/{pid}"  # noqa: E731
    relayed = record("h", 10, 30, throughput=2000.0, relay_addrs=(circuit("R", "h"),))
    direct = record("d", 10, 30, throughput=2000.0)
    relay = record("R", 0, 0)
    cov = CoverageMap.build(30, [record("a", 0, 10), relayed, direct, relay])
    # nothing measured: the relayed peer counts both legs, so the direct one is chosen
    links = link_latency(cov.records, {})
    assert links("h") == 2 * DEFAULT_LATENCY and links("d") == DEFAULT_LATENCY
    assert [h.peer_id for h in plan_route(cov, 10, latency=links).hops] == ["d"]
    # a malformed circuit address in a peer's record names no relay: priced as unmeasured, no error
    odd = record("o", 10, 30, relay_addrs=("/p2p-circuit/garbage",))
    assert link_latency([odd], {"R": 0.03})("o") == pytest.approx(0.06)  # twice the slowest measured link
    # the relay measured at 30 ms, nothing else: its peers are priced at both legs, 60 ms
    assert link_latency(cov.records, {"R": 0.03})("h") == pytest.approx(0.06)
    # a peer never measured is priced at the slowest measured link, not below it: a peer measured (a
    # record pull on a loaded box) must not look slower than an unknown one
    links = link_latency(cov.records, {"a": 0.010, "R": 0.030, "d": 0.020})
    assert links("never") == pytest.approx(0.030) and links("h") == pytest.approx(0.030 + 0.030)
    # CI's case: a fast-claiming tail measured at 44.7 ms, an honest one at 20.8, two never measured; the
    # claim of speed decides between the measured slow peer and the unmeasured ones
    tails = [record(p, 20, 30, throughput=t) for p, t in (("liar", 1e7), ("honest", 3296.6), ("u1", 918.9),
                                                           ("u2", 3296.6))]
    tail_cov = CoverageMap.build(30, [record("a", 0, 20), *tails])
    tail_links = link_latency(tail_cov.records, {"liar": 0.0447, "honest": 0.0208})
    assert tail_links("u1") == tail_links("liar")
    assert plan_route(tail_cov, 20, latency=tail_links).hops[0].peer_id == "honest"
    assert plan_route(tail_cov, 20, latency=tail_links, exclude={"honest"}).hops[0].peer_id == "liar"
    # measured round trips win over estimates, whichever way they point
    links = link_latency(cov.records, {"h": 0.004, "d": 0.050})
    assert [h.peer_id for h in plan_route(cov, 10, latency=links).hops] == ["h"]
    # the route's hop carries the circuit address after the direct ones, for the dialler
    [hop] = plan_route(cov, 10, latency=link_latency(cov.records, {"d": 1.0, "R": 0.01, "h": 0.02})).hops
    assert hop.peer_id == "h" and hop.addrs == relayed.addrs + relayed.relay_addrs


def test_a_relay_only_record_serves_no_layers():
    kp, pid = keypair()
    rec = record(pid, 0, 0, relay=True)
    assert open_record(sign_record(rec, kp.private_key)) == rec  # "none": a valid record
    for bad in ((5, 5), (3, 2)):
        with pytest.raises(RecordError, match="bad range"):
            open_record(sign_record(record(pid, *bad), kp.private_key))
    cov = CoverageMap.build(30, [rec, record("a", 0, 30)])
    assert cov.counts() == [1] * 30 and cov.complete


def test_no_route_names_every_gap():
    cov = CoverageMap.build(30, [record("a", 0, 10), record("c", 15, 20)])
    with pytest.raises(NoRoute) as err:
        plan_route(cov, 10)
    assert err.value.missing == [(10, 15), (20, 30)]


def test_route_over_hundreds_of_peers_is_optimal_and_quick():
    rng = random.Random(7)
    recs = []
    for i in range(400):
        a = rng.randrange(0, 30)
        b = min(30, a + rng.randint(1, 10))
        recs.append(record(f"p{i:03d}", a, b, throughput=rng.uniform(50, 2000)))
    cov = CoverageMap.build(30, recs)
    lat = {r.peer_id: rng.uniform(0.001, 0.05) for r in recs}
    priced = []

    def link(peer: str) -> float:
        priced.append(peer)
        return lat[peer]

    t0 = time.perf_counter()
    route = plan_route(cov, 0, latency=link)
    print(f"planned over {len(recs)} peers in {time.perf_counter() - t0:.3f} s")
    # the bound on complexity: each record is priced at most once for each layer it covers (no walk over chains)
    assert len(priced) <= sum(r.end - r.start for r in recs)
    assert route.hops[0].start == 0 and route.hops[-1].end == 30
    assert all(x.end == y.start for x, y in zip(route.hops, route.hops[1:]))
    # brute-force check on the same graph: no chain of up to 4 hops is cheaper
    by_peer = {r.peer_id: r for r in recs}

    def cost(hops):
        return sum((h.end - h.start) / by_peer[h.peer_id].throughput + lat[h.peer_id] for h in hops)

    assert abs(cost(route.hops) - route.cost_s) < 1e-9
    best = [float("inf")]

    def search(a, acc, depth):
        if a == 30:
            best[0] = min(best[0], acc)
            return
        if depth == 0 or acc >= best[0]:
            return
        for r in recs:
            if r.start <= a < r.end:
                search(r.end, acc + (r.end - a) / r.throughput + lat[r.peer_id], depth - 1)

    search(0, 0.0, len(route.hops))
    assert route.cost_s <= best[0] + 1e-9
