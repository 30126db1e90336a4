"""A private daemon's choice of relays as pure functions of made-up records: which peers are
candidates (`relay_candidates`), and in what order they are tried (`choose_relays`)."""

from dataclasses import replace

from meshd.dht.record import CoverageRecord
from meshd.relay.client import RelayCandidate, choose_relays, relay_candidates

NOW = 1_000_000.0
ME = "12D3KooWMe"


def record(peer: str, **fields) -> CoverageRecord:
    base = CoverageRecord(peer_id=peer, addrs=(f"/ip4/10.0.0.1/tcp/1/p2p/{peer}",), model="m", recipe="r",
                          start=0, end=1, n_layers=30, expires_at=NOW + 8, relay=True)
    return replace(base, **fields)


def test_candidates_are_live_relays_other_than_me_with_their_round_trip():
    records = [record("A"), record("B", relay=False), record("C", leaving=True), record("D", expires_at=NOW),
               record(ME), record("E", addrs=())]
    got = relay_candidates(records, {"A": 0.01, "B": 0.001}, ME, NOW)
    assert got == [RelayCandidate("A", records[0].addrs, 0.01), RelayCandidate("E", (), None)]


def test_a_record_expiring_later_is_still_a_candidate():
    assert [c.peer_id for c in relay_candidates([record("A", expires_at=NOW + 0.001)], {}, ME, NOW)] == ["A"]


def cand(peer: str, rtt=None, addrs=("/ip4/10.0.0.1/tcp/1",)) -> RelayCandidate:
    return RelayCandidate(peer, addrs, rtt)


def test_relays_are_tried_nearest_first_then_unmeasured_by_peer_id():
    cands = [cand("Z"), cand("far", 0.3), cand("A"), cand("near", 0.002), cand("mid", 0.05)]
    assert choose_relays(cands, set(), {}, NOW, want=2) == ["near", "mid", "far", "A", "Z"]


def test_held_backed_off_and_addressless_relays_are_left_out():
    cands = [cand("held", 0.001), cand("waiting", 0.002), cand("due", 0.003), cand("noaddr", 0.004, addrs=())]
    backoff = {"waiting": NOW + 5, "due": NOW}  # a backoff ending now is over
    assert choose_relays(cands, {"held"}, backoff, NOW, want=2) == ["due"]


def test_nothing_to_try_once_enough_are_held():
    cands = [cand("a", 0.001), cand("b", 0.002)]
    assert choose_relays(cands, {"x", "y"}, {}, NOW, want=2) == []
    assert choose_relays(cands, {"x"}, {}, NOW, want=1) == []
    assert choose_relays(cands, set(), {}, NOW, want=0) == []
    assert choose_relays([], set(), {}, NOW, want=3) == []
