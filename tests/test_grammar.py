"""Constrained decoding at the hop that samples: the grammar takes the fed ids, masks what it samples,
rejects a forbidden draft, rolls back what a rejected draft or a replay left, and ends at end-of-sequence."""

import json

import jsonschema
import llguidance
import pytest
import torch

from meshd import wire as w
from meshd.hop.endpoint import FED, ShardEndpoint, token_frame
from meshd.shard import grammar
from meshd.shard.sampler import Sampler, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from meshd.shard.artifact import open_artifact
    from meshd.shard.tokenizer import load_tokenizer

    return load_tokenizer(open_artifact("smollm2"))


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return grammar.ll_tokenizer(tokenizer)


def test_check_refuses_a_bad_grammar_with_its_reason(lltok):
    grammar.check(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), lltok)
    with pytest.raises(grammar.GrammarError, match="objectx"):
        grammar.check(llguidance.LLMatcher.grammar_from_json_schema({"type": "objectx"}), lltok)
    with pytest.raises(grammar.GrammarError, match="bad grammar"):
        grammar.check("{not json", lltok)
    with pytest.raises(grammar.GrammarError, match="bytes"):
        grammar.check("x" * (grammar.MAX_GRAMMAR_BYTES + 1), lltok)


def test_the_constraint_takes_fed_ids_from_its_start_and_rolls_back_past_a_frame(tokenizer, lltok):
    c = grammar.Constraint(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), lltok, start=10)
    text = tokenizer.encode('{"name": "Ada", "age": 36, "tags": ["a"]}', add_special_tokens=False)
    c.feed(7, [1, 2, 3])  # prompt positions: nothing taken
    assert c.taken == 0
    c.feed(9, [4, *text[:3]])  # position 9 is the prompt's last; 10.. are generated
    assert c.taken == 3
    c.feed(11, text[1:5])  # a frame starting earlier (a rejected draft, a replay): rolled back, then taken
    assert c.taken == 5
    with pytest.raises(grammar.GrammarError, match="needs 9"):
        c.feed(19, [1])  # a frame past what it has taken: tokens went missing
    for t in text[5:]:
        c.take(t)
    allowed = c.allowed(49152 + 64)  # the head's rows past the tokenizer's vocabulary are never allowed
    assert allowed.nonzero().flatten().tolist() == [lltok.eos_token]  # complete: end of sequence only
    with pytest.raises(grammar.GrammarError, match="does not allow"):
        grammar.Constraint(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), lltok, 0).take(
            tokenizer.encode("hello", add_special_tokens=False)[0])


def test_a_masked_sampler_draws_only_what_the_grammar_allows_and_rejects_a_forbidden_draft(tokenizer, lltok):
    g = llguidance.LLMatcher.grammar_from_json_schema({"enum": ["yes", "no"]})
    logits = torch.zeros(49152)
    maybe = tokenizer.encode("maybe", add_special_tokens=False)[0]
    logits[maybe] = 50.0  # what the model would say
    allowed = grammar.Constraint(g, lltok, 0).allowed(49152)
    assert not allowed[maybe] and 0 < int(allowed.sum()) < 20
    token, logprob = Sampler(SamplingParams()).sample(logits, 5, grammar.Constraint(g, lltok, 0))
    assert allowed[token] and logprob == pytest.approx(-50, abs=0.1)  # greedy: the model's own log-probability
    token, logprob = Sampler(SamplingParams(temperature=1.0, seed=3)).sample(logits, 5, grammar.Constraint(g, lltok, 0))
    assert allowed[token] and logprob > -20  # sampled: of the distribution it was drawn from, the allowed tokens
    forbidden = tokenizer.encode('"maybe', add_special_tokens=False)
    c = grammar.Constraint(g, lltok, 0)
    rows = torch.zeros(len(forbidden) + 1, 49152)
    rows[:, forbidden[0]] = 50.0  # the model is sure of the first draft; the grammar allows it
    rows[1, forbidden[1]] = 50.0
    accepted, token, _ = Sampler(SamplingParams()).verify(rows, forbidden, 0, c)
    assert accepted == 1 and token != forbidden[1] and c.taken == 1  # the forbidden draft is rejected


@pytest.fixture(scope="module")
def whole(tokenizer):
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    art = open_artifact("smollm2")
    ep = ShardEndpoint(Shard(art, 0, 30, get_recipe("native", art)), "m", "r")
    ep.tokenizer = tokenizer  # a tail keeps the tokenizer (meshd/node/slot.py)
    return ep


def run(ep: ShardEndpoint, sid: bytes, ids: list[int], g: str, tokens: int, drafts_of=None, temperature=0.0):
    ep.handle(w.OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=30, model_fingerprint="m",
                            recipe_fingerprint="r", max_length=len(ids) + tokens + 8, temperature=temperature,
                            seed=7, grammar=g, grammar_from=len(ids)))
    (tok,) = ep.handle(token_frame(sid, 0, 0, w.Phase.PREFILL, 0, ids))
    out = [tok.token_id]
    while len(out) < tokens and out[-1] != 2:
        pos = len(ids) + len(out) - 1
        drafts = drafts_of(out) if drafts_of else []
        (reply,) = ep.handle(token_frame(sid, 0, len(out), w.Phase.VERIFY if drafts else w.Phase.DECODE, pos,
                                         [out[-1], *drafts]))
        assert isinstance(reply, w.Token), reply
        out += [*drafts[:reply.accepted], reply.token_id]
    ep.handle(w.Close(session_id=sid, epoch=0))
    return out[:out.index(2) + 1] if 2 in out else out  # an entry takes nothing past a stop token


@pytest.mark.slow
def test_a_shard_sampling_under_a_schema_writes_valid_json_with_and_without_drafts(whole, tokenizer):
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    plain = run(whole, b"p" * 16, ids, g, 80)
    assert plain[-1] == 2  # the grammar ended it with end-of-sequence
    doc = json.loads(tokenizer.decode(plain[:-1]))
    jsonschema.validate(doc, SCHEMA)
    # drafts: a wrong one (rejected, and its rollback must leave the grammar where the text is) and the
    # text's own next tokens (accepted): the same text either way
    wrong = run(whole, b"q" * 16, ids, g, 80, drafts_of=lambda out: [tokenizer.encode("}", add_special_tokens=False)[0]])
    right = run(whole, b"r" * 16, ids, g, 80, drafts_of=lambda out: plain[len(out):len(out) + 3])
    assert wrong == plain and right == plain
    sampled = [run(whole, s * 16, ids, g, 80, temperature=0.9) for s in (b"s", b"t")]
    assert sampled[0] == sampled[1]  # seeded
    jsonschema.validate(json.loads(tokenizer.decode(sampled[0][:-1])), SCHEMA)


@pytest.mark.slow
def test_a_middle_hop_carries_the_fed_ids_to_the_tail(whole, tokenizer):
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    art = open_artifact("smollm2")
    g = llguidance.LLMatcher.grammar_from_json_schema({"enum": ["yes", "no"]})
    head, tail = whole, ShardEndpoint(Shard(art, 15, 30, get_recipe("native", art)), "m", "r")
    (refused,) = tail.handle(w.OpenSession(request_id=1, session_id=b"n" * 16, epoch=0, start=15, end=30,
                                           model_fingerprint="m", recipe_fingerprint="r", grammar=g))
    assert refused.code == w.ErrorCode.BAD_FRAME and "no tokenizer" in refused.message  # and nothing held
    assert not tail.sessions
    tail.tokenizer = tokenizer
    sid = b"h" * 16
    for ep, (a, b), gr in ((head, (0, 15), g), (tail, (15, 30), g)):
        assert isinstance(ep.handle(w.OpenSession(request_id=1, session_id=sid, epoch=0, start=a, end=b,
                                                  model_fingerprint="m", recipe_fingerprint="r", max_length=64,
                                                  grammar=gr, grammar_from=3))[0], w.Opened)
    (fwd,) = head.handle(token_frame(sid, 0, 0, w.Phase.PREFILL, 0, [1, 2, 3]))
    assert [t.name for t in fwd.tensors] == ["hidden", FED]
    (tok,) = tail.handle(fwd)
    (fwd,) = head.handle(token_frame(sid, 0, 1, w.Phase.DECODE, 3, [tok.token_id]))
    tail.handle(fwd)
    assert tail.sessions[(sid, 0)].constraint.taken == 1
    without = w.Forward(**{**{n: getattr(fwd, n) for n, _ in fwd.FIELD_CHECKS}, "position": 4,
                           "tensors": fwd.tensors[:1]})
    (err,) = tail.handle(without)
    assert err.code == w.ErrorCode.BAD_FRAME and "fed" in err.message
