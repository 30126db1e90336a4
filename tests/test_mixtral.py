"""Mixtral (meshd/shard/mixtral.py) on a tiny random model: top 2 of 8 experts in every layer, from a Hugging Face
directory and from GGUF written as llama.cpp's converter writes it (arch `llama` with stacked experts)."""

import json

import numpy as np
import pytest
import torch

from meshd.shard import footprint
from meshd.shard.artifact import open_artifact
from meshd.shard.config import ModelConfig, UnsupportedArchitecture
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.runtime import Shard
from tests import tiny_models
from tests.test_shard_tiny import LOGIT_ATOL, PROMPT, reference_run, split_run, three_way

QT = tiny_models.gguf.GGMLQuantizationType


@pytest.mark.parametrize("source", ["hf", "tiny.gguf", "q8.gguf"])
def test_mixtral_three_way_split_matches_transformers(tmp_path, source):
    model = tiny_models.tiny_mixtral(seed=31)
    if source == "q8.gguf":  # the reference holds exactly the weights the quantized file stores
        tiny_models.quantize_linear_weights(model)
        tiny_models.write_mixtral_gguf(model, tmp_path / source, qtype=QT.Q8_0)
    elif source == "tiny.gguf":
        tiny_models.write_mixtral_gguf(model, tmp_path / source)
    else:
        model.save_pretrained(tmp_path / source)
    artifact = open_artifact(tmp_path / source)
    cfg = artifact.config
    assert cfg.family == "mixtral" and (cfg.n_experts, cfg.experts_per_token) == (8, 2) and cfg.rope_theta == 1e6
    assert all(cfg.is_moe_layer(i) for i in range(6))
    ref_tokens, ref_logits = reference_run(model, PROMPT, 16)
    tokens, logits = split_run(three_way(artifact), PROMPT, 16)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


def test_native_split_equals_one_process_exactly(tmp_path):
    art = open_artifact(tiny_models.write_mixtral_gguf(tiny_models.tiny_mixtral(seed=32), tmp_path / "m.gguf",
                                                       qtype=QT.Q4_0))
    assert art.is_quantized and art.config.family == "mixtral"
    one_tokens, one_logits = split_run([Shard(art, 0, 6, NATIVE)], PROMPT, 16)
    tokens, logits = split_run([Shard(art, a, b, NATIVE) for a, b in ((0, 1), (1, 4), (4, 6))], PROMPT, 16)
    assert tokens == one_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, one_logits))


def test_footprint_before_loading_equals_what_a_shard_holds(tmp_path):
    model = tiny_models.tiny_mixtral(seed=33)
    model.save_pretrained(tmp_path / "hf")
    for art in (open_artifact(tmp_path / "hf"),
                open_artifact(tiny_models.write_mixtral_gguf(model, tmp_path / "m.gguf", qtype=QT.Q8_0))):
        for recipe in (EXACT, NATIVE):
            for a, b in ((0, 2), (2, 4), (4, 6), (0, 6)):
                assert footprint.weight_bytes(art, recipe, a, b) == Shard(art, a, b, recipe).weight_bytes, (art.path, a, b)


def test_softmax_then_renormalise_is_the_softmax_of_the_chosen_logits():
    """Mixtral's routing (softmax over the top-k logits) and the MoE path's (softmax over all, renormalised
    over the top k) pick the same experts with the same weights."""
    logits = torch.randn(500, 8) * 3
    probs = torch.softmax(logits, dim=-1)
    weights, chosen = torch.topk(probs, 2, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    top_logits, top = torch.topk(logits, 2, dim=-1)
    assert torch.equal(chosen, top)
    assert torch.allclose(weights, torch.softmax(top_logits, dim=-1), rtol=1e-6, atol=1e-7)


def _gguf(path, dense_layer=False, per_expert=False, **keys):
    w = tiny_models.gguf.GGUFWriter(str(path), "llama")
    for k, v in {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 32,
                 "expert_count": 8, "expert_used_count": 2, **keys}.items():
        w.add_float32(f"llama.{k}", v) if isinstance(v, float) else w.add_uint32(f"llama.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    for i in range(1 if dense_layer else 2):
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.zeros((8, 4), np.float32))
        if per_expert:  # llama.cpp's layout before stacked expert tensors: one tensor per expert
            w.add_tensor(f"blk.{i}.ffn_gate.0.weight", np.zeros((4, 4), np.float32))
    tiny_models._finish(w)
    return path


@pytest.mark.parametrize("keys, match", [
    ({"dense_layer": True}, "plain MLP layers"),
    ({"expert_gating_func": 2}, "expert_gating_func"),
    ({"expert_shared_count": 1}, "expert_shared_count"),
    ({"expert_weights_scale": 2.5}, "expert_weights_scale"),
    ({"per_expert": True}, "one tensor each"),
])
def test_routing_it_does_not_compute_is_refused_by_name(tmp_path, keys, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        open_artifact(_gguf(tmp_path / "f.gguf", **keys))


def test_a_sliding_window_bounds_the_context(tmp_path):
    """transformers masks keys more than a window back; meshd serves up to one window, where that is full
    attention."""
    model = tiny_models.tiny_mixtral(seed=34)
    model.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf(doc).max_positions == 256
    assert ModelConfig.from_hf(doc | {"sliding_window": 64}).max_positions == 64
