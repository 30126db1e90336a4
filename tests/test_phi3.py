"""Phi-3 (meshd/shard/phi3.py, longrope in rope.py) on a tiny random Phi3ForCausalLM, from its HF directory and
from a GGUF file written as llama.cpp's converter writes it: split three ways it gives transformers' greedy
tokens and logits up to the pretraining context, where longrope's short factors hold; past it, a named refusal."""

import json

import numpy as np
import pytest
import torch

from meshd.entry.state import Generation, GenerationError
from meshd.shard import rope
from meshd.shard.artifact import open_artifact
from meshd.shard.config import ModelConfig, UnsupportedArchitecture
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
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
    assert (c.arch, c.family, c.max_positions) == ("phi3", "phi3", ORIGINAL)
    s = c.rope_scaling
    assert (s.kind, s.factor, s.original_context) == ("longrope", 4.0, ORIGINAL)
    assert s.attention_factor == model.model.rotary_emb.attention_scaling
    tokens, logits = split_run(three_way(art), PROMPT, STEPS)
    assert tokens == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, reference[1]))
    assert worst < LOGIT_ATOL, worst


def test_tables_carry_the_reference_bits(phi3):
    """cos and sin of every position below the switch equal transformers' (short factors, attention factor)."""
    model, d = phi3
    emb = model.model.rotary_emb
    positions = torch.arange(ORIGINAL)[None]
    with torch.inference_mode():
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)
    for source in ("hf", "tiny.gguf"):
        shard = Shard(open_artifact(d / source), 0, 1)
        shard.rotary.cover(ORIGINAL)
        assert torch.equal(shard.rotary.cos[:ORIGINAL], cos[0]), source
        assert torch.equal(shard.rotary.signed_sin[:ORIGINAL, 8:], sin[0, :, 8:]), source


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


# --- refusals: what needs longrope's long factors ---

@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_positions_past_the_pretraining_context_are_refused_by_name(phi3, source):
    model, d = phi3
    shards = three_way(open_artifact(d / source))
    long_prompt = PROMPT * 2  # 80 positions: transformers would rotate all of them with the long factors
    with pytest.raises(rope.PastContext, match="longrope.*long factors"):
        split_run(shards, long_prompt, 1, key="long")
    with pytest.raises(GenerationError, match="exceeds the context"):
        Generation.start(long_prompt, 8, shards[0].config.max_positions)
    assert Generation.start(PROMPT, 100, shards[0].config.max_positions).max_tokens == STEPS  # cut at the switch


def test_transformers_past_the_switch_is_not_a_per_position_rotation(phi3):
    """Why the refusal: at 80 positions transformers rotates position 0 with the long factors, so the first
    40 positions' hidden states differ from those of a 40-position forward (a cache cannot hold both)."""
    model, _ = phi3
    with torch.inference_mode():
        short = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
        long = model(torch.tensor([PROMPT * 2]), output_hidden_states=True).hidden_states[-1][0, :len(PROMPT)]
    assert float((short - long).abs().max()) > 1000 * LOGIT_ATOL


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
