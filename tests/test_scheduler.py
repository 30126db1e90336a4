"""The batching scheduler with made-up outputs: which work shares a pass, in what order, within what bounds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.hop.scheduler import QueueFull, Scheduler


def run(sched, batch):
    """Pretend to compute: every piece's output names it."""
    return sched.update_from_output(batch, [(w.key, w.payload) for w in batch])


def test_decode_steps_of_all_sessions_share_one_pass():
    s = Scheduler()
    for k in range(8):
        s.submit(k, 1, True, "step0")
    batch = s.schedule()
    assert sorted(w.key for w in batch) == list(range(8))
    assert s.schedule() == []  # every session is running: nothing else may start
    done = run(s, batch)
    assert all(w.done and w.output == (w.key, "step0") for w in done)
    assert s.stats.as_dict()["mean_batch"] == 8 and s.stats.largest == 8


def test_a_session_runs_its_work_in_order_one_piece_a_pass():
    s = Scheduler()
    s.submit("a", 128, False, 0)
    s.submit("a", 128, False, 1)
    s.submit("a", 1, True, 2)
    order = []
    while s.waiting():
        batch = s.schedule()
        assert len(batch) == 1
        order += [w.payload for w in run(s, batch)]
    assert order == [0, 1, 2]


def test_prefill_rides_along_with_decodes_under_the_budget():
    s = Scheduler(token_budget=256, max_batch=64)
    for k in range(10):
        s.submit(("dec", k), 1, True)
    for k in range(4):
        s.submit(("pre", k), 128, False)
    batch = s.schedule()
    decodes = [w for w in batch if w.decode]
    prefills = [w for w in batch if not w.decode]
    assert len(decodes) == 10
    assert [w.key for w in prefills] == [("pre", 0), ("pre", 1)]  # 256 rows of chunks, in arrival order


def test_a_speculative_step_rides_with_the_decodes_and_its_drafts_count_against_the_budget():
    """A step of k + 1 rows is a decode piece: never held back behind prefill, and never holding
    another session's decode back; its k extra rows leave less room for prefill chunks."""
    s = Scheduler(token_budget=256, max_batch=64)
    s.submit("plain", 1, True)
    s.submit("spec", 9, True)
    for k in range(2):
        s.submit(("pre", k), 128, False)
    batch = s.schedule()
    assert {w.key for w in batch} == {"plain", "spec", ("pre", 0)}  # 256 - 8 rows: one chunk fits, not two
    assert s.stats.rows == 1 + 9 + 128


def test_one_prefill_chunk_always_gets_in():
    s = Scheduler(token_budget=16, max_batch=4)
    s.submit("long", 128, False)
    for k in range(3):
        s.submit(k, 1, True)
    batch = s.schedule()
    assert {w.key for w in batch} == {0, 1, 2, "long"}


def test_decode_steps_first_when_the_batch_is_full():
    s = Scheduler(max_batch=3)
    s.submit("p", 10, False)
    for k in range(5):
        s.submit(k, 1, True)
    assert [w.key for w in s.schedule()] == [0, 1, 2]


def test_full_queue_refuses_at_once():
    s = Scheduler(max_queued=3)
    for k in range(3):
        s.submit(k, 1, True)
    with pytest.raises(QueueFull):
        s.submit(9, 1, True)
    assert s.stats.refused == 1
    run(s, s.schedule())
    s.submit(9, 1, True)  # room again once work ran


def test_cancel_and_withdraw_drop_waiting_work_only():
    s = Scheduler()
    a0 = s.submit("a", 1, True)
    a1 = s.submit("a", 1, True)
    b0 = s.submit("b", 1, True)
    batch = s.schedule()
    assert set(batch) == {a0, b0}
    assert not s.withdraw(a0)  # already running
    assert s.withdraw(a1) and s.queued == 0
    s.submit("b", 1, True)
    assert len(s.cancel("b")) == 1 and s.queued == 0
    run(s, batch)
    assert s.waiting() == 0


def test_a_pass_takes_one_microbatch_the_one_that_waited_longest():
    s = Scheduler()
    for k in range(6):  # sessions 0, 2, 4 in microbatch 1 (session 1's step came first), 1, 3, 5 in microbatch 0
        s.submit(k, 1, True, "step", microbatch=(k + 1) % 2)
    first = s.schedule()
    assert sorted(w.key for w in first) == [0, 2, 4]
    second = s.schedule()  # the other microbatch runs while the first one's pass is out
    assert sorted(w.key for w in second) == [1, 3, 5]
    s.submit(1, 1, True, "again", microbatch=0)  # session 1's next step waits behind its running one
    run(s, first)
    s.submit(0, 1, True, "again", microbatch=1)
    assert [w.key for w in s.schedule()] == [0]  # microbatch 0's session 1 is still running
    run(s, second)
    assert [w.key for w in s.schedule()] == [1]
    assert s.stats.largest == 3


def test_prefill_of_another_microbatch_waits_for_its_own_pass():
    s = Scheduler()
    s.submit("a", 1, True, "decode", microbatch=0)
    s.submit("b", 100, False, "prefill", microbatch=1)
    assert [w.key for w in s.schedule()] == ["a"]
    assert [w.key for w in s.schedule()] == ["b"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.integers(1, 200)), min_size=1, max_size=60),
       st.integers(1, 8), st.integers(1, 300), st.integers(1, 3))
def test_every_piece_runs_once_in_session_order(arrivals, max_batch, budget, microbatches):
    s = Scheduler(token_budget=budget, max_batch=max_batch)
    submitted: dict = {}
    for i, (key, decode, rows) in enumerate(arrivals):
        s.submit(key, 1 if decode else rows, decode, i, microbatch=key % microbatches)
        submitted.setdefault(key, []).append(i)
    ran: dict = {}
    for _ in range(len(arrivals)):
        batch = s.schedule()
        if not batch:
            break
        keys = [w.key for w in batch]
        assert len(keys) == len(set(keys)) <= max_batch
        assert len({w.microbatch for w in batch}) == 1
        prefill_rows = [w.rows for w in batch if not w.decode]
        assert len(prefill_rows) <= 1 or sum(prefill_rows) <= budget
        for w in run(s, batch):
            ran.setdefault(w.key, []).append(w.payload)
    assert ran == submitted and s.queued == 0
