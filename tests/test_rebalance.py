"""The rebalancing policy (no network): simultaneous joins converge, gaps heal, nothing flaps,
and no move takes the last server off a layer."""

import random
import time
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.dht.coverage import CoverageMap, choose_range
from meshd.dht.moves import own_move, plan_moves, target
from meshd.dht.record import CoverageRecord, best_index, first_seq, sign_record
from meshd.testing.fakes import FakeDaemon, FakeMesh


def rec(pid, start, end, auto=10, serving=True, n=30):
    return CoverageRecord(peer_id=pid, addrs=(), model="m", recipe="r", start=start, end=end, n_layers=n,
                          expires_at=time.time() + 60, serving=serving, auto_layers=auto)


def cov(*records, n=30):
    return CoverageMap.build(n, records)


def apply(coverage: CoverageMap) -> tuple[CoverageMap, int]:
    """One round: every peer applies its own line of the plan it computed (all see the same map)."""
    moves = {m.peer_id: m.to for m in plan_moves(coverage)}
    records = [replace(r, start=moves[r.peer_id][0], end=moves[r.peer_id][1]) if r.peer_id in moves else r
               for r in coverage.records]
    return CoverageMap.build(coverage.n_layers, records), len(moves)


def settle(coverage: CoverageMap, rounds: int = 10) -> tuple[CoverageMap, int]:
    for i in range(rounds):
        coverage, moved = apply(coverage)
        if not moved:
            return coverage, i
    raise AssertionError(f"still moving after {rounds} rounds: {coverage.counts()}")


def test_two_daemons_that_took_the_same_gap_split_and_the_higher_id_moves():
    both = cov(rec("fixed", 0, 12, auto=0), rec("pA", 12, 22, serving=False), rec("pB", 12, 22, serving=False))
    assert both.gaps() == [(22, 30)]
    moves = plan_moves(both)
    assert [(m.peer_id, m.to, m.reason) for m in moves] == [("pB", (22, 30), "gap [22, 30)")]
    assert own_move(both, "pA") is None and own_move(both, "pB").to == (22, 30)
    assert own_move(both, "fixed") is None  # `--layers A:B` daemons never move
    healed, rounds = settle(both)
    assert healed.complete and rounds == 1


def test_a_claim_moves_before_a_loaded_server():
    # a daemon that has only claimed its range moves for free; a loaded one would load again
    m = plan_moves(cov(rec("fixed", 0, 10, auto=0), rec("zz-serving", 10, 20), rec("aa-claim", 10, 20, serving=False)))
    assert [x.peer_id for x in m] == ["aa-claim"]


def test_never_drops_the_last_server_of_a_layer():
    # b's layers 15:20 have no other server: b stays although a gap exists
    c = cov(rec("a", 0, 15), rec("b", 10, 20), rec("c", 0, 10))
    assert c.gaps() == [(20, 30)]
    assert target(c, next(r for r in c.records if r.peer_id == "b"), 10) is None
    moves = plan_moves(c)
    assert all(m.peer_id != "b" for m in moves)
    after, _ = settle(c)
    assert min(after.counts()[:20]) >= 1  # nothing that was served is lost


def test_a_steady_mesh_does_not_move():
    even = cov(rec("a", 0, 10), rec("b", 10, 20), rec("c", 20, 30), rec("d", 0, 10), rec("e", 10, 20),
               rec("f", 20, 30))
    assert plan_moves(even) == []
    # one layer more or less is not worth a reload
    near = cov(rec("a", 0, 10), rec("b", 10, 20), rec("c", 20, 30), rec("d", 0, 10), rec("e", 10, 20))
    assert plan_moves(near) == []


def test_far_more_servers_on_some_layers_moves_one_over():
    lop = cov(rec("a", 0, 10), rec("b", 10, 20), rec("c", 20, 30), rec("d", 10, 20), rec("e", 10, 20))
    moves = plan_moves(lop)
    assert len(moves) == 1 and moves[0].to in ((0, 10), (20, 30)) and moves[0].reason.startswith("balance")
    after, _ = settle(lop)
    assert sorted(after.counts()) == [1] * 10 + [2] * 20


def test_a_killed_daemon_leaves_a_gap_a_redundant_one_fills():
    six = [rec("a", 0, 10), rec("b", 10, 20), rec("c", 20, 30), rec("d", 0, 10), rec("e", 10, 20), rec("f", 20, 30)]
    two_dead = cov(*[r for r in six if r.peer_id not in ("c", "f")])
    assert two_dead.gaps() == [(20, 30)]
    moves = plan_moves(two_dead)
    assert len(moves) == 1 and moves[0].to == (20, 30) and moves[0].reason == "gap [20, 30)"
    healed, _ = settle(two_dead)
    assert healed.complete and max(healed.counts()) == 2


def test_a_draining_daemon_counts_for_nothing():
    c = cov(rec("a", 0, 10), rec("b", 10, 20), rec("d", 0, 10),
            replace(rec("e", 20, 30, serving=False), leaving=True))
    assert [(m.peer_id, m.to) for m in plan_moves(c)] == [("d", (20, 30))]


def test_cooling_down_peers_are_not_planned():
    c = cov(rec("fixed", 0, 12, auto=0), rec("pA", 12, 22), rec("pB", 12, 22, auto=0))
    assert [m.peer_id for m in plan_moves(c)] == ["pA"]  # pB would go first, but it just moved


def joined_together(n_daemons: int, want: int, n_layers: int, seed: int) -> CoverageMap:
    """`n_daemons` joining at once in batches: each batch sees only the daemons before it."""
    rnd = random.Random(seed)
    ids = [f"p{rnd.getrandbits(64):016x}" for _ in range(n_daemons)]
    records: list[CoverageRecord] = []
    while ids:
        batch = [ids.pop() for _ in range(min(len(ids), rnd.randint(1, n_daemons)))]
        seen = CoverageMap.build(n_layers, records)
        for pid in batch:
            a, b = choose_range(seen, want)
            records.append(rec(pid, a, b, auto=want, serving=False, n=n_layers))
    return CoverageMap.build(n_layers, records)


@settings(max_examples=300, deadline=None)
@given(n_daemons=st.integers(1, 16), want=st.integers(1, 12), n_layers=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_simultaneous_joins_converge_to_no_gap_while_memory_suffices(n_daemons, want, n_layers, seed):
    start = joined_together(n_daemons, want, n_layers, seed)
    end, rounds = settle(start, rounds=4 * n_daemons + 4)
    if n_daemons * want >= n_layers + want - 1:  # enough memory, however the ranges fall
        assert end.complete, (start.counts(), end.counts())
    served = [c > 0 for c in start.counts()]
    assert all(c > 0 for c, was in zip(end.counts(), served) if was)  # nothing served was dropped
    assert plan_moves(end) == []  # settled means settled: no flapping


def test_six_joins_of_ten_layers_serve_thirty_layers_twice():
    for seed in range(50):
        end, rounds = settle(joined_together(6, 10, 30, seed))
        assert end.counts() == [2] * 30, (seed, end.counts())
        assert rounds <= 2


async def test_a_serving_daemon_moves_only_after_the_gap_persisted_and_not_again_within_the_cooldown(autojump_clock):
    import trio

    from meshd.dht.rebalancer import Rebalancer

    me = rec("pB", 12, 22)
    gap = cov(rec("fixed", 0, 12, auto=0), rec("pA", 12, 22), me)
    whole = cov(rec("fixed", 0, 12, auto=0), rec("pA", 12, 22), me, rec("pC", 22, 30, auto=0))
    mesh = FakeMesh(me, whole)
    rb = Rebalancer(FakeDaemon(mesh=mesh), want=10)
    moves = []

    async def move(m):  # what the daemon does, minus the loading
        moves.append((trio.current_time(), m.to))
        rb.cooldown_until = trio.current_time() + 60.0
        await mesh.publish(start=m.to[0], end=m.to[1], auto_layers=0)
        mesh.coverage = cov(rec("fixed", 0, 12, auto=0), rec("pA", 12, 22), mesh.record)

    rb.move = move
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rb.run)
        t0 = trio.current_time()
        mesh.coverage = gap  # pC's record lapsed for a moment (it missed a refresh) ...
        await trio.sleep(6.5)
        mesh.coverage = whole  # ... and is back: nobody moved
        await trio.sleep(3)
        assert moves == []
        mesh.coverage = gap  # now for good
        await trio.sleep(30)
        assert [to for _, to in moves] == [(22, 30)]
        assert moves[0][0] - (t0 + 9.5) >= mesh.ttl_s  # the gap lasted a record TTL first
        # the mesh changes again at once: within the cooldown it stays where it is
        mesh.coverage = cov(rec("fixed", 0, 12, auto=0), rec("pA", 22, 30), mesh.record)
        await trio.sleep(50)
        assert len(moves) == 1
        nursery.cancel_scope.cancel()


def test_a_restarted_daemon_s_records_beat_those_of_its_previous_run():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    kp = create_new_key_pair()
    pid = ID.from_pubkey(kp.public_key).to_base58()
    t0 = time.time() - 120
    # the previous run published for a minute (a few hundred times), then withdrew
    withdrawn = replace(rec(pid, 0, 10, serving=False), seq=first_seq(t0) + 500, expires_at=time.time() - 1)
    restarted = replace(rec(pid, 0, 10), seq=first_seq() + 1)
    values = [sign_record(withdrawn, kp.private_key), sign_record(restarted, kp.private_key)]
    assert best_index(values) == 1
    assert best_index([sign_record(replace(restarted, seq=1), kp.private_key), values[0]]) == 1  # counting from 0 lost
