"""Phi-3 (meshd/shard/phi3.py, longrope in rope.py) on a tiny random Phi3ForCausalLM, from its HF directory and
from a GGUF file written as llama.cpp's converter writes it: split three ways it gives transformers' greedy
tokens and logits up to the pretraining context, where longrope's short factors hold; past it, `meshd local`
in one shard and in three gives the tokens of transformers' `generate`, for a prompt already longer and for a
generation that grows past it (computed anew on the long table). The entry's side of the switch is pure
state (`Generation`), tested here without a mesh; tests/test_phi3_mesh.py runs it on three daemons."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from meshd.entry.local import LocalPipeline
from meshd.entry.state import Generation
from meshd.hop.endpoint import ShardEndpoint
from meshd.shard import rope
from meshd.shard.artifact import open_artifact
from meshd.shard.config import ModelConfig, UnsupportedArchitecture
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
from meshd.wire import Error, ErrorCode, OpenSession, Opened
from tests import tiny_models
from tests.test_shard_tiny import LOGIT_ATOL, reference_run, split_run, three_way

QT = tiny_models.gguf.GGMLQuantizationType
ORIGINAL = 64  # the pretraining context; the model's is 256 (scale 4, attention factor sqrt(1 + ln 4 / ln 64))
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, tiny_models.VOCAB, 40)]
STEPS = ORIGINAL - len(PROMPT)  # the last step's forward covers positions 0..63: the short factors throughout


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    model = tiny_models.tiny_phi3(seed=31, original=ORIGINAL)
    model.save_pretrained(d / "hf")
    tiny_models.write_phi3_gguf(model, d / "tiny.gguf")
    return model, d


@pytest.fixture(scope="module")
def reference(phi3):
    return reference_run(phi3[0], PROMPT, STEPS)


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_three_way_split_matches_transformers_up_to_the_pretraining_context(phi3, reference, source):
    model, d = phi3
    art = open_artifact(d / source)
    c = art.config
    assert (c.arch, c.family, c.max_positions) == ("phi3", "phi3", 256)  # the long table reaches the context
    s = c.rope_scaling
    assert (s.kind, s.factor, s.original_context) == ("longrope", 4.0, ORIGINAL)
    assert s.attention_factor == model.model.rotary_emb.attention_scaling
    tokens, logits = split_run(three_way(art), PROMPT, STEPS)
    assert tokens == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, reference[1]))
    assert worst < LOGIT_ATOL, worst


def test_tables_carry_the_reference_bits(phi3):
    """cos and sin of every position below the switch equal transformers' short ones, and of every position of
    the context its long ones (a forward reaching past the switch: the long factors), attention factor included."""
    model, d = phi3
    emb = model.model.rotary_emb
    with torch.inference_mode():
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(ORIGINAL)[None])
        long_cos, long_sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(256)[None])
    assert not torch.equal(long_cos[0, :ORIGINAL], cos[0])
    for source in ("hf", "tiny.gguf"):
        shard = Shard(open_artifact(d / source), 0, 1)
        short, long = shard.rotaries[rope.SHORT], shard.rotaries[rope.LONG]
        short.cover(ORIGINAL)
        long.cover(256)
        assert torch.equal(short.cos[:ORIGINAL], cos[0]), source
        assert torch.equal(short.signed_sin[:ORIGINAL, 8:], sin[0, :, 8:]), source
        assert torch.equal(long.cos[:256], long_cos[0]), source
        assert torch.equal(long.signed_sin[:256, 8:], long_sin[0, :, 8:]), source
        with pytest.raises(rope.PastContext, match="short table"):
            short.cover(ORIGINAL + 1)


def test_the_scaling_matters_at_these_positions(phi3, reference):
    """The same weights with plain RoPE are far off: the parity above would catch longrope ignored."""
    model, _ = phi3
    plain = tiny_models.tiny_phi3(seed=31, longrope=False, original=ORIGINAL)
    plain.load_state_dict(model.state_dict())
    with torch.inference_mode():
        out = plain(torch.tensor([PROMPT])).logits[0, -1]
    assert float((out - reference[1][0]).abs().max()) > 1000 * LOGIT_ATOL


def test_quantized_gguf_in_both_lanes(tmp_path):
    """Q8_0 fused weights: the exact lane follows transformers; the native lane (the Llama layer in the block
    kernel) split three ways equals one native process."""
    model = tiny_models.tiny_phi3(seed=32, original=ORIGINAL)
    tiny_models.quantize_linear_weights(model, QT.Q8_0)
    art = open_artifact(tiny_models.write_phi3_gguf(model, tmp_path / "q8.gguf", qtype=QT.Q8_0))
    ref_tokens, ref_logits = reference_run(model, PROMPT, 8)
    tokens, logits = split_run(three_way(art), PROMPT, 8)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
    one = split_run([Shard(art, 0, 6, NATIVE)], PROMPT, 8)
    split = split_run([Shard(art, a, b, NATIVE) for a, b in ((0, 1), (1, 4), (4, 6))], PROMPT, 8)
    assert split[0] == one[0] and all(torch.equal(a, b) for a, b in zip(split[1], one[1]))
    assert float((one[1][0] - logits[0]).abs().max()) < 0.08 * float(logits[0].abs().max())


# --- past the pretraining context: transformers' generate, in one shard and in three ---

LONG_PROMPT = PROMPT * 2  # 80 positions: transformers rotates all of them with the long factors
CASES = {"long prompt": (LONG_PROMPT, 12), "crossing": (PROMPT, 40)}  # 40 + 40: the switch at token 25


@pytest.fixture(scope="module")
def generated(phi3):
    """transformers' `generate` (greedy, with its KV cache: Phi-3 drops it when the sequence first passes
    the switch) for each case."""
    model, _ = phi3
    out = {}
    with torch.inference_mode():
        for case, (ids, n) in CASES.items():
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
            assert len(tokens) == n, "the reference stopped at its end of sequence: pick another seed"
            out[case] = tokens
    return out


@pytest.mark.parametrize("split", ["", "2,4"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_meshd_local_past_the_switch_gives_transformers_generate(phi3, generated, source, case, split):
    _, d = phi3
    ids, n = CASES[case]
    pipeline = LocalPipeline(str(d / source), split, "exact")
    gen = pipeline.start(ids, n)
    tokens = []
    for token in pipeline.generate(ids, n, generation=gen):
        tokens.append(token)
        assert all(len(e.sessions) == 1 for e in pipeline.endpoints)  # the short ones went at the switch
    assert tokens == generated[case]
    switched_at = 0 if case == "long prompt" else ORIGINAL - len(PROMPT) + 1
    stats = gen.stats()
    assert (stats["rope_table"], stats["rope_switched_at"]) == ("long", switched_at)


def test_the_switch_matters_for_these_tokens(phi3, generated):
    """Keeping the short table's cache past the switch (new positions on the long table) parts from
    transformers at the switch: the crossing test above would catch a switch without computing anew."""
    model, _ = phi3
    from transformers import DynamicCache

    seq = list(PROMPT)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([seq]), cache=cache, use_cache=True)
        kept = []
        for _ in range(CASES["crossing"][1]):
            kept.append(int(out.logits[0, -1].argmax()))
            seq.append(kept[-1])
            out = model(torch.tensor([[kept[-1]]]), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[len(seq) - 1]]))
    switch = ORIGINAL - len(PROMPT) + 1
    assert kept[:switch] == generated["crossing"][:switch] and kept != generated["crossing"]


def test_native_lane_split_three_ways_equals_one_process_past_the_switch(tmp_path):
    """Q8_0 weights in the block kernel: both tables in the kernel's RoPE, one shard and three agree."""
    model = tiny_models.tiny_phi3(seed=32, original=ORIGINAL)
    tiny_models.quantize_linear_weights(model, QT.Q8_0)
    path = str(tiny_models.write_phi3_gguf(model, tmp_path / "q8.gguf", qtype=QT.Q8_0))
    for ids, n in CASES.values():
        one = list(LocalPipeline(path, "", NATIVE).generate(ids, n))
        assert list(LocalPipeline(path, "1,4", NATIVE).generate(ids, n)) == one


def test_sessions_on_both_tables_share_a_pass_and_keep_their_solo_bits(phi3):
    model, d = phi3
    shard = Shard(open_artifact(d / "hf"), 0, 6)
    solo = {}
    for table in (rope.SHORT, rope.LONG):
        shard.open_session(("solo", table), table=table)
        solo[table] = shard.forward(("solo", table), torch.tensor([PROMPT]), 0)
        shard.open_session(("both", table), table=table)
    both = shard.forward_batch([(("both", t), torch.tensor([PROMPT]), 0) for t in (rope.SHORT, rope.LONG)])
    assert torch.equal(both[0], solo[rope.SHORT]) and torch.equal(both[1], solo[rope.LONG])
    assert not torch.equal(solo[rope.SHORT], solo[rope.LONG])
    assert shard.session_table(("both", rope.LONG)) == rope.LONG


# --- refusals: a short session past the switch, a table the model lacks ---

@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_a_short_session_past_the_switch_is_refused_by_name(phi3, source):
    """A short session never rotates positions past the switch with the short factors (transformers never
    does): the entry opens such a sequence on the long table."""
    model, d = phi3
    shards = three_way(open_artifact(d / source))
    with pytest.raises(rope.PastContext, match="longrope session's short table.*long table"):
        split_run(shards, LONG_PROMPT, 1, key="long")


def test_a_table_the_model_lacks_is_refused_at_open(phi3, tmp_path):
    model, d = phi3
    plain = tiny_models.tiny_phi3(seed=31, longrope=False, original=ORIGINAL)
    plain.save_pretrained(tmp_path)
    msg = OpenSession(request_id=1, session_id=b"s" * 16, epoch=0, start=0, end=6, model_fingerprint="m",
                      recipe_fingerprint="r", rope_table=rope.LONG)
    (reply,) = ShardEndpoint(Shard(open_artifact(tmp_path), 0, 6), "m", "r").handle(msg)
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FRAME and "RoPE table 1" in reply.message
    endpoint = ShardEndpoint(Shard(open_artifact(d / "hf"), 0, 6), "m", "r")
    (reply,) = endpoint.handle(replace(msg, rope_table=2))
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FRAME and not endpoint.sessions
    (reply,) = endpoint.handle(msg)
    assert isinstance(reply, Opened) and endpoint.shard.session_table((msg.session_id, 0)) == rope.LONG


def test_transformers_past_the_switch_is_not_a_per_position_rotation(phi3):
    """Why a sequence past the switch is computed anew: at 80 positions transformers rotates position 0 with
    the long factors, so the first 40 positions' hidden states differ from those of a 40-position forward."""
    model, _ = phi3
    with torch.inference_mode():
        short = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
        long = model(torch.tensor([LONG_PROMPT]), output_hidden_states=True).hidden_states[-1][0, :len(PROMPT)]
    assert float((short - long).abs().max()) > 1000 * LOGIT_ATOL


# --- the entry's side: which table a generation's sessions open with, and what they compute ---

class CountingDrafts:
    """Drafts that propose as many as they may (the room the generation gives them)."""

    computes = False

    def __init__(self) -> None:
        self.rooms: list[int] = []

    def propose(self, context: list[int], room: int) -> list[int]:
        self.rooms.append(room)
        return [7] * max(0, room)


def test_a_prompt_past_the_switch_opens_on_the_long_table():
    gen = Generation.start(list(range(65)), 10, 256, switch=64)
    assert gen.rope_table == rope.SHORT and gen.past_switch
    assert gen.take_table() and not gen.take_table()  # switched once
    assert (gen.rope_table, gen.long_from, gen.prefill_ids, gen.fed_back) == (rope.LONG, 0, list(range(65)), [])
    at_switch = Generation.start(list(range(64)), 10, 256, switch=64)
    assert not at_switch.take_table() and at_switch.rope_table == rope.SHORT  # 64 positions: the short table


def test_a_generation_switches_when_its_next_position_is_past_the_short_table():
    gen = Generation.start(list(range(40)), 100, 256, switch=64)
    gen.take_table()
    for t in range(24):  # the 24th token is fed at position 63, the short table's last
        gen.accept(t)
        assert not gen.past_switch
    gen.accept(24)  # to be fed at position 64
    assert gen.past_switch and gen.take_table()
    assert gen.prefill_ids == list(range(40)) + list(range(25)) and gen.fed_back == []  # all of it, anew
    for t in range(25, 30):
        gen.accept(t)
    assert not gen.past_switch  # long from here on: a reroute prefills the same and replays the rest
    assert gen.prefill_ids == list(range(40)) + list(range(25)) and gen.fed_back == list(range(25, 30))
    assert gen.stats()["rope_switched_at"] == 25
    plain = Generation.start(list(range(300)), 4, 4096)  # a model with one table never switches
    plain.accept(1)
    assert not plain.take_table() and "rope_table" not in plain.stats() and plain.fed_back == [1]


def test_drafts_of_a_short_session_stop_at_the_switch():
    gen = Generation.start(list(range(40)), 100, 256, switch=64)
    gen.drafts = CountingDrafts()
    for t in range(20):
        gen.accept(t)
    assert len(gen.propose()) == 4  # the step feeds position 59 and drafts 60..63
    for t in range(4):
        gen.accept(t)
    assert gen.propose() == []  # position 63 is the short table's last
    gen.accept(1)
    gen.take_table()
    assert len(gen.propose()) == 100 - 25 - 1  # on the long table only the length limits them


def _config(**extra):
    doc = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
           "original_max_position_embeddings": 64, **extra}
    return json.loads(json.dumps(doc))


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "'su'"),
    ({"rope_scaling": {"type": "yarn", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "'yarn'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": "1", "long_factor": [2.0] * 8}}, "short_factor"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
])
def test_hf_phi3_rope_it_cannot_compute_is_refused_by_name(extra, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        ModelConfig.from_hf(_config(**extra))


def test_plain_phi3_takes_its_defaults_and_window():
    doc = _config(sliding_window=47)
    del doc["max_position_embeddings"]  # Phi3Config's 4096, cut to the window
    c = ModelConfig.from_hf(doc)
    assert (c.family, c.rope_scaling.kind, c.max_positions, c.eos_id) == ("phi3", "default", 47, 32000)
