"""`--layers auto`'s first range (`place_span`), as changed after the simulator (docs/simulator.md)
showed small gaps taken exactly leaving a churning swarm short of its capacity: a gap shorter than
what a node wants comes with the least-served layers around it, and everything else is as before."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.dht.coverage import CoverageMap, choose_range
from meshd.dht.placement import place_span, widen
from meshd.dht.record import CoverageRecord

LAYER = 1000


def rec(pid, start, end, n=30):
    return CoverageRecord(peer_id=pid, addrs=(), model="m", recipe="r", start=start, end=end, n_layers=n,
                          expires_at=time.time() + 60, serving=True, auto_layers=10)


def cov(*records, n=30):
    return CoverageMap.build(n, records)


def size(a, b):
    return (b - a) * LAYER


def test_a_short_gap_comes_with_the_least_served_layers_around_it():
    # [0, 12) fixed, [12, 22) auto: the gap [22, 30) is 8 long; a node of 10 takes [20, 30)
    assert place_span(cov(rec("a", 0, 12), rec("b", 12, 22)), 10, None, size) == (20, 30)
    # a gap in the middle: of the windows holding [10, 14), the one over the thinner side
    thin_right = cov(rec("a", 0, 10), rec("a2", 0, 10), rec("b", 14, 30))
    assert place_span(thin_right, 8, None, size) == (10, 18)
    thin_left = cov(rec("a", 0, 10), rec("b", 14, 30), rec("b2", 14, 30))
    assert place_span(thin_left, 8, None, size) == (6, 14)


def test_memory_that_cannot_hold_the_window_with_the_whole_gap_takes_the_gap_alone():
    coverage = cov(rec("a", 0, 12), rec("b", 12, 22))
    # the window [20, 30) cut from its end to 9 layers would drop layer 29 of the gap: the gap alone
    assert place_span(coverage, 10, 9 * LAYER, size) == (22, 30)
    assert place_span(coverage, 10, 10 * LAYER, size) == (20, 30)


def test_a_gap_as_long_as_wanted_and_a_full_map_are_placed_as_before():
    assert place_span(cov(rec("a", 0, 10)), 10, None, size) == choose_range(cov(rec("a", 0, 10)), 10) == (10, 20)
    full = cov(rec("a", 0, 15), rec("b", 15, 30), rec("c", 0, 10))
    assert place_span(full, 10, None, size) == choose_range(full, 10)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), data=st.data())
def test_the_range_always_holds_the_largest_gap_and_is_never_longer_than_wanted(n, data):
    spans = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, n)), max_size=6))
    coverage = CoverageMap(n, tuple(rec(f"p{i}", a, min(n, a + w), n=n) for i, (a, w) in enumerate(spans)))
    want = data.draw(st.integers(1, n))
    a, b = place_span(coverage, want, None, size)
    g0, g1 = choose_range(coverage, want)
    assert 0 <= a <= g0 < g1 <= b <= n and b - a == max(g1 - g0, min(want, n))
    assert widen(coverage, g0, g1, want) == (a, b)
