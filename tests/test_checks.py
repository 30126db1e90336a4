"""Checked generations' pure decisions (meshd/entry/checks.py): which generations are checked, the
second route around the first one's daemons, which layers stay unchecked, who is blamed when two
routes disagree, and how long an excluded peer stays off routes (a made-up clock)."""

import pytest
import trio
import trio.testing

from meshd.entry.checks import (EXCLUDE_S, Check, Exclusions, check_rate, chosen, differing_peers, settle,
                                unchecked_layers)
from meshd.entry.route import plan_route
from meshd.testing.fakes import coverage, record

E = ["E", 0, 10]


def test_a_request_that_asks_is_checked_and_the_rate_draws_the_others():
    assert chosen(0.0, requested=True)
    assert not chosen(0.0, requested=False, draw=0.0)
    assert chosen(0.05, requested=False, draw=0.049) and not chosen(0.05, requested=False, draw=0.05)
    assert chosen(1.0, requested=False, draw=0.999)
    drawn = sum(chosen(0.05, requested=False) for _ in range(20000))
    assert 800 < drawn < 1200  # 1 in 20 (binomial sd ~31)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "x", None, True, float("nan")])
def test_a_bad_verify_rate_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="--verify-rate"):
        check_rate(bad)
    assert check_rate(0) == 0.0 and check_rate(0.05) == 0.05


def test_the_second_route_takes_other_daemons_where_there_are_replicas_and_says_which_layers_are_unchecked():
    cov = coverage(record("E", 0, 10), record("A", 10, 20), record("B", 10, 20), record("T", 20, 30))
    first = plan_route(cov, 10, exclude={"E"})
    second = plan_route(cov, 10, exclude={"E"}, avoid={h.peer_id for h in first.hops})
    a = [E] + first.describe()
    b = [E] + second.describe()
    assert {first.hops[0].peer_id, second.hops[0].peer_id} == {"A", "B"}
    assert first.hops[1].peer_id == second.hops[1].peer_id == "T"  # no replica of 20:30: the same daemon
    assert unchecked_layers(a, b, start=10) == [[20, 30]]
    assert differing_peers(a, b) == {"A", "B"}


def test_a_second_route_with_nothing_to_compare_differs_nowhere():
    cov = coverage(record("E", 0, 10), record("A", 10, 30))
    first = plan_route(cov, 10, exclude={"E"})
    second = plan_route(cov, 10, exclude={"E"}, avoid={"A"})
    a, b = [E] + first.describe(), [E] + second.describe()
    assert a == b and not differing_peers(a, b) and unchecked_layers(a, b, 10) == [[10, 30]]


def test_avoiding_costs_only_where_another_daemon_serves_the_layers():
    """No one else serves 20:30: the second route still runs 10:20 on B and enters A at 20 only."""
    cov = coverage(record("E", 0, 10), record("A", 10, 30), record("B", 10, 20))
    second = plan_route(cov, 10, exclude={"E"}, avoid={"A"})
    assert second.describe() == [["B", 10, 20], ["A", 20, 30]]
    assert unchecked_layers([E, ["A", 10, 30]], [E] + second.describe(), 10) == [[20, 30]]
    cov = coverage(record("E", 0, 10), record("A", 10, 30), record("B", 10, 20), record("C", 20, 30))
    assert plan_route(cov, 10, exclude={"E"}, avoid={"A"}).describe() == [["B", 10, 20], ["C", 20, 30]]


def test_the_liar_is_the_one_the_other_two_routes_route_around():
    a = [E, ["H1", 10, 20], ["T", 20, 30]]
    b = [E, ["L", 10, 20], ["T", 20, 30]]
    c = [E, ["H2", 10, 20], ["T", 20, 30]]
    v = settle((a, b), (7, 9), c, 7)
    assert v.winner == 0 and v.suspects == {"L"}  # the shared tail is never blamed
    v = settle((b, a), (9, 7), c, 7)
    assert v.winner == 1 and v.suspects == {"L"}
    assert settle((a, b), (7, 9), c, 8).winner is None


def test_a_route_that_loses_on_two_ranges_blames_only_hops_no_other_route_ran():
    a = [E, ["H1", 10, 20], ["T1", 20, 30]]
    b = [E, ["L", 10, 20], ["T1", 20, 30]]
    c = [E, ["H2", 10, 20], ["T2", 20, 30]]
    assert settle((a, b), (1, 2), c, 1).suspects == {"L"}  # T1 also ran on the winning route


def test_exclusions_grow_with_repeats_and_end():
    async def main():
        ex = Exclusions()
        first = ex.exclude("L", "wrong", trio.current_time())
        assert ex.active(trio.current_time()) == {"L"} and first.times == 1
        await trio.sleep(EXCLUDE_S - 1)
        assert ex.active(trio.current_time()) == {"L"}
        await trio.sleep(2)
        assert ex.active(trio.current_time()) == set() and ex.listing(trio.current_time()) == []
        second = ex.exclude("L", "wrong again", trio.current_time())  # a repeat soon after: twice as long
        assert second.times == 2 and second.until - trio.current_time() == pytest.approx(2 * EXCLUDE_S)
        third = ex.exclude("L", "and again", trio.current_time())  # while excluded: longer again
        assert third.times == 3 and third.until - trio.current_time() == pytest.approx(4 * EXCLUDE_S)
        row, = ex.listing(trio.current_time())
        assert row["peer"] == "L" and row["reason"] == "and again" and row["times"] == 3
        await trio.sleep(4 * EXCLUDE_S + ex.forget_s + 1)  # clean for a day after it ended: starts over
        assert ex.exclude("L", "new", trio.current_time()).times == 1
        await trio.sleep(ex.max_s * 4)
        ex.prune(trio.current_time())
        assert ex.entries == {}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_exclusion_is_capped():
    ex = Exclusions(base_s=10, max_s=100)
    for _ in range(10):
        e = ex.exclude("L", "x", 0.0)
    assert e.until == 100 and e.times == 10 and ex.total == 10


def test_a_check_reports_unverified_without_a_second_route_or_with_unchecked_layers():
    c = Check()
    assert c.stats()["checked"] is False and c.stats()["verified"] is False and c.agreed is None
    c.second, c.compared = [E, ["B", 10, 30]], 5
    assert c.stats()["verified"] is True and c.agreed is True
    c.unchecked = [[20, 30]]
    assert c.stats()["verified"] is False and c.stats()["unchecked_layers"] == [[20, 30]]
    c.disagreements = 1
    assert c.agreed is False


def test_the_verify_flags_reach_the_request_and_the_settings():
    from meshd.cli.ctl import build_parser as ctl_parser
    from meshd.cli.main import build_parser
    from meshd.core.settings import load_settings
    from meshd.node.wiring import verify_share
    from meshd.wire import Decoder, GenerateRequest, encode

    req = GenerateRequest(request_id=1, prompt="x", verify=True)
    assert Decoder().feed(encode(req)) == [req]
    assert ctl_parser().parse_args(["generate", "--verify", "hi"]).verify
    assert not ctl_parser().parse_args(["generate", "hi"]).verify
    args = build_parser().parse_args(["join", "--verify-rate", "0.5"])
    s = load_settings({"verify_rate": args.verify_rate}, environ={})
    assert verify_share(s) == 0.5 and verify_share(load_settings({}, environ={})) == 0.25
    with pytest.raises(ValueError, match="--verify-rate"):
        verify_share(load_settings({"verify_rate": 2.0}, environ={}))


def test_the_liar_harness_changes_what_it_returns_and_only_from_its_position():
    import torch

    from meshd.testing.liar import lie, liar_wrap

    logits = torch.tensor([0.1, 3.0, 0.2, 0.0])
    assert int(lie(logits, 1.0, tail=True, position=0).argmax()) == 2
    h = torch.ones(1, 2, 8)
    assert not torch.equal(lie(h, 1.0, tail=False, position=5), h)
    assert torch.equal(lie(h, 1.0, tail=False, position=5), lie(h, 1.0, tail=False, position=5))  # replays alike
    assert liar_wrap(from_position=3)[-1] == "--" and "3" in liar_wrap(from_position=3)


def test_a_suspect_is_tried_alone_in_place_of_the_hops_on_its_layers():
    from meshd.entry.checks import swapped

    winner = [E, ["H1", 10, 20], ["T1", 20, 30]]
    assert swapped(winner, ["L", 10, 20]) == [E, ["L", 10, 20], ["T1", 20, 30]]
    assert swapped(winner, ["T2", 20, 30]) == [E, ["H1", 10, 20], ["T2", 20, 30]]
    assert swapped(winner, ["W", 10, 30]) == [E, ["W", 10, 30]]
    assert swapped(winner, ["X", 15, 30]) is None  # no hop of the winner starts at 15


def test_sketches_are_seeded_projections_that_see_a_changed_output():
    import torch

    from meshd.hop import sketch

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, 4, 576, generator=gen)
    s = sketch.sketch(h, 77)
    assert s.shape == (sketch.K,) and torch.equal(s, sketch.sketch(h.clone(), 77))
    assert not torch.equal(s, sketch.sketch(h, 78))  # another seed, other directions
    assert sketch.close(s, sketch.sketch(h * (1 + 1e-7), 77))  # float32 rounding is far inside the tolerance
    wrong = h.clone()
    wrong[0, -1, 5] += 0.5  # one element of the last row, moved by a fraction of the row's spread
    assert not sketch.close(s, sketch.sketch(wrong, 77))
    assert torch.equal(s, sketch.sketch(torch.cat([torch.zeros(1, 1, 576), h[:, -1:]], 1), 77))  # last row only


def test_a_hop_adds_its_sketch_only_when_asked_and_passes_the_others_on():
    import torch

    from meshd.hop import sketch
    from meshd.wire import Tensor

    out = torch.randn(1, 1, 16)
    assert sketch.carried((), out, (0, 10)) == ()
    first = sketch.carried((sketch.request(5),), out, (0, 10))
    second = sketch.carried(first, out * 2, (10, 20))
    got = sketch.read(second)
    assert set(got) == {(0, 10), (10, 20)} and torch.allclose(got[(10, 20)], 2 * got[(0, 10)])
    bad = Tensor.from_torch(sketch.REQUEST, torch.tensor([1.5]))
    assert sketch.carried((bad,), out, (0, 10)) == ()  # a malformed request changes nothing


def test_the_first_boundary_where_sketches_part_and_the_third_route_s_verdict():
    import torch

    from meshd.entry.checks import judge
    from meshd.hop import sketch

    one, two, three = torch.ones(8), torch.full((8,), 2.0), torch.full((8,), 3.0)
    a = {(0, 10): one, (10, 20): two, (20, 30): three}
    b = {(0, 10): one, (10, 20): two + 1, (20, 30): three + 1}
    assert sketch.first_divergence(a, b) == (10, 20)
    assert sketch.first_divergence(a, dict(a)) is None
    assert sketch.first_divergence(a, {(0, 10): one, (10, 30): three + 1}) == (10, 30)  # a route's hop spans two
    ra = [E, ["H1", 10, 20], ["T", 20, 30]]
    rb = [E, ["L", 10, 20], ["T", 20, 30]]
    rc = [E, ["H2", 10, 20], ["T", 20, 30]]
    v = judge((ra, rb), (10, 20), (a, b), rc, {(0, 10): one, (10, 20): two.clone()})
    assert v.winner == 0 and v.suspects == {"L"}
    assert judge((ra, rb), (10, 20), (a, b), rc, {(0, 10): one}) is None  # no sketch there: go by tokens
    assert judge((ra, rb), (10, 20), (a, b), rc, {(10, 20): two + 5}) is None  # matches neither
