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


def test_a_peer_whose_hole_punches_all_failed_is_tried_again_after_a_doubling_backoff(monkeypatch):
    import trio
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol

    from meshd.relay.punch import HolePuncher, retry_backoff

    assert [retry_backoff(None), retry_backoff(10.0), retry_backoff(400.0)] == [10.0, 20.0, 600.0]
    outcomes = iter([False, False, True])

    async def punched(self, peer_id):  # py-libp2p's three attempts: twice nothing gets through, then it does
        if self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS:
            return False  # spent: it tries nothing
        self._hole_punch_attempts[peer_id] = MAX_HOLE_PUNCH_ATTEMPTS
        return next(outcomes)

    async def no_direct(peer_id):
        return False

    monkeypatch.setattr(DCUtRProtocol, "initiate_hole_punch", punched)
    peer, clock = ID.from_base58("12D3KooWRmE5HVNqYU5Krd63qg39gZHpPLY5Kw9BZJAqKHvN2a2h"), [100.0]
    p = HolePuncher.__new__(HolePuncher)  # no host: only the bookkeeping runs
    p.attempts = p.upgraded = p.failed = p.retries = 0
    p.seconds, p._retry, p._hole_punch_attempts, p._in_progress = [], {}, {}, set()
    p.clock, p._have_direct_connection = lambda: clock[0], no_direct
    assert trio.run(p.initiate_hole_punch, peer) is False
    assert p.failed == 1 and p._retry[peer] == (110.0, 10.0)
    assert p.renew_due(109.9) == [] and p._hole_punch_attempts[peer] == MAX_HOLE_PUNCH_ATTEMPTS
    assert p.renew_due(110.0) == [peer] and peer not in p._hole_punch_attempts and p.retries == 1
    assert p.renew_due(111.0) == []  # renewed once a backoff
    clock[0] = 111.0
    assert trio.run(p.initiate_hole_punch, peer) is False
    assert p._retry[peer] == (131.0, 20.0)  # the next wait is twice as long
    assert trio.run(p.initiate_hole_punch, peer) is False and p.attempts == 2  # spent: nothing tried, not counted
    clock[0] = 131.0
    assert p.renew_due(131.0) == [peer]
    assert trio.run(p.initiate_hole_punch, peer) is True  # this one gets through: the backoff is forgotten
    assert p.upgraded == 1 and p.attempts == 3 and peer not in p._retry
    assert p.summary()["retries"] == 2
