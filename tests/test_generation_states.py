"""A generation's stages as a table (meshd/entry/stages.py), the one decode rule every path shares
(`Generation.take`), and the one rule for how a generation ended (`errors.ending`): pure, no mesh."""

from types import SimpleNamespace

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from meshd.entry.errors import Ending, GenerationError, HopFailed, ending, outcome_of
from meshd.entry.generation import Entry
from meshd.entry.policy import Suspects
from meshd.entry.stages import MOVES, RUNNING, BadMove, Course, Event, Stage
from meshd.entry.state import Generation
from meshd.wire import ErrorCode

SPEC = """
    trying    done        completed
    trying    switched    trying
    trying    moved       trying
    trying    hop failed  trying
    trying    disagreed   settling
    trying    refused     waiting
    trying    gave up     failed
    trying    stopped     cancelled
    settling  settled     trying
    settling  hop failed  trying
    settling  refused     waiting
    settling  gave up     failed
    settling  stopped     cancelled
    waiting   waited      trying
    waiting   gave up     failed
    waiting   stopped     cancelled
"""
EXPECTED = {(Stage(line[:10].strip()), Event(line[10:22].strip())): Stage(line[22:].strip())
            for line in (raw.strip() for raw in SPEC.strip("\n").splitlines())}


def course_at(stage: Stage) -> Course:
    course = Course()
    course.stage = stage
    return course


def test_the_table_is_exactly_these_moves():
    assert MOVES == EXPECTED


@pytest.mark.parametrize("move", sorted(EXPECTED.items()), ids=lambda m: f"{m[0][0]}-{m[0][1]}")
def test_every_move_of_the_table_is_taken(move):
    (stage, event), to = move
    course = course_at(stage)
    assert course.to(event) == to and course.stage == to
    assert course.ended == (to not in RUNNING)


ILLEGAL = [(s, e) for s in Stage for e in Event if (s, e) not in EXPECTED]


@pytest.mark.parametrize("stage, event", ILLEGAL, ids=lambda x: str(x))
def test_every_other_move_is_refused_and_changes_nothing(stage, event):
    course = course_at(stage)
    with pytest.raises(BadMove):
        course.to(event)
    assert course.stage == stage


def test_an_ended_generation_moves_no_more_and_every_running_stage_can_end():
    for end in (Stage.COMPLETED, Stage.CANCELLED, Stage.FAILED):
        assert not any(s == end for s, _ in MOVES)
    for stage in RUNNING:
        for outcome, to in (("cancelled", Stage.CANCELLED), ("failed", Stage.FAILED)):
            course = course_at(stage)
            assert course.end(outcome) and course.stage == to


def test_ending_a_course_that_ended_changes_nothing():
    course = Course()
    course.to(Event.DONE)
    assert not course.end("failed") and course.stage == Stage.COMPLETED
    assert Course().end("completed")  # a stop sequence the client's front door cut: completed while trying


def test_a_checked_generation_that_disagrees_settles_and_goes_on():
    course = Course()
    for event in (Event.DISAGREED, Event.SETTLED, Event.HOP_FAILED, Event.REFUSED, Event.WAITED, Event.SWITCHED,
                  Event.MOVED, Event.DONE):
        course.to(event)
    assert course.stage == Stage.COMPLETED and course.ended


@given(st.lists(st.sampled_from(list(Event)), max_size=30))
def test_any_sequence_of_events_stays_in_the_table(events):
    course = Course()
    for event in events:
        before = course.stage
        if (before, event) in MOVES:
            assert course.to(event) == MOVES[before, event]
        else:
            with pytest.raises(BadMove):
                course.to(event)
            assert course.stage == before


# ---- the decode rule: Generation.take ----

def test_take_stops_at_the_last_token_it_may_take():
    gen = Generation(ids=[1, 2], max_tokens=3)
    assert gen.take([5, 6]) == ([5, 6], None) and gen.position == 3
    assert gen.take([7, 8, 9]) == ([7], Event.DONE) and gen.tokens == [5, 6, 7]
    assert gen.take([10]) == ([], Event.DONE)  # done already: nothing more is taken


def test_take_stops_at_a_stop_token():
    gen = Generation(ids=[1], max_tokens=10, stop=frozenset({0}))
    assert gen.take([4, 0, 5]) == ([4, 0], Event.DONE)


def test_take_says_when_the_sessions_must_open_again_on_the_long_table():
    gen = Generation(ids=[1, 2, 3], max_tokens=10, switch=4)
    assert gen.take([5]) == ([5], None)  # 3 + 1 positions: the last token's position is 3, on the short table
    assert gen.take([6]) == ([6], Event.SWITCHED)  # feeding it would need position 4: past the switch
    assert gen.take_table() and gen.rope_table != Generation(ids=[1], max_tokens=1).rope_table
    assert gen.take([7]) == ([7], None)  # on the long table it goes on


def test_a_generation_that_may_take_nothing_is_done_at_once():
    assert Generation(ids=[1], max_tokens=0).take([3]) == ([], Event.DONE)


# ---- the ending rule ----

class Stop(Exception):
    ends_generation_normally = True


@pytest.mark.parametrize("exc, end", [
    (None, Ending("completed", "ok")),
    (Stop(), Ending("completed", "ok")),
    (BaseExceptionGroup("g", [Stop()]), Ending("completed", "ok")),
    (GenerationError(ErrorCode.NO_ROUTE, "no route"), Ending("failed", "no_route")),
    (ExceptionGroup("g", [GenerationError(ErrorCode.BUSY, "mesh busy")]), Ending("failed", "busy")),
    (ExceptionGroup("g", [HopFailed("p" * 10, "gone")]), Ending("failed", "hop_failed")),
    (HopFailed("p" * 10, "gone"), Ending("failed", "hop_failed")),
    (trio.BrokenResourceError(), Ending("cancelled", "cancelled")),
    (trio.ClosedResourceError(), Ending("cancelled", "cancelled")),
    (KeyboardInterrupt(), Ending("cancelled", "cancelled")),
    (RuntimeError("boom"), Ending("cancelled", "cancelled")),  # cut off without a code, as metrics always said
])
def test_one_rule_says_how_a_generation_ended(exc, end):
    assert ending(exc) == end
    assert outcome_of(exc) == end.outcome
    course = Course()  # the outcome is the stage a generation that ended so ends in
    assert course.end(end.outcome) and course.stage.value == end.outcome


async def test_a_cancelled_generation_ends_cancelled():
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.sleep(1)
        except trio.Cancelled as exc:
            assert ending(exc) == Ending("cancelled", "cancelled")
            raise


# ---- the entry's driver moves by the table ----

def scripted_entry(script: list, seen: list) -> Entry:
    """An entry whose tries and settlements end as `script` says, in order (an exception is raised), on a
    mesh view that finds nothing lapsed; `seen` gets the stage of each."""
    entry = Entry.__new__(Entry)
    entry.end, entry.busy_wait_s, entry.tokenizer = 10, 30.0, None
    entry.checked = entry.disagreed = entry.handovers = entry.handover_fallbacks = 0
    entry.routes = SimpleNamespace(suspects=Suspects())
    refreshed = []

    async def refresh():
        refreshed.append(trio.current_time())

    entry.mesh = SimpleNamespace(ttl_s=9.0, peer_id="me", lapsed_serving=lambda end: set(), refresh=refresh,
                                 refreshed=refreshed)
    steps = iter(script)

    async def stage(run):
        seen.append(run.gen.course.stage)
        item = next(steps)
        if isinstance(item, BaseException):
            raise item
        return item

    entry._try = stage
    entry.lockstep = SimpleNamespace(settle=stage)
    return entry


async def test_the_entry_moves_a_generation_through_its_stages(autojump_clock):
    seen = []
    entry = scripted_entry([HopFailed("peer-A" * 2, "gone"), Event.DISAGREED, Event.SETTLED,
                            ExceptionGroup("g", [GenerationError(ErrorCode.NO_ROUTE, "no route")]),
                            Event.SWITCHED, Event.DONE], seen)
    gen = Generation(ids=[1, 2], max_tokens=4)
    stats = await entry._generate(SimpleNamespace(request_id=1), gen, None, None)
    assert seen == [Stage.TRYING, Stage.TRYING, Stage.SETTLING, Stage.TRYING, Stage.TRYING, Stage.TRYING]
    assert gen.course.stage == Stage.COMPLETED and stats["reroutes"] == 1 == gen.reroutes
    assert len(entry.mesh.refreshed) == 1  # no route in the view: it waited, refreshed the view once, and went on


async def test_a_generation_the_policy_gives_up_on_ends_failed(autojump_clock):
    seen = []
    entry = scripted_entry([HopFailed("peer-A" * 2, "refused", retriable=False)], seen)
    gen = Generation(ids=[1], max_tokens=4)
    with pytest.raises(GenerationError) as failed:
        await entry._generate(SimpleNamespace(request_id=1), gen, None, None)
    assert gen.course.end(ending(failed.value).outcome) and gen.course.stage == Stage.FAILED
