"""RoPE scaling (meshd/shard/rope.py) on tiny Llamas: linear, llama3 and yarn, from HF directories and from GGUF
files written as llama.cpp's converter writes them, past each scaling's knee; the refusals; the rotary
tables' bits whatever torch's threads."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshd.shard import footprint, rope
from meshd.shard.artifact import open_artifact
from meshd.shard.config import ModelConfig, UnsupportedArchitecture
from meshd.shard.llama import Rotary
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.runtime import Shard
from tests import tiny_models
from tests.test_shard_tiny import LOGIT_ATOL, reference_run, split_run, three_way

QT = tiny_models.gguf.GGMLQuantizationType
# the tiny Llama's context is 256 and its head 16 wide; a pretraining context of 32 puts the knee early,
# so the prompt's positions (up to 120, then 32 generated) are well past it
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
}
LONG_PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, tiny_models.VOCAB, 120)]
STEPS = 32


@pytest.fixture(scope="module", params=sorted(ROPES))
def scaled(request, tmp_path_factory):
    """(kind, transformers model, folder with `hf/` and `tiny.gguf`)."""
    d = tmp_path_factory.mktemp(request.param)
    model = tiny_models.tiny_llama(seed=21, rope=ROPES[request.param])
    model.save_pretrained(d / "hf")
    tiny_models.write_llama_gguf(model, d / "tiny.gguf")
    return request.param, model, d


@pytest.fixture(scope="module")
def reference(scaled):
    return reference_run(scaled[1], LONG_PROMPT, STEPS)


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_three_way_split_matches_transformers_past_the_knee(scaled, reference, source):
    kind, model, d = scaled
    artifact = open_artifact(d / source)
    expected = "freq_factors" if kind == "llama3" and source == "tiny.gguf" else kind  # llama.cpp's form
    assert artifact.config.rope_scaling.kind == expected
    tokens, logits = split_run(three_way(artifact), LONG_PROMPT, STEPS)
    assert tokens == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, reference[1]))
    assert worst < LOGIT_ATOL, worst


def test_the_scaling_matters_at_these_positions(scaled, reference):
    """Plain RoPE on the same weights is far off: the parity above would catch a scaling ignored."""
    kind, model, d = scaled
    plain = tiny_models.tiny_llama(seed=21)
    plain.load_state_dict(model.state_dict())
    with torch.inference_mode():
        out = plain(torch.tensor([LONG_PROMPT])).logits[0, -1]
    assert float((out - reference[1][0]).abs().max()) > 1000 * LOGIT_ATOL


def test_tables_carry_the_reference_bits(scaled):
    """cos and sin of every position equal transformers' rotary embedding's (attention factor included). One
    exception: llama.cpp's form of llama3 stores divisors, and base / divisor rounds apart from transformers'
    blend of two frequencies by at most an ulp of the frequency (between the knees only)."""
    kind, model, d = scaled
    cos, sin = model.model.rotary_emb(torch.zeros(1, 256, 16), torch.arange(256)[None])
    for source in ("hf", "tiny.gguf"):
        shard = Shard(open_artifact(d / source), 2, 4)
        tables = shard.rotary.cos, shard.rotary.signed_sin[:, 8:], -shard.rotary.signed_sin[:, :8]
        if shard.config.rope_scaling.kind != "freq_factors":
            assert all(torch.equal(a, b) for a, b in zip(tables, (cos[0], sin[0][:, 8:], sin[0][:, :8]))), source
            continue
        cfg = shard.config
        inv, attention = rope.inverse_frequencies(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim, *shard.rope_tensors)
        ref = model.model.rotary_emb.inv_freq
        assert attention == 1.0 and int((inv != ref).sum()) <= 2  # the medium band of this head
        assert torch.allclose(inv, ref, rtol=2.0 ** -22, atol=0)
        assert float((tables[0] - cos[0]).abs().max()) < 1e-5


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.25,
     "truncate": False},
], ids=lambda p: "-".join(f"{v}" for v in p.values()))
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_inverse_frequencies_are_transformers_bits(params, spelling):
    """Real-size configs (head 128, theta 500000, contexts of Llama 3.1 and Qwen2.5), in transformers 5's
    `rope_parameters` and 4's `rope_scaling` + `rope_theta` + `type` spellings of config.json."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    common = dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072)
    hf = LlamaConfig(**common, rope_parameters={"rope_theta": 500000.0, **params})
    ref_inv, ref_attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf)
    if spelling == "rope_parameters":
        doc = hf.to_dict()
    else:
        old = {("type" if k == "rope_type" else k): v for k, v in params.items()}
        doc = {**common, "architectures": ["LlamaForCausalLM"], "rope_scaling": old, "rope_theta": 500000.0}
    doc |= {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "intermediate_size": 64,
            "vocab_size": 32}
    cfg = ModelConfig.from_hf(json.loads(json.dumps(doc)))
    inv, attention = rope.inverse_frequencies(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim)
    assert torch.equal(inv, ref_inv) and attention == ref_attention


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_qwen3_takes_the_same_scaling(tmp_path, source):
    """Qwen3's adapter (head 32 wide, Q/K norms) runs the same rope module: yarn past the knee."""
    model = tiny_models.tiny_qwen3(seed=25, rope=ROPES["yarn"])
    if source == "hf":
        model.save_pretrained(tmp_path / source)
    else:
        tiny_models.write_qwen3_gguf(model, tmp_path / source)
    artifact = open_artifact(tmp_path / source)
    assert artifact.config.family == "qwen3" and artifact.config.rope_scaling.kind == "yarn"
    ref_tokens, ref_logits = reference_run(model, LONG_PROMPT, 16)
    tokens, logits = split_run(three_way(artifact), LONG_PROMPT, 16)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


def test_quantized_llama3_gguf_in_both_lanes(tmp_path):
    """Q8_0 weights with rope_freqs.weight: the exact lane follows transformers; the native lane (RoPE inside
    the block kernel, from the same tables) split three ways equals one native process."""
    model = tiny_models.tiny_llama(seed=22, rope=ROPES["llama3"])
    tiny_models.quantize_linear_weights(model, QT.Q8_0)
    art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "q8.gguf", qtype=QT.Q8_0))
    assert art.config.rope_scaling.kind == "freq_factors"
    ref_tokens, ref_logits = reference_run(model, LONG_PROMPT, 8)
    tokens, logits = split_run(three_way(art), LONG_PROMPT, 8)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
    one = split_run([Shard(art, 0, 6, NATIVE)], LONG_PROMPT, 8)
    split = split_run([Shard(art, a, b, NATIVE) for a, b in ((0, 1), (1, 4), (4, 6))], LONG_PROMPT, 8)
    assert split[0] == one[0] and all(torch.equal(a, b) for a, b in zip(split[1], one[1]))
    # native rounds activations to 8 bits and KV to bfloat16: near exact, measured like test_native's
    assert float((one[1][0] - logits[0]).abs().max()) < 0.08 * float(logits[0].abs().max())


def test_every_range_holds_and_counts_rope_freqs(tmp_path):
    model = tiny_models.tiny_llama(seed=23, rope=ROPES["llama3"])
    art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf", qtype=QT.Q8_0))
    factors = art.stored_bytes(rope.FREQ_FACTORS)
    assert factors == 4 * 8  # head 16: 8 frequencies, float32
    for recipe in (EXACT, NATIVE):
        for a, b in ((0, 2), (2, 4), (4, 6)):
            shard = Shard(art, a, b, recipe)
            assert [t.numel() for t in shard.rope_tensors] == [8]
            assert footprint.weight_bytes(art, recipe, a, b) == shard.weight_bytes
    owned = [footprint.owned_artifact_bytes(art, a, b) for a, b in ((0, 2), (2, 4), (4, 6))]
    assert sum(owned) == footprint.owned_artifact_bytes(art, 0, 6) + 2 * factors  # each of the three holds them


def test_a_scaled_model_s_adapter_carries_the_rope_math_version_and_plain_rope_does_not(monkeypatch):
    """A meshd that read the same file's RoPE differently (before rope_freqs.weight was read) gets another
    recipe fingerprint, so the two never share a route; plain RoPE keeps the family alone, so versions
    that compute it alike still do. Within a version the scaling is in the artifact's bytes, which the
    model fingerprint covers."""
    from dataclasses import replace

    from meshd.shard.config import ModelConfig

    plain = ModelConfig(arch="llama", family="llama", n_layers=2, hidden=8, n_heads=2, n_kv_heads=2, head_dim=4,
                        ffn=8, vocab=16, norm_eps=1e-5)
    scaled = replace(plain, rope_scaling=rope.RopeScaling(kind="freq_factors", freq_factors=rope.FREQ_FACTORS))
    assert plain.adapter == "llama" and scaled.adapter.startswith("llama+")
    now = NATIVE.fingerprint("m", scaled.adapter, "t")
    monkeypatch.setattr(rope, "MATH", "rope-0")
    assert NATIVE.fingerprint("m", scaled.adapter, "t") != now
    assert NATIVE.fingerprint("m", plain.adapter, "t") == NATIVE.fingerprint("m", "llama", "t")


# --- refusals: by name, before any weight is read ---

def _hf(tmp_path, **extra):
    doc = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
           "rope_theta": 10000.0, **extra}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                       "original_max_position_embeddings": 32}}, "'longrope'"),
    ({"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 2.0}}, "'ntk-by-parts'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "per layer type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, "factor"),
])
def test_hf_rope_it_cannot_compute_is_refused_by_name(tmp_path, extra, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        ModelConfig.from_hf(json.loads(_hf(tmp_path, **extra).joinpath("config.json").read_text()))


def _gguf(path, tensors=("token_embd.weight",), **keys):
    w = tiny_models.gguf.GGUFWriter(str(path), "llama")
    for k, v in {"block_count": 1, "embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128,
                 "context_length": 256}.items():
        w.add_uint32(f"llama.{k}", v)
    for k, v in keys.items():
        key = f"llama.{k.replace('__', '.')}"
        if isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_float32(key, v) if isinstance(v, float) else w.add_uint32(key, v)
    for name in tensors:
        w.add_tensor(name, np.ones(8 if name.startswith("rope") else (4, 4), np.float32))
    tiny_models._finish(w)
    return path


@pytest.mark.parametrize("keys, tensors, match", [
    ({"rope__scaling__type": "longrope"}, (), "'longrope'"),
    ({"rope__scaling__type": "su-per"}, (), "'su-per'"),
    ({"rope__scaling__type": "linear", "rope__scaling__factor": 2.0}, ("rope_freqs.weight",), "together with"),
    ({"rope__scaling__type": "yarn", "rope__scaling__factor": 4.0}, (), "original_context_length"),
    ({"rope__scaling__type": "yarn", "rope__scaling__factor": 4.0, "rope__scaling__original_context_length": 32,
      "rope__scaling__yarn_attn_factor": 1.2}, (), "yarn_attn_factor"),
    ({"rope__scaling__yarn_log_multiplier": 0.1}, (), "yarn_log_multiplier"),
    ({"rope__scaling__attn_factor": 0.9}, (), "attn_factor"),
    ({"rope__dimension_count": 8}, (), "dimension_count"),
    ({}, ("rope_factors_long.weight", "rope_factors_short.weight"), "rope_factors_long"),
])
def test_gguf_rope_it_cannot_compute_is_refused_by_name(tmp_path, keys, tensors, match):
    path = _gguf(tmp_path / "f.gguf", ("token_embd.weight", *tensors), **keys)
    with pytest.raises(UnsupportedArchitecture, match=match):
        open_artifact(path)


def test_gguf_neutral_keys_are_plain_rope(tmp_path):
    art = open_artifact(_gguf(tmp_path / "f.gguf", rope__scaling__type="none", rope__scaling__attn_factor=1.0,
                              rope__dimension_count=16))
    assert art.config.rope_scaling == rope.RopeScaling()


def test_rope_freqs_of_the_wrong_length_are_refused():
    bad = rope.RopeScaling("freq_factors", freq_factors=rope.FREQ_FACTORS)
    with pytest.raises(UnsupportedArchitecture, match="holds 5 factors"):
        rope.inverse_frequencies(bad, 10000.0, 16, torch.ones(5))


def test_rotary_tables_are_built_on_one_thread_whatever_torch_was_given():
    """The tables come from one torch thread (MKL's vector cos once gave one thread's half of a table
    in its low-accuracy variant in a fresh process) and torch's thread count is left as it was."""
    cfg = SimpleNamespace(head_dim=64, rope_theta=10000.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = Rotary(cfg, 4096)
        one.cover(1024)
        torch.set_num_threads(2)
        two = Rotary(cfg, 4096)
        two.cover(1024)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.cos, two.cos) and torch.equal(one.signed_sin, two.signed_sin)
