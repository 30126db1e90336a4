"""The shard runtime on tiny random models: a three-way split equals transformers' whole model."""

import numpy as np
import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.config import UnsupportedArchitecture
from meshd.shard.runtime import Shard
from tests import tiny_models

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 1, 200]
LOGIT_ATOL = 1e-4  # float32 reference vs float32 runtime with fused matmuls


def reference_run(model, ids, n):
    """Greedy tokens and per-step last-position logits from the whole transformers model."""
    tokens, logits = [], []
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out = model(torch.tensor([seq])).logits[0, -1]
            logits.append(out)
            tokens.append(int(out.argmax()))
            seq.append(tokens[-1])
    return tokens, logits


def split_run(shards, ids, n, key="s"):
    for s in shards:
        s.open_session(key)
    tokens, logits = [], []
    x, pos = torch.tensor([ids]), 0
    for _ in range(n):
        for s in shards:
            x = s.forward(key, x, pos)
        logits.append(x)
        tokens.append(int(x.argmax()))
        pos += 1 if tokens[:-1] else len(ids)
        x = torch.tensor([[tokens[-1]]])
    for s in shards:
        s.release(key)
    return tokens, logits


def three_way(artifact, cuts=(2, 4)):
    bounds = [0, *cuts, artifact.config.n_layers]
    return [Shard(artifact, a, b) for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    model = tiny_models.tiny_llama()
    model.save_pretrained(d / "hf")
    tiny_models.write_llama_gguf(model, d / "tiny.gguf")
    return model, d


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_llama_three_way_split_matches_transformers(llama, source):
    model, d = llama
    artifact = open_artifact(d / source)
    assert artifact.config.n_layers == 6 and artifact.config.family == "llama"
    ref_tokens, ref_logits = reference_run(model, PROMPT, 32)
    tokens, logits = split_run(three_way(artifact), PROMPT, 32)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert worst < LOGIT_ATOL, worst


def test_llama_tied_embeddings_and_q8_gguf(tmp_path):
    model = tiny_models.tiny_llama(tie=True, seed=3)
    tiny_models.quantize_linear_weights(model)
    path = tiny_models.write_llama_gguf(model, tmp_path / "q8.gguf", qtype=tiny_models.gguf.GGMLQuantizationType.Q8_0)
    artifact = open_artifact(path)
    assert artifact.config.tie_embeddings
    ref_tokens, ref_logits = reference_run(model, PROMPT, 32)
    tokens, logits = split_run(three_way(artifact, (1, 5)), PROMPT, 32)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_gpt2_three_way_split_matches_transformers(tmp_path, source):
    model = tiny_models.tiny_gpt2(seed=1)
    model.save_pretrained(tmp_path / "hf")
    tiny_models.write_gpt2_gguf(model, tmp_path / "tiny.gguf")
    artifact = open_artifact(tmp_path / source)
    assert artifact.config.family == "gpt2"
    ref_tokens, ref_logits = reference_run(model, PROMPT, 32)
    tokens, logits = split_run(three_way(artifact), PROMPT, 32)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


def test_chunked_prefill_equals_one_shot(llama):
    _, d = llama
    artifact = open_artifact(d / "tiny.gguf")
    shards = three_way(artifact)
    ids = torch.tensor([PROMPT * 3])
    outs = []
    for chunk in (ids.shape[1], 5):
        for s in shards:
            s.open_session(chunk)
        for start in range(0, ids.shape[1], chunk):
            x = ids[:, start:start + chunk]
            for s in shards:
                x = s.forward(chunk, x, start)
        outs.append(x)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    w = tiny_models.gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    tiny_models._finish(w)
    with pytest.raises(UnsupportedArchitecture, match="'falcon'"):
        open_artifact(tmp_path / "f.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    with pytest.raises(UnsupportedArchitecture, match="FalconForCausalLM"):
        open_artifact(tmp_path / "hf")


def test_bad_range_and_bad_inputs(llama):
    artifact = open_artifact(llama[1] / "tiny.gguf")
    with pytest.raises(ValueError, match="not within"):
        Shard(artifact, 4, 9)
    head, mid = Shard(artifact, 0, 2), Shard(artifact, 2, 4)
    head.open_session("k")
    mid.open_session("k")
    with pytest.raises(ValueError, match="token ids must be"):
        head.forward("k", torch.tensor([[300]]), 0)
    with pytest.raises(ValueError, match="hidden states"):
        mid.forward("k", torch.zeros(1, 2, 5), 0)
    with pytest.raises(ValueError, match="skips ahead"):
        head.forward("k", torch.tensor([[3]]), 5)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_llama_family_relatives_match_transformers(tmp_path, arch):
    """Qwen2 (q/k/v biases) and Mistral share the Llama adapter: certified by the same parity test."""
    import transformers

    torch.manual_seed(11)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  initializer_range=0.15, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
        with torch.no_grad():  # biases start at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None)).eval()
    model.save_pretrained(tmp_path / "hf")
    artifact = open_artifact(tmp_path / "hf")
    assert artifact.config.family == "llama" and artifact.config.attn_bias == (arch == "qwen2")
    ref_tokens, ref_logits = reference_run(model, PROMPT, 32)
    tokens, logits = split_run(three_way(artifact), PROMPT, 32)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("source", ["hf", "tiny.gguf", "q8.gguf"])
def test_qwen3_three_way_split_matches_transformers(tmp_path, moe, source):
    """Per-head Q/K norms, head_dim != hidden / heads, and (MoE) top-2 of 4 experts with one plain MLP layer."""
    model = tiny_models.tiny_qwen3(moe=moe, seed=7)
    if source == "q8.gguf":  # the reference holds exactly the weights the quantized file stores
        tiny_models.quantize_linear_weights(model)
        tiny_models.write_qwen3_gguf(model, tmp_path / source, qtype=tiny_models.gguf.GGMLQuantizationType.Q8_0)
    elif source == "tiny.gguf":
        tiny_models.write_qwen3_gguf(model, tmp_path / source)
    else:
        model.save_pretrained(tmp_path / source)
    artifact = open_artifact(tmp_path / source)
    cfg = artifact.config
    assert cfg.family == "qwen3" and cfg.head_dim == 32 and (cfg.n_experts == 4) == moe
    assert [cfg.is_moe_layer(i) for i in range(6)] == ([True, False, True, True, True, True] if moe else [False] * 6)
    ref_tokens, ref_logits = reference_run(model, PROMPT, 32)
    tokens, logits = split_run(three_way(artifact), PROMPT, 32)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_qwen3_with_tied_embeddings_matches_transformers(tmp_path, source):
    model = tiny_models.tiny_qwen3(tie=True, seed=8)
    if source == "hf":
        model.save_pretrained(tmp_path / source)
    else:
        tiny_models.write_qwen3_gguf(model, tmp_path / source)
    artifact = open_artifact(tmp_path / source)
    assert artifact.config.tie_embeddings
    ref_tokens, ref_logits = reference_run(model, PROMPT, 16)
    tokens, logits = split_run(three_way(artifact, (1, 5)), PROMPT, 16)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
