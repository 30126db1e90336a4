"""The decisions the redesign made pure (issue 19), with made-up inputs: no daemons, no sockets.

The entry's retry and busy loop, the route fallback, which entry takes a handed-off request, the
rebalancer's hysteresis, admission, the lifecycle table, a generation's limits, and the reroute of
a generation that began before its daemon moved."""

from types import SimpleNamespace

import pytest

from meshd.dht.moves import Move, Persistence
from meshd.entry.errors import GenerationError, HopFailed
from meshd.entry.policy import Retries, choose_entry
from meshd.entry.route import NoRoute, plan_around
from meshd.entry.state import Generation
from meshd.hop.admission import Capacity
from meshd.node.lifecycle import BadMove, Lifecycle, State
from meshd.testing.fakes import (FakeArtifact, FakeConfig, FakeDialer, FakeMesh, FakeService, FakeShard, coverage,
                                 record)
from meshd.wire import ErrorCode


# --- the retry and busy policy ------------------------------------------------------------------

def test_a_failed_hop_is_excluded_and_the_third_failure_ends_the_generation():
    r = Retries(deadline=30.0)
    r.after_failure(HopFailed("A", "reset"))
    r.after_failure(HopFailed("B", "reset"))
    assert r.failed == {"A", "B"} and r.reroutes == 2 and r.epoch == 2
    with pytest.raises(GenerationError) as ended:
        r.after_failure(HopFailed("C", "reset"))
    assert ended.value.code == ErrorCode.HOP_FAILED and "C" not in r.failed


def test_a_hop_that_cannot_be_retried_ends_the_generation_at_once():
    with pytest.raises(GenerationError, match="bad"):
        Retries(deadline=30.0).after_failure(HopFailed("A", "bad frame", retriable=False))


def test_a_busy_hop_costs_no_attempt_and_is_forgiven_at_the_next_wait():
    r = Retries(deadline=30.0)
    for _ in range(5):  # busy hops never use up the attempts
        r.after_failure(HopFailed("A", "full", busy_s=0.2))
    assert r.failures == 0 and r.busy == {"A"} and r.epoch == 5
    wait = r.after_refusal(GenerationError(ErrorCode.NO_ROUTE, "only A covers 5:10"), now=10.0)
    assert 0 < wait <= 0.5 and r.busy == set() and r.epoch == 6


def test_a_full_mesh_is_waited_on_until_the_deadline_then_reported_busy():
    r = Retries(deadline=30.0, busy_wait_s=30.0)
    assert r.after_refusal(GenerationError(ErrorCode.BUSY, "own layers full"), now=29.8) == pytest.approx(0.2)
    with pytest.raises(GenerationError) as busy:
        r.after_refusal(GenerationError(ErrorCode.BUSY, "own layers full"), now=30.0)
    assert busy.value.code == ErrorCode.BUSY and "mesh busy" in str(busy.value)


def test_no_route_without_busy_hops_is_not_waited_on():
    with pytest.raises(GenerationError) as gone:
        Retries(deadline=30.0).after_refusal(GenerationError(ErrorCode.NO_ROUTE, "layers 5:10"), now=0.0)
    assert gone.value.code == ErrorCode.NO_ROUTE



def test_no_route_refreshes_the_view_once_then_fails():
    r = Retries(deadline=30.0)
    no_route = GenerationError(ErrorCode.NO_ROUTE, "layers 5:10")
    assert r.look_again(no_route, set(), now=0.0) == 0.0  # a record may not have reached this view: look again
    assert r.look_again(no_route, set(), now=0.0) is None  # once only: then it is not waited on
    with pytest.raises(GenerationError):
        r.after_refusal(no_route, now=0.0)
    full = Retries(deadline=30.0, busy={"A"})  # full hops are waited on instead, not refreshed for
    assert full.look_again(no_route, set(), now=0.0) is None
    assert Retries(deadline=30.0).look_again(GenerationError(ErrorCode.BUSY, "own layers full"), set(), 0.0) is None


def test_no_route_while_a_lapsed_record_served_the_layers_is_waited_on_for_one_ttl():
    no_route = GenerationError(ErrorCode.NO_ROUTE, "layers 10:20")
    r = Retries(deadline=30.0, lapse_wait_s=9.0)
    assert r.look_again(no_route, {"B"}, now=100.0) == 1.0  # B's republish came late: look again in 1 s
    assert r.look_again(no_route, {"B"}, now=108.5) == 0.5  # the window counts from the first wait
    assert r.look_again(no_route, {"B"}, now=109.0) == 0.0  # a TTL later B is gone: the one refresh left
    assert r.look_again(no_route, {"B"}, now=110.0) is None  # then it fails
    assert Retries(deadline=30.0).look_again(no_route, set(), now=0.0) == 0.0  # nobody lapsed: no wait
    # B failed this generation and its record lapsed: a relay it was reached through may have died
    # (its pushes ran through it too) while B moves to another; waited for as long
    failed = Retries(deadline=30.0, failed={"B"}, lapse_wait_s=9.0)
    assert failed.look_again(no_route, {"B"}, now=0.0) == 1.0
    assert failed.look_again(no_route, {"B"}, now=9.0) == 0.0  # a TTL later it is dead: the one refresh
    assert failed.look_again(no_route, {"B"}, now=9.5) is None
    assert Retries(deadline=30.0, busy={"A"}).look_again(no_route, {"B"}, now=0.0) is None  # busy: waited on
    assert Retries(deadline=30.0).look_again(GenerationError(ErrorCode.BUSY, "full"), {"B"}, now=0.0) is None


# --- the route fallback -------------------------------------------------------------------------

def test_a_route_avoids_failed_and_busy_hops_while_others_cover_their_layers():
    cov = coverage(record("me", 0, 10), record("A", 10, 30), record("B", 10, 30), record("C", 10, 30))
    route, retried = plan_around(cov, 10, {}, "me", failed={"A"}, busy={"B"})
    assert [h.peer_id for h in route.hops] == ["C"] and not retried


def test_the_only_server_of_some_layers_is_tried_again_after_failing_but_never_while_busy():
    cov = coverage(record("me", 0, 10), record("A", 10, 30))
    route, retried = plan_around(cov, 10, {}, "me", failed={"A"})
    assert [h.peer_id for h in route.hops] == ["A"] and retried
    with pytest.raises(NoRoute):
        plan_around(cov, 10, {}, "me", busy={"A"})


# --- handing a request to another entry ---------------------------------------------------------

def test_an_entry_with_room_is_chosen_over_a_nearer_full_one_then_the_nearest_with_load_priced_in():
    near_full = record("E1", 0, 10, free_sessions=0)
    far = record("E2", 0, 10, free_sessions=4, load=0.0)
    nearer_loaded = record("E3", 0, 10, free_sessions=2, load=0.9)
    lat = {"E1": 0.001, "E2": 0.040, "E3": 0.020}
    assert choose_entry([near_full, far, nearer_loaded], lat, "me").peer_id == "E2"  # 0.040 < 0.020 + 0.09
    assert choose_entry([near_full, far, nearer_loaded], {**lat, "E2": 0.2}, "me").peer_id == "E3"  # 0.2 > 0.11
    assert choose_entry([near_full], lat, "me").peer_id == "E1"  # full beats none: it may have room by then


def test_no_entry_is_this_daemon_a_leaving_one_one_tried_or_one_without_layer_0():
    recs = [record("me", 0, 10, free_sessions=9), record("L", 0, 10, leaving=True, free_sessions=9),
            record("T", 0, 10, free_sessions=9), record("M", 10, 30, free_sessions=9),
            record("N", 0, 10, serving=False, free_sessions=9)]
    assert choose_entry(recs, {}, "me", exclude={"T"}) is None
    assert choose_entry(recs, {}, "me").peer_id == "T"


# --- the rebalancer's hysteresis ----------------------------------------------------------------

def test_a_move_is_made_only_after_the_same_target_persisted_for_the_rounds_and_the_ttl():
    move = Move("me", 12, 22, (22, 30), "gap [22, 30)")
    p = Persistence(rounds=3, min_s=8.0)
    assert [p.observe(move, t) for t in (0.0, 2.0, 4.0, 6.0)] == [None] * 4  # 3 rounds, but not 8 s yet
    assert p.observe(move, 8.0) is move


def test_a_gap_that_closes_or_moves_starts_the_count_again():
    gap = Move("me", 12, 22, (22, 30), "gap")
    other = Move("me", 12, 22, (0, 10), "gap")
    p = Persistence(rounds=3, min_s=0.0)
    assert p.observe(gap, 0) is None and p.observe(gap, 1) is None
    assert p.observe(None, 2) is None  # the record lapsed for a moment and is back
    assert p.observe(gap, 3) is None and p.observe(other, 4) is None and p.observe(other, 5) is None
    assert p.observe(other, 6) is other


# --- admission ----------------------------------------------------------------------------------

def test_admission_and_free_capacity_come_from_the_same_numbers():
    cap = Capacity(sessions=2, max_sessions=4, promised=600, budget=1000)
    assert cap.refusal(400) is None and cap.free_sessions(200) == 2  # room for 2 of 200 bytes
    assert "KV budget" in cap.refusal(401) and cap.free_sessions(401) == 0
    full = Capacity(sessions=4, max_sessions=4, promised=0, budget=1000)
    assert "its limit" in full.refusal(1) and full.free_sessions(1) == 0
    over = Capacity(sessions=1, max_sessions=4, promised=1200, budget=1000)  # a smaller budget after a restart
    assert over.refusal(0) is not None and over.free_sessions(10) == 0


# --- the lifecycle ------------------------------------------------------------------------------

def test_the_lifecycle_goes_only_where_its_table_allows_and_answers_for_each_state():
    life = Lifecycle()
    assert life.stops_at_once and not life.accepts_generations
    life.to(State.CHOOSING)
    assert not life.range_known
    life.to(State.LOADING)
    life.to(State.SERVING)
    assert life.takes_new_work and life.accepts_generations and not life.is_leaving
    assert life.to(State.DRAINING, "meshctl drain") and not life.to(State.DRAINING)
    assert life.accepts_generations and not life.takes_new_work and life.is_leaving and life.reason == "meshctl drain"
    with pytest.raises(BadMove):
        life.to(State.SERVING)  # a draining daemon never serves again
    life.to(State.STOPPING)
    assert str(life) == "stopping" and not life.accepts_generations


# --- a generation's limits ----------------------------------------------------------------------

def test_a_generation_is_cut_to_the_context_and_ends_on_a_stop_token_or_its_limit():
    with pytest.raises(GenerationError) as long:
        Generation.start([1] * 10, 5, max_positions=10)
    assert long.value.code == ErrorCode.BAD_FRAME
    gen = Generation.start([1] * 6, 100, max_positions=10, stop=frozenset({2}))
    assert gen.max_tokens == 4 and gen.max_length == 10
    assert not gen.accept(7) and not gen.accept(8) and gen.accept(2) and gen.done
    assert gen.stats()["tokens"] == 3 and gen.stats()["prompt_tokens"] == 6
    capped = Generation.start([1], 2, max_positions=10)
    assert not capped.accept(5) and capped.accept(5)


# --- a reroute after a move ---------------------------------------------------------------------

def head_slot(end: int):
    from meshd.node.slot import Slot

    return Slot(shard=FakeShard(0, end), tokenizer=None, service=FakeService(f"service 0:{end}"), throughput=100.0)


def test_a_generation_begun_before_a_move_reroutes_from_the_layers_it_began_on():
    """The daemon moved from [0, 10) to [0, 20) while a generation ran on [0, 10): its reroute must
    plan [10, 30) on the old slot's service, not [20, 30) against a shard it never opened."""
    from meshd.core.compute import ComputeExecutor
    from meshd.node.daemon import Daemon
    from meshd.core.settings import Settings

    d = Daemon(Settings(), ComputeExecutor())
    d.artifact = FakeArtifact(config=FakeConfig(max_positions=64, eos_id=2), fingerprint="m")
    d.recipe_fp = "r"
    d.dialer = FakeDialer()  # the reroute plans; nothing is dialled
    d.mesh = FakeMesh(record("me", 0, 10), coverage(record("me", 0, 10), record("A", 10, 20), record("B", 10, 30),
                                                   record("C", 20, 30)))
    assert d.switch_to(head_slot(10)) is None
    running = d.entry  # the generation's entry
    old = d.switch_to(head_slot(20))
    assert old.shard.end == 10 and d.entry is not running and d.entry.end == 20
    route = running.plan(failed={"A"}, busy=set())  # a hop failed after the move
    assert [(h.peer_id, h.start) for h in route.hops] == [("B", 10)]
    assert running.service is old.service and d.entry.service is d.slot.service
    assert [(h.peer_id, h.start) for h in d.entry.plan(set(), set()).hops][0][1] == 20


# --- the gather wait --------------------------------------------------------------------------

def test_frames_of_one_tail_pass_are_awaited_until_all_came_or_their_time_is_up():
    from meshd.hop.due import DueFrames

    due = DueFrames(wait_s=0.008)
    due.expect("a", now=0.0, group=("tail", 7), size=3)  # the first of three tokens of pass 7 came home
    assert due.awaited(0.001)
    due.arrived("a")  # its frame is here; two more tokens of the pass are still out
    assert due.awaited(0.002)
    due.expect("b", now=0.003, group=("tail", 7), size=3)
    due.arrived("b")
    assert due.awaited(0.004)
    due.expect("c", now=0.005, group=("tail", 7), size=3)  # the last token: the group is complete
    due.arrived("c")
    assert not due.awaited(0.006)
    due.expect("d", now=1.0, group=("tail", 8), size=2)
    due.arrived("d")
    assert due.awaited(1.007) and not due.awaited(1.008)  # the other token never came: not waited past 8 ms


# --- handing a request to another entry, over memory channels -----------------------------------

async def test_a_request_passes_over_entries_that_fail_before_any_text_and_not_after():
    """The first entry refuses (its record lagged: it stopped), the second is unreachable, the third
    answers: the client gets the third's text and stats. Once text has flowed, a failure is final."""
    import trio
    import trio.testing

    from meshd.entry.handoff import hand_off
    from meshd.entry.policy import choose_entry
    from meshd.p2p.channel import Channel
    from meshd.wire import GenerateRequest, StreamEvent

    entries = [record(f"E{i}", 0, 10, free_sessions=4) for i in range(3)]
    latency = {"E0": 0.001, "E1": 0.002, "E2": 0.003}
    scripts = {"E0": [StreamEvent(request_id=1, kind="error", text="draining", stats={"code": "busy"})],
               "E2": [StreamEvent(request_id=1, kind="text", text="Paris"),
                      StreamEvent(request_id=1, kind="done", stats={"tokens": 1})]}
    asked = []

    async def open_stream(peer, addrs, protocol):
        asked.append(peer)
        if peer not in scripts:
            raise ConnectionError("no route to host")
        ours, theirs = trio.testing.memory_stream_pair()
        remote = Channel.over_trio(theirs)

        async def serve():
            await remote.receive(5)  # the request
            for event in scripts[peer]:
                await remote.send(event)

        nursery.start_soon(serve)
        return SimpleNamespace(read=ours.receive_some, write=ours.send_all, close=ours.aclose)

    got = []

    async def emit(event):
        got.append(event.text)

    req = GenerateRequest(request_id=1, prompt="The capital of France is", max_tokens=4)
    choose = lambda tried: choose_entry(entries, latency, "me", tried)  # noqa: E731
    async with trio.open_nursery() as nursery:
        stats = await hand_off(req, emit, choose, open_stream)
    assert asked == ["E0", "E1", "E2"] and got == ["Paris"]
    assert stats == {"tokens": 1, "forwarded_to": "E2"}

    scripts["E0"] = [StreamEvent(request_id=1, kind="text", text="Par"),
                     StreamEvent(request_id=1, kind="error", text="hop failed", stats={"code": "hop_failed"})]
    asked.clear()
    got.clear()
    async with trio.open_nursery() as nursery:
        with pytest.raises(GenerationError, match="hop failed"):
            await hand_off(req, emit, choose, open_stream)
    assert asked == ["E0"] and got == ["Par"]  # text had reached the client: no other entry is asked
