"""Speculation's pure parts (issue 20): prompt-lookup drafts, the draft length that follows
acceptance, and the tail's verification rule (greedy prefix; for sampling the standard
accept/reject rule, whose output must follow the target distribution)."""

import pytest
import torch

from meshd.entry.drafts import PAUSE_MIN, DraftLength, Drafts, PromptLookup, StepCosts
from meshd.entry.state import Generation
from meshd.shard.sampler import Sampler, SamplingParams, first_max

# chi-square critical values at p = 0.001 (df: value), from the standard table
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515}


def test_prompt_lookup_continues_the_longest_earlier_ngram():
    look = PromptLookup(ngram_max=3, ngram_min=2)
    ctx = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at the start, followed by 4 5 9; "2 3" more recently (followed by 4 7 8)
    assert look.propose(ctx, 3) == [4, 5, 9]
    assert look.propose(ctx + [4], 2) == [7, 8]  # "2 3 4" latest at position 7: followed by 7 8
    assert look.propose([5, 6, 7, 8], 4) == []  # nothing repeats
    assert PromptLookup().propose(ctx, 0) == []


def test_prompt_lookup_goes_on_where_an_occurrence_runs_out_so_a_repeating_run_drafts_k():
    """The latest earlier "0 0 0" of a run of zeros is one token from the end: its continuation is one
    token, so the lookup goes on from the context and what it proposed (a run, a repeated line)."""
    look = PromptLookup(ngram_max=3, ngram_min=2)
    assert look.propose([7, 0, 0, 0, 0], 5) == [0, 0, 0, 0, 0]
    line = [5, 6, 7, 8, 9]
    assert PromptLookup().propose([1, *line, *line[:3]], 6) == [8, 9, 5, 6, 7, 8]  # the line, and again
    assert PromptLookup().propose([1, *line, 2, *line[:3]], 6) == [8, 9, 2, 5, 6, 7]
    assert PromptLookup().propose([1, 2, 3, 4, 2, 3], 2) == [4, 2]


def test_prompt_lookup_never_proposes_the_suffix_itself_and_keeps_its_index_as_the_context_grows():
    look = PromptLookup(ngram_max=2, ngram_min=2)
    assert look.propose([3, 4], 4) == []  # the only "3 4" is the suffix
    assert look.propose([3, 4, 3, 4], 4) == [3, 4, 3, 4]  # the earlier one, continued to the end and on
    ctx = [3, 4, 3, 4]
    for t in [5, 3, 4]:
        ctx.append(t)
        look.propose(ctx, 1)
    assert look.propose(ctx, 2) == [5, 3]  # the latest earlier "3 4" (at 2) went on with 5


def test_the_draft_length_grows_while_accepted_and_falls_to_plain_decoding_with_probes():
    d = DraftLength(most=8, first=4)
    assert d.wanted() == 4
    d.after(4, 4)
    assert d.wanted() == 6
    d.after(6, 6)
    d.after(8, 8)
    assert d.wanted() == 8  # capped at --draft-max
    d.after(8, 2)
    assert d.wanted() == 3  # what would have been accepted, and one more
    d.after(d.wanted(), 0)
    assert d.k == 1  # halved on a miss of the first draft
    d.after(d.wanted(), 0)
    assert d.k == 0
    plain = [d.wanted() for _ in range(PAUSE_MIN)]
    assert plain == [0] * PAUSE_MIN and d.wanted() == 1  # a probe after the pause
    d.after(1, 0)
    assert [d.wanted() for _ in range(2 * PAUSE_MIN)] == [0] * (2 * PAUSE_MIN)  # the pause doubles
    assert d.wanted() == 1
    d.after(1, 1)
    assert d.wanted() == 3  # a probe that stands brings drafts back
    d.after(0, 0)  # a step without drafts changes nothing
    assert d.wanted() == 3
    assert DraftLength(most=0).wanted() == 0
    with pytest.raises(ValueError):
        DraftLength(most=-1)


def test_a_generation_proposes_no_more_drafts_than_it_may_still_produce():
    gen = Generation.start([1, 2, 3, 1, 2, 3, 1, 2], 4, max_positions=64)
    gen.drafts = Drafts(8)
    assert gen.propose() == []  # no token generated yet: the first comes from the prefill
    gen.accept(3)
    assert gen.propose() == [1, 2]  # 3 tokens left: at most 2 drafts, the step gives the third
    gen.verified(2, 1)
    assert (gen.drafted, gen.accepted_drafts) == (2, 1)
    assert gen.stats()["drafted"] == 2 and gen.stats()["accepted"] == 1
    plain = Generation.start([1, 2, 1, 2], 4, max_positions=64)
    plain.accept(1)
    assert plain.propose() == []


def test_greedy_verification_accepts_the_prefix_that_equals_the_argmax():
    s = Sampler(SamplingParams())
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert s.verify(logits, [3, 5, 7], 10)[:2] == (3, 2)  # all accepted, then the bonus token
    assert s.verify(logits, [3, 6, 7], 10)[:2] == (1, 5)  # the second is wrong: argmax in its place
    assert s.verify(logits, [0, 5, 7], 10)[:2] == (0, 3)
    assert s.verify(logits[:1], [], 10)[:2] == (0, 3)
    with pytest.raises(ValueError):
        s.verify(logits, [3], 10)
    with pytest.raises(ValueError):
        s.verify(logits[:2], [99], 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_first_largest_logit_as_torch_argmax_does(dtype):
    """`first_max` (numpy's argmax, 20x faster on a vocabulary) against torch.argmax: ties, NaNs,
    infinities, bfloat16 (whose equal values stay equal once widened)."""
    gen = torch.Generator().manual_seed(3)
    for i in range(300):
        x = torch.randn(4096, generator=gen).to(dtype)
        if i % 3 == 0:
            x[torch.randint(0, 4096, (4,), generator=gen)] = x.max()  # ties: the first one wins
        if i % 5 == 0:
            x[torch.randint(0, 4096, (2,), generator=gen)] = float("inf")
        if i % 7 == 0:
            x[torch.randint(0, 4096, (1,), generator=gen)] = float("nan")  # counts as the largest
        assert first_max(x) == int(torch.argmax(x)), i
        assert first_max(x.reshape(4, 1024)) == int(torch.argmax(x.reshape(4, 1024)))


@pytest.mark.parametrize("params,draft", [(SamplingParams(temperature=1.0, seed=5), 1),
                                          (SamplingParams(temperature=0.7, seed=9), 4),
                                          (SamplingParams(temperature=1.0, top_k=4, seed=2), 0)])
def test_accept_reject_gives_exactly_the_target_distribution(params, draft):
    """A draft proposed with certainty, accepted with probability p(draft), else a draw from p
    without it: the token that comes out follows p (goodness of fit over many positions, fixed seeds)."""
    logits = torch.tensor([[0.3, 1.2, -0.5, 0.9, 0.1, -1.0], [0.0] * 6])
    s = Sampler(params)
    p = s.logprobs(logits[0]).exp()
    n = 6000
    counts = torch.zeros(6)
    for position in range(n):
        accepted, token, _ = s.verify(logits, [draft], position)
        counts[draft if accepted else token] += 1
    support = p > 0
    assert counts[~support].sum() == 0  # nothing outside top-k
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts.tolist(), expected.tolist())
    # and the rule differs from plain sampling only in its draws: the draft is accepted about p(draft)
    accept_rate = sum(s.verify(logits, [draft], q)[0] for q in range(2000)) / 2000
    assert abs(accept_rate - float(p[draft])) < 0.05


def test_verification_draws_depend_on_seed_and_position_only():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    a, b = Sampler(SamplingParams(temperature=0.8, seed=3)), Sampler(SamplingParams(temperature=0.8, seed=3))
    b.sample(logits[0], 99)  # another draw in between changes nothing
    assert a.verify(logits, [1, 2, 3, 4], 40) == b.verify(logits, [1, 2, 3, 4], 40)
    other = [Sampler(SamplingParams(temperature=0.8, seed=4)).verify(logits, [1, 2, 3, 4], q)[1] for q in range(20)]
    same = [a.verify(logits, [1, 2, 3, 4], q)[1] for q in range(20)]
    assert other != same


def test_drafts_go_only_down_routes_that_leave_the_daemon_and_only_for_a_lone_generation():
    from meshd.entry.drafts import worth_drafting

    assert worth_drafting(remote_hops=2, generations=1)
    assert worth_drafting(remote_hops=1, generations=0)
    assert not worth_drafting(remote_hops=0, generations=1)  # a route inside this daemon: drafts are pure compute
    assert not worth_drafting(remote_hops=2, generations=2)  # shared passes: a draft's rows displace a token


def test_measured_costs_keep_drafts_where_a_trip_costs_more_than_the_rows_and_stop_them_where_not():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # "1 2 3" occurred: the lookup always has drafts here
    slow = Drafts(8, costs=StepCosts())
    assert slow.propose(ctx, 8) == []  # the first step goes plain: it times a trip
    slow.observe(1, 0.150)  # 25 ms links: a trip of 150 ms
    assert slow.propose(ctx, 8) == [4, 5, 6, 7]
    slow.after(4, 1)
    slow.observe(5, 0.150 + 4 * 0.007)  # each draft row adds 7 ms
    assert slow.costs.row == pytest.approx(0.007)
    assert slow.length.stands() == pytest.approx(1.9 / 3.8)  # one stood, one fell, after the prior 1 and 1
    assert slow.propose(ctx, 8) == [4, 5, 6]  # at even odds, 1.875 tokens for 171 ms beats 1.94 for 178
    fast = Drafts(8, costs=StepCosts())
    fast.propose(ctx, 8)
    fast.observe(1, 0.015)  # loopback: a 15 ms trip
    fast.propose(ctx, 8)
    fast.after(4, 1)
    fast.observe(5, 0.015 + 4 * 0.013)  # a draft model about as costly as the route's own step
    assert fast.propose(ctx, 8) == []  # 13 ms a draft against half a chance of 15 ms: plain steps for a pause
    assert [fast.propose(ctx, 8) for _ in range(PAUSE_MIN - 1)] == [[]] * (PAUSE_MIN - 1)
    assert fast.propose(ctx, 8) == [4]  # then a probe keeps the chance measured
    fast.after(1, 1)
    for _ in range(12):  # drafts that keep standing earn their rows back
        fast.after(2, 2)
    assert fast.length.stands() > 0.9 and fast.propose(ctx, 8) == [4, 5]  # two pay where a row costs near a trip
    # without costs (a sampled generation) drafts follow their acceptance alone, from the first step
    assert Drafts(8).propose(ctx, 8) == [4, 5, 6, 7]


def test_the_draft_count_maximises_expected_tokens_a_second():
    costs = StepCosts()
    costs.trip, costs.row = 0.170, 0.0025  # 25 ms links: a row costs 1.5% of a trip
    assert costs.best_k(0.95, 32) == 32  # copying: every draft the lookup has
    assert 8 <= costs.best_k(0.76, 32) <= 16  # each more draft is worth it while 0.76^k exceeds a row's share
    assert costs.best_k(0.01, 32) == 0  # drafts that never stand are not worth a row
    costs.trip = 0.015  # loopback: a row costs a sixth of a trip
    assert costs.best_k(0.95, 32) < 16 and costs.best_k(0.76, 32) <= 4 and costs.best_k(0.1, 32) == 0
    costs.row = 0.0
    assert costs.best_k(0.5, 32) == 32  # rows for free: every draft
    # more drafts as they stand better, and as trips cost more rows
    slow, quick = StepCosts(), StepCosts()
    slow.trip, quick.trip, slow.row, quick.row = 0.3, 0.03, 0.003, 0.003
    assert [slow.best_k(a, 32) for a in (0.3, 0.6, 0.9)] == sorted(slow.best_k(a, 32) for a in (0.3, 0.6, 0.9))
    assert all(slow.best_k(a, 32) >= quick.best_k(a, 32) for a in (0.3, 0.6, 0.9))


def test_a_draft_models_catching_up_on_the_prompt_is_not_counted_as_what_drafts_cost():
    class Source:  # a draft model that spent 0.2 s feeding the prompt before its drafts
        catch_up_s = 0.0

        def propose(self, context, k):
            self.catch_up_s = 0.2 if k else 0.0
            return [7] * k

    d = Drafts(4, Source(), StepCosts())
    assert d.propose([1, 2, 3], 4) == []  # plain: a trip timed
    d.observe(1, 0.030)
    assert d.propose([1, 2, 3, 4], 4) == [7, 7, 7, 7]
    d.after(4, 4)
    d.observe(5, 0.030 + 4 * 0.005 + 0.2)
    assert d.costs.row == pytest.approx(0.005)  # not (0.2 + 0.02) / 4
    assert d.propose([1, 2, 3, 4, 7, 7, 7, 7, 9], 8) == [7, 7, 7, 7]
