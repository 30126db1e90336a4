"""Passes of several positions that round exactly like decode steps (issue 20), in both lanes:
a STEPS or SCORE pass gives every position the bits its one-position step gives, the tail scores
every position of a SCORE pass, and a rollback (the next frame starting earlier) leaves the KV as
plain decoding leaves it."""

import pytest
import torch

from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.batch import PASS, SCORE, STEPS
from meshd.shard.runtime import Shard
from tests import tiny_models

QT = tiny_models.gguf.GGMLQuantizationType
IDS = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11, 200, 4]


@pytest.fixture(scope="module", params=["exact", "native"])
def lane(request, tmp_path_factory):
    model = tiny_models.tiny_llama(seed=11)
    if request.param == "native":
        if not blocks.available(QT.Q4_1):
            pytest.skip("the block kernel did not build here")
        tiny_models.quantize_linear_weights(model, QT.Q4_1)
        path = tiny_models.write_llama_gguf(model, tmp_path_factory.mktemp("n") / "m.gguf", qtype=QT.Q4_1)
        recipe = NATIVE
    else:
        path = tiny_models.write_llama_gguf(model, tmp_path_factory.mktemp("e") / "m.gguf")
        recipe = EXACT
    art = open_artifact(path)
    return Shard(art, 0, 2, recipe), Shard(art, 2, art.config.n_layers, recipe)


def steps_of(body, tail, key, ids, start):
    """Hidden states and logits of ids fed one decode step at a time from `start`."""
    hidden, logits = [], []
    for i, t in enumerate(ids):
        h = body.forward(key, torch.tensor([[t]]), start + i)
        hidden.append(h)
        logits.append(tail.forward(key, h, start + i))
    return torch.cat(hidden, dim=1), torch.stack(logits)


@pytest.mark.parametrize("kind", [STEPS, SCORE])
def test_a_pass_of_several_positions_gives_the_bits_of_its_decode_steps(lane, kind):
    body, tail = lane
    for s in (body, tail):
        s.open_session(("chunk", kind))
        s.open_session(("steps", kind))
    prompt, rest = IDS[:5], IDS[5:]
    for key in (("chunk", kind), ("steps", kind)):
        tail.forward(key, body.forward(key, torch.tensor([prompt]), 0), 0)
    want_hidden, want_logits = steps_of(body, tail, ("steps", kind), rest, len(prompt))
    hidden = body.forward(("chunk", kind), torch.tensor([rest]), len(prompt), kind)
    assert torch.equal(hidden, want_hidden)
    logits = tail.forward(("chunk", kind), hidden, len(prompt), kind)
    if kind == SCORE:
        assert logits.shape == (len(rest), tail.config.vocab)
        assert torch.equal(logits, want_logits)
    else:
        assert torch.equal(logits, want_logits[-1])
    assert tail.session_length(("chunk", kind)) == tail.session_length(("steps", kind)) == len(IDS)


def test_a_score_pass_batched_with_other_sessions_keeps_its_bits(lane):
    body, tail = lane
    for s in (body, tail):
        for key in ("alone", "mixed", "other"):
            s.open_session(key)
    for key in ("alone", "mixed", "other"):
        tail.forward(key, body.forward(key, torch.tensor([IDS[:4]]), 0), 0)
    alone = tail.forward("alone", body.forward("alone", torch.tensor([IDS[4:9]]), 4, SCORE), 4, SCORE)
    jobs = [("other", torch.tensor([[9]]), 4, STEPS), ("mixed", torch.tensor([IDS[4:9]]), 4, SCORE)]
    hidden = body.forward_batch(jobs)
    out = tail.forward_batch([(k, h, 4, kind) for (k, _, _, kind), h in zip(jobs, hidden)])
    assert torch.equal(out[1], alone)
    assert out[0].shape == (tail.config.vocab,)


def test_a_rollback_leaves_the_kv_and_the_next_step_as_plain_decoding_does(lane):
    """Drafts rejected: the next frame starts where the accepted positions end, and from there every
    hop computes what it would have computed had the drafts never been sent."""
    body, tail = lane
    for s in (body, tail):
        s.open_session("spec")
        s.open_session("plain")
    for key in ("spec", "plain"):
        tail.forward(key, body.forward(key, torch.tensor([IDS[:6]]), 0), 0)
    tail.forward("spec", body.forward("spec", torch.tensor([[IDS[6], 1, 2, 3]]), 6, SCORE), 6, SCORE)
    assert body.session_length("spec") == 10
    _, plain = steps_of(body, tail, "plain", IDS[6:9], 6)
    _, spec = steps_of(body, tail, "spec", IDS[6:9], 6)  # all three drafts rejected: back to position 7
    assert torch.equal(spec, plain)
    assert [s.session_length("spec") for s in (body, tail)] == [s.session_length("plain") for s in (body, tail)]


def test_an_unknown_kind_of_pass_is_refused_for_that_job_only(lane):
    body, _ = lane
    body.open_session("k")
    out = body.forward_batch([("k", torch.tensor([[1]]), 0, "sideways")])
    assert isinstance(out[0], ValueError) and "kind" in str(out[0])
    assert PASS == "pass"
