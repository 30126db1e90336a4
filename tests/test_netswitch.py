"""The test bed's latency switch, as pure logic: learning, flooding, delay per link, loss, bounds."""

import random

import pytest

from meshd.testing.netswitch import DelayLine, LinkSpec, MacTable, Switch

A, B, C = (bytes([0x02, 0, 0, 0, 0, i]) for i in (1, 2, 3))
BROADCAST = b"\xff" * 6


def frame(dst: bytes, src: bytes, payload: bytes = b"") -> bytes:
    return dst + src + b"\x08\x00" + payload


def test_unknown_and_broadcast_frames_flood_learnt_ones_go_to_one_port():
    t = MacTable(3)
    assert t.route(0, frame(BROADCAST, A)) == [1, 2]
    assert t.route(1, frame(A, B)) == [0]  # A was learnt from its broadcast
    assert t.route(0, frame(B, A)) == [1]
    assert t.route(0, frame(C, A)) == [1, 2]  # C never spoke: flood
    assert t.route(0, frame(A, A)) == []  # never back out of the port it came in
    assert t.route(0, b"short") == []


def test_delay_line_releases_by_due_time_and_keeps_arrival_order_for_ties():
    line = DelayLine()
    line.push(2.0, 1, b"late")
    line.push(1.0, 0, b"first")
    line.push(1.0, 0, b"second")
    assert line.next_due() == 1.0 and len(line) == 3
    assert line.pop_due(0.5) == []
    assert line.pop_due(1.0) == [(0, b"first"), (0, b"second")]
    assert line.pop_due(5.0) == [(1, b"late")] and line.next_due() is None


def test_a_frame_waits_the_delay_of_both_links_it_crosses():
    sw = Switch([LinkSpec(0.010), LinkSpec(0.030), LinkSpec(0.0)])
    sw.receive(100.0, 0, frame(BROADCAST, A))
    assert sw.wait_s(100.0) == pytest.approx(0.010)  # to port 2: 10 + 0 ms
    assert sw.due(100.0099) == []
    assert sw.due(100.0101) == [(2, frame(BROADCAST, A))]
    assert sw.due(100.0399) == []
    assert sw.due(100.0401) == [(1, frame(BROADCAST, A))]  # to port 1: 10 + 30 ms
    assert sw.wait_s(101.0, idle=1.0) == 1.0


def test_loss_on_either_link_drops_frames_at_about_its_rate():
    sw = Switch([LinkSpec(0, 0.2), LinkSpec(0, 0.0), LinkSpec(0, 0.1)], random.Random(7))
    for i in range(10_000):
        sw.receive(0, 0, frame(BROADCAST, A, b"%d" % i))
    out = sw.due(1.0)
    to_1, to_2 = (sum(port == p for port, _ in out) for p in (1, 2))
    assert 7_700 < to_1 < 8_300  # lost on A's link: 20 %
    assert 6_900 < to_2 < 7_500  # lost on A's or on C's: 1 - 0.8 * 0.9 = 28 %
    assert sw.lost == 20_000 - len(out) and sw.delivered == len(out)
    lossless = Switch([LinkSpec(0), LinkSpec(0)])
    for i in range(1000):
        lossless.receive(0, 0, frame(BROADCAST, A))
    assert len(lossless.due(0)) == 1000 and lossless.lost == 0


def test_a_full_switch_drops_instead_of_growing():
    sw = Switch([LinkSpec(1.0), LinkSpec(1.0)], max_queued=5)
    for _ in range(8):
        sw.receive(0, 0, frame(BROADCAST, A))
    assert len(sw.line) == 5 and sw.dropped == 3


@pytest.mark.parametrize("text,spec", [("20", LinkSpec(0.02, 0.0)), ("0", LinkSpec()), ("35:0.05", LinkSpec(0.035, 0.05))])
def test_link_specs_parse(text, spec):
    assert LinkSpec.parse(text) == spec


@pytest.mark.parametrize("text", ["-1", "10:1.5", "x"])
def test_bad_link_specs_are_refused(text):
    with pytest.raises(ValueError):
        LinkSpec.parse(text)
