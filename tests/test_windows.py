"""Checking by prefill, its pure parts: the windows a check cuts (`checks.next_window`), the verdict on a window
(`checks.first_wrong`), the settings that refuse what cannot run, the every-row sketches a window's pass gives
against the one-position steps' (`meshd/hop/sketch.py`), the tail held to the very token sampled
(`Sampler.verify(exact=True)`), the text taken back from the first wrong token (`Run.retract`), the ledger's
windows, and the second route drawn at random so that checks reach every server of a range
(`route.spread_weights`). Made-up inputs; the real path is tests/test_verify_mesh.py's."""

import random

import pytest
import torch
import trio

from meshd.entry.checks import Check, Checking, first_wrong, next_window
from meshd.entry.route import plan_route, spread_weights
from meshd.entry.run import Run
from meshd.entry.state import Generation
from meshd.hop import sketch
from meshd.node.ledger import Ledger
from meshd.shard.sampler import Sampler, SamplingParams
from meshd.testing.fakes import coverage, record
from meshd.wire import GenerateRequest


def test_windows_are_cut_at_their_size_and_the_rest_once_the_try_ends():
    assert next_window(0, 15, 16, finished=False) is None
    assert next_window(0, 16, 16, finished=False) == (0, 16)
    assert next_window(1, 40, 16, finished=False) == (1, 17)  # the first token is checked on its own
    assert next_window(17, 20, 16, finished=False) is None
    assert next_window(17, 20, 16, finished=True) == (17, 20)
    assert next_window(20, 20, 16, finished=True) is None  # all checked: nothing left
    spans, checked = [], 1
    while (span := next_window(checked, 50, 16, finished=True)) is not None:
        spans.append(span)
        checked = span[1]
    assert spans == [(1, 17), (17, 33), (33, 49), (49, 50)]


def rows(n: int, seed: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{(0, 10): torch.randn(8, generator=gen, dtype=torch.float64),
             (10, 20): torch.randn(8, generator=gen, dtype=torch.float64),
             (20, 30): torch.randn(8, generator=gen, dtype=torch.float64)} for _ in range(n)]


def test_a_window_agrees_when_every_token_and_every_shared_sketch_does():
    mine = rows(5)
    theirs = [{k: v.clone() for k, v in r.items()} for r in mine]
    assert first_wrong([1, 2, 3, 4, 5], mine, [1, 2, 3, 4, 5], theirs) is None
    assert first_wrong([1, 2, 3, 4, 5], mine, [1, 2, 3, None, None], theirs) is None  # unknown tokens: the sketches


def test_the_first_wrong_row_is_named_with_the_layers_where_the_sketches_part():
    mine = rows(5)
    theirs = [{k: v.clone() for k, v in r.items()} for r in mine]
    theirs[3][(10, 20)] = theirs[3][(10, 20)] * 1.01  # a hop of 10:20 computed row 3 otherwise
    theirs[3][(20, 30)] = -theirs[3][(20, 30)]
    theirs[4][(0, 10)] = theirs[4][(0, 10)] + 1
    assert first_wrong([1, 2, 3, 4, 5], mine, [1, 2, 3, 4, 5], theirs) == (3, (10, 20))  # agreed through 10
    assert first_wrong([1, 2, 3, 4, 5], mine, [1, 9, 3, 4, 5], theirs) == (1, None)  # only a token differs
    theirs[3][(10, 20)] = mine[3][(10, 20)] * (1 + 1e-6)  # within the tolerance: not a disagreement there
    assert first_wrong([1, 2, 3, 4, 5], mine, [1, 2, 3, 4, 5], theirs) == (3, (20, 30))


def test_boundaries_only_one_route_has_are_not_compared():
    mine = [{(10, 20): torch.ones(8, dtype=torch.float64), (20, 30): torch.ones(8, dtype=torch.float64)}]
    theirs = [{(10, 30): torch.ones(8, dtype=torch.float64)}]  # one hop ran 10:30: layer 30 is the shared end
    assert first_wrong([7], mine, [7], theirs) is None
    theirs[0][(10, 30)] = torch.zeros(8, dtype=torch.float64)
    assert first_wrong([7], mine, [7], theirs) == (0, (0, 30))


@pytest.mark.parametrize("kwargs,name", [({"by": "guess"}, "--verify-by"), ({"window": 0}, "--verify-window"),
                                         ({"window": 1000}, "--verify-window"), ({"window": True}, "--verify-window"),
                                         ({"release": "later"}, "--verify-release")])
def test_settings_a_check_cannot_run_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Checking(**kwargs)


def test_a_windows_every_row_sketch_is_what_its_one_position_step_gives():
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(1, 12, 576, generator=gen)
    every = sketch.sketch_rows(out, seed=77)
    assert every.shape == (12, sketch.K)
    for i in range(12):
        assert torch.equal(every[i], sketch.sketch(out[:, : i + 1], 77))  # bit for bit, each row alone
    logits = torch.randn(4, 49152, generator=gen)  # a tail's rows
    assert torch.equal(sketch.sketch_rows(logits, 9)[2], sketch.sketch(logits[2], 9))
    assert not torch.equal(sketch.sketch(out, 77), sketch.sketch(out, 78))


def test_a_rows_request_travels_on_and_comes_back_as_one_sketch_a_row():
    out = torch.randn(1, 6, 64)
    tensors = sketch.carried((sketch.rows_request(11),), out, (0, 10))
    assert sketch.teacher(tensors) and not sketch.teacher((sketch.request(11),))
    nxt = sketch.carried(tensors, torch.randn(1, 6, 64), (10, 20))
    got = sketch.read(nxt)
    assert set(got) == {(0, 10), (10, 20)} and got[(0, 10)].shape == (6, sketch.K)
    assert torch.equal(sketch.row(got, 4)[(0, 10)], sketch.sketch(out[:, :5], 11).to(torch.float32).double())
    last = sketch.read(sketch.carried((sketch.request(11),), out, (0, 10)))
    assert last[(0, 10)].shape == (sketch.K,) and sketch.row(last, 0) == {}  # a last-row sketch has no rows
    assert sketch.carried((), out, (0, 10)) == ()


def test_a_windows_tail_accepts_a_sampled_token_only_where_it_samples_that_very_token():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen) * 2
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=42)
    sampled = [Sampler(params).sample(logits[i], 10 + i)[0] for i in range(6)]
    accepted, token, _ = Sampler(params).verify(logits, sampled[:5], 10, exact=True)
    assert (accepted, token) == (5, sampled[5])  # every draw the same: all accepted, the next one drawn alike
    wrong = [*sampled[:2], (sampled[2] + 1) % 300, *sampled[3:5]]
    accepted, token, _ = Sampler(params).verify(logits, wrong, 10, exact=True)
    assert (accepted, token) == (2, sampled[2])  # stops at the first token it would not have drawn
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    best = [int(logits[i].argmax()) for i in range(6)]
    exact, usual = Sampler(greedy).verify(logits, best[:5], 10, exact=True), Sampler(greedy).verify(logits, best[:5], 10)
    assert exact[:2] == usual[:2]


class Tok:
    """A made-up tokenizer: token i is the letter chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def run_of(tokens: list[int], streamed: int) -> tuple[Run, list]:
    from meshd.shard.tokenizer import TextStream

    events = []

    async def emit(event):
        events.append(event)

    gen = Generation.start([1, 2, 3], 50, 100)
    gen.check = Check(by="prefill")
    text = TextStream(Tok())
    for t in tokens:
        gen.accept(t)
    for t in tokens[:streamed]:
        text.push(t)
    gen.streamed = streamed
    run = Run(GenerateRequest(request_id=5, prompt="x", max_tokens=50), gen, None, None, text, emit)
    return run, events


def test_a_retraction_tells_the_client_which_text_stands_and_the_text_goes_on_from_there():
    run, events = run_of([0, 1, 2, 3, 4, 5], streamed=6)
    trio.run(run.retract, 4, "a check found token 4 wrong")
    (event,) = events
    assert event.kind == "retract" and event.stats == {"tokens": 4, "keep_chars": 4}
    assert run.gen.tokens == [0, 1, 2, 3] and run.gen.streamed == 4 and run.gen.check.retracted == 2
    trio.run(run.emit_token, 7)
    assert events[-1].kind == "text" and events[-1].text == "h"  # the text after the kept "abcd"


def test_tokens_never_sent_are_dropped_without_a_word():
    run, events = run_of([0, 1, 2, 3, 4, 5], streamed=2)  # the text waits for the check: 2 went out
    trio.run(run.retract, 3, "never checked")
    assert events == [] and run.gen.tokens == [0, 1, 2] and run.gen.streamed == 2 and run.gen.check.retracted == 0


def test_the_ledger_keeps_each_window_checked_by_whom_and_its_verdict(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db")
    row = ledger.begin_generation(9)
    check = Check(by="prefill")
    check.window(0, 1, [["A", 10, 20], ["T", 20, 30]], "agreed")
    check.window(1, 17, [["A", 10, 20], ["T", 20, 30]], "agreed")
    check.window(17, 20, [["B", 10, 20], ["T", 20, 30]], "disagreed", (10, 20))
    ledger.end_generation(row, "E", "completed", 5, 40, [([["E", 0, 10]], 0)], checked=True, agreed=False,
                          windows=check.windows)
    kept = ledger.windows(row)
    assert [(w["start"], w["end"], w["verdict"]) for w in kept] == [(0, 1, "agreed"), (1, 17, "agreed"),
                                                                     (17, 20, "disagreed")]
    assert kept[2]["checkers"] == [["B", 10, 20], ["T", 20, 30]] and kept[2]["layers"] == [10, 20]
    assert ledger.totals()["windows"] == {"agreed": 2, "disagreed": 1}
    ledger.close()


def test_checks_reach_every_server_of_a_range_not_only_the_fastest():
    """Three servers of 10:20 besides the first route's, one claiming four times the others' speed: a check's
    route drawn with `spread_weights` takes each of them over many draws, the fast one most often."""
    cov = coverage(record("E", 0, 10), record("P", 10, 20, throughput=4000.0), record("F", 10, 20, throughput=4000.0),
                   record("S1", 10, 20, throughput=1000.0), record("S2", 10, 20, throughput=1000.0),
                   record("T", 20, 30))
    draw = random.Random(7)
    taken: dict[str, int] = {}
    for _ in range(400):
        route = plan_route(cov, 10, exclude={"E"}, avoid={"P", "T"}, weigh=spread_weights(draw))
        taken[route.hops[0].peer_id] = taken.get(route.hops[0].peer_id, 0) + 1
    assert set(taken) == {"F", "S1", "S2"}
    assert taken["F"] > taken["S1"] and taken["F"] > taken["S2"] and min(taken.values()) >= 20
    plain = {plan_route(cov, 10, exclude={"E"}, avoid={"P", "T"}).hops[0].peer_id for _ in range(20)}
    assert plain == {"F"}  # without the draw, always the fastest


def test_a_window_takes_the_entrys_own_rows_of_the_first_routes_steps_and_their_sketches():
    from meshd.entry.windows import Tally
    from meshd.hop.endpoint import DRAFTS, HIDDEN
    from meshd.wire import Forward, Phase
    from meshd.wire.tensors import Tensor

    tally = Tally(base=0)
    gen = torch.Generator().manual_seed(2)
    steps = [(7, 1), (8, 3), (10, 2)]  # (position, rows): a plain step, a step with drafts, the next one
    rows = {}
    for position, n in steps:
        hidden = torch.randn(1, n, 16, generator=gen)
        mine = torch.randn(n, sketch.K, generator=gen)
        tally.own_rows(Forward(session_id=b"s", epoch=0, step=1, phase=Phase.VERIFY if n > 1 else Phase.DECODE,
                               position=position, tensors=(Tensor.from_torch(HIDDEN, hidden),
                                                           Tensor.from_torch("sketch:0:10", mine))))
        rows.update({position + i: (hidden[0, i], mine[i]) for i in range(n)})
    tally.own_rows(Forward(session_id=b"s", epoch=0, step=0, phase=Phase.PREFILL, position=0,
                           tensors=(Tensor.from_torch(HIDDEN, torch.zeros(1, 7, 16)),)))  # a prompt: not a step's
    assert sorted(tally.own) == [7, 8, 9, 10, 11]

    class At:
        sid, epoch = b"c", 3

    frame = tally.window_frame(At(), 5, 8, [11, 12, 13, 14], seed=9, name="sketch:0:10", grammar=False)
    assert (frame.session_id, frame.epoch, frame.phase, frame.position) == (b"c", 3, Phase.VERIFY, 8)
    got = {t.name: t.to_torch() for t in frame.tensors}
    assert frame.tensors[0].name == HIDDEN
    assert torch.equal(got[HIDDEN][0], torch.stack([rows[p][0] for p in range(8, 12)]))
    assert got[DRAFTS].tolist() == [[12, 13, 14]] and sketch.teacher(frame.tensors)
    assert torch.equal(got["sketch:0:10"], torch.stack([rows[p][1] for p in range(8, 12)]))
    assert sorted(tally.own) == [8, 9, 10, 11]  # rows before the window are let go
    assert tally.window_frame(At(), 6, 10, [1, 2, 3], seed=9, name="sketch:0:10", grammar=False) is None  # 12 missing
