"""A VERIFY step through a chain of hops, every frame encoded as on a stream (issue 20): the tail
answers how many drafts it accepts and the token after them, the drafts travel with the hidden
states, and rejected positions leave every hop's KV (the tail's at once, the others' with the next
frame), so that the KV ends where plain decoding leaves it."""

import os

import pytest
import torch

from meshd.entry.local import HopError, LocalPipeline
from meshd.entry.state import open_session
from meshd.hop.endpoint import token_frame
from meshd.shard import blocks
from meshd.shard.sampler import SamplingParams
from meshd.wire import Forward, Phase, Tensor, Token
from tests import tiny_models

QT = tiny_models.gguf.GGMLQuantizationType
PROMPT = [5, 17, 3, 99, 42, 8, 61, 23]


@pytest.fixture(scope="module", params=["exact", "native"])
def pipeline(request, tmp_path_factory):
    model = tiny_models.tiny_llama(seed=3)
    qtype = None
    if request.param == "native":
        if not blocks.available(QT.Q4_0):
            pytest.skip("the block kernel did not build here")
        qtype = QT.Q4_0
        tiny_models.quantize_linear_weights(model, qtype)
    path = tiny_models.write_llama_gguf(model, tmp_path_factory.mktemp(request.param) / "m.gguf", qtype=qtype)
    return LocalPipeline(str(path), split="1,3", recipe=request.param)


def open_all(p, sid):
    for endpoint, (a, b) in zip(p.endpoints, p.ranges):
        p._hop(endpoint, open_session(1, sid, 0, a, b, p.artifact.fingerprint, p.recipe_fp, 64, SamplingParams()))
    return p._through(token_frame(sid, 0, 0, Phase.PREFILL, 0, PROMPT)).token_id


def lengths(p, sid):
    return [e.shard.session_length((sid, 0)) for e in p.endpoints]


def plain(p, n):
    """Greedy tokens after the prompt and the KV lengths after each decode step."""
    sid = os.urandom(16)
    tokens, kv = [open_all(p, sid)], []
    for i in range(n):
        tokens.append(p._through(token_frame(sid, 0, i + 1, Phase.DECODE, len(PROMPT) + i, [tokens[-1]])).token_id)
        kv.append(lengths(p, sid))
    return tokens, kv


def test_rejected_drafts_leave_every_hop_as_plain_decoding_leaves_it(pipeline):
    p = pipeline
    want, want_kv = plain(p, 3)
    sid = os.urandom(16)
    first = open_all(p, sid)
    wrong = [(t + 1) % 256 for t in want[1:4]]
    reply = p._through(token_frame(sid, 0, 1, Phase.VERIFY, len(PROMPT), [first, *wrong]))
    assert isinstance(reply, Token) and reply.accepted == 0 and reply.token_id == want[1]
    held = lengths(p, sid)
    assert held[-1] == want_kv[0][-1]  # the tail dropped them at once
    assert held[:-1] == [len(PROMPT) + 4] * 2  # the others hold them until the next frame says where the KV ends
    reply = p._through(token_frame(sid, 0, 2, Phase.DECODE, len(PROMPT) + 1, [reply.token_id]))
    assert reply.token_id == want[2]
    assert lengths(p, sid) == want_kv[1]


def test_drafts_that_equal_the_greedy_text_are_all_accepted_with_the_token_after(pipeline):
    p = pipeline
    want, want_kv = plain(p, 5)
    sid = os.urandom(16)
    first = open_all(p, sid)
    reply = p._through(token_frame(sid, 0, 1, Phase.VERIFY, len(PROMPT), [first, *want[1:4]]))
    assert (reply.accepted, reply.token_id) == (3, want[4])
    partly = os.urandom(16)
    first = open_all(p, partly)
    reply = p._through(token_frame(partly, 0, 1, Phase.VERIFY, len(PROMPT), [first, want[1], want[2], 0]))
    assert (reply.accepted, reply.token_id) == ((3, want[4]) if want[3] == 0 else (2, want[3]))
    a = reply.accepted
    reply = p._through(token_frame(partly, 0, 2, Phase.DECODE, len(PROMPT) + a + 1, [reply.token_id]))
    assert reply.token_id == want[a + 2]  # the text goes on as plain decoding's
    assert lengths(p, partly) == want_kv[a + 1]


def test_a_verify_frame_without_its_drafts_is_refused_for_that_session_only(pipeline):
    p = pipeline
    sid = os.urandom(16)
    first = open_all(p, sid)
    hidden = p._hop(p.endpoints[0], token_frame(sid, 0, 1, Phase.VERIFY, len(PROMPT), [first, 1, 2]))
    assert isinstance(hidden, Forward) and [t.name for t in hidden.tensors] == ["hidden", "drafts"]
    stripped = Forward(session_id=sid, epoch=0, step=1, phase=Phase.VERIFY, position=len(PROMPT),
                       tensors=hidden.tensors[:1])
    with pytest.raises(HopError, match="bad_frame.*drafts"):
        p._hop(p.endpoints[1], stripped)
    bad = Forward(session_id=sid, epoch=0, step=1, phase=Phase.VERIFY, position=len(PROMPT),
                  tensors=(hidden.tensors[0], Tensor.from_torch("drafts", torch.tensor([[1, 2, 3]]))))
    with pytest.raises(HopError, match="bad_frame.*drafts int"):
        p._hop(p.endpoints[1], bad)
    assert p._hop(p.endpoints[1], hidden) is not None  # the session goes on
