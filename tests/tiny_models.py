"""Tiny random models made in the test: a transformers model, saved as safetensors and as GGUF.

The GGUF files follow llama.cpp's conventions (tensor names, Q/K row permutation for Llama,
Conv1D weights transposed for GPT-2), so they exercise the same loading code as real files.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

VOCAB = 256


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (HF halves -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tie: bool = False, seed: int = 0, rope: dict | None = None):
    """rope: a `rope_parameters` dict (rope_type, factor, ...) for a scaled RoPE; theta 10000 either way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rope_args = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {"rope_theta": 10000.0}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=tie, initializer_range=0.15,
                      bos_token_id=1, eos_token_id=2, **rope_args)
    return LlamaForCausalLM(cfg).eval()


def llama3_rope_freqs(theta: float, dim: int, rope: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for `llama3` scaling: per frequency the divisor
    that takes the base frequency to the scaled one (1 for short waves, `factor` for long ones, a blend
    between), computed in float32 from the config's rope dict."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen < old / high, torch.ones_like(blend),
                           torch.where(wavelen > old / low, torch.full_like(blend, factor), blend))
    return divisors.numpy().astype(np.float32)


def _write_rope(w: gguf.GGUFWriter, put, c) -> None:
    """RoPE scaling as llama.cpp's converter writes it: linear and yarn as `rope.scaling.*` keys, llama3 as
    the `rope_freqs.weight` tensor with no scaling type."""
    rope = getattr(c, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "llama3":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        put("rope_freqs.weight", llama3_rope_freqs(rope["rope_theta"], head_dim, rope))
    elif kind != "default" and kind != "longrope":  # longrope: written by the Phi-3 writer
        raise ValueError(f"llama.cpp's converter has no GGUF form for rope {kind!r}")


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=6, n_head=4, n_positions=256, initializer_range=0.15,
                     bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).eval()


def quantize_linear_weights(model, qtype=gguf.GGMLQuantizationType.Q8_0) -> None:
    """Round the model's 2-D layer weights through a GGUF quantization, in place (the reference then
    holds exactly the weights a quantized GGUF file stores)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and ".layers." in name:  # 3-D: experts stacked, quantized row by row
                q = quantize(p.numpy().astype(np.float32), qtype)
                p.copy_(torch.from_numpy(dequantize(q, qtype).reshape(p.shape)))


def _decoder_gguf(model, path: Path, arch: str, qtype):
    """A GGUF writer for a Llama-style decoder, with the metadata and the global tensors (embedding,
    final norm, untied LM head) written; returns (writer, put, state dict, config). `put(name, array,
    quantizable)` stores a tensor, quantized to `qtype` when asked and quantizable."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name, array, quantizable=False):
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype is not None and quantizable:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    _write_rope(w, put, c)
    return w, put, sd, c


def _put_llama_attention(put, sd, c, i: int) -> None:
    """Layer i's norms and attention as llama.cpp's converter writes a Llama's (Q/K rows permuted)."""
    p = f"model.layers.{i}."
    put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
    put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads), True)
    put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads), True)
    put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], True)
    put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], True)


def write_llama_gguf(model, path: Path, qtype=None) -> Path:
    w, put, sd, c = _decoder_gguf(model, path, "llama", qtype)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        _put_llama_attention(put, sd, c, i)
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], True)
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], True)
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], True)
    _finish(w)
    return path


def tiny_qwen3(moe: bool = False, tie: bool = False, seed: int = 0, vocab: int = VOCAB, rope: dict | None = None):
    """A Qwen3 (or Qwen3-MoE: 4 experts, top-2, layer 1 a plain MLP) with head_dim != hidden / heads;
    rope: a `rope_parameters` dict for a scaled RoPE (theta 10000 then)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    if rope:
        common["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    if not moe:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()
    else:
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # the per-head norms start at one: make them matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            if moe and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)  # routers start at zero: make routing real
    return model


def write_qwen3_gguf(model, path: Path, qtype=None) -> Path:
    """llama.cpp's `qwen3` / `qwen3moe` layout: Q/K rows unpermuted, experts stacked in 3-D tensors."""
    moe = getattr(model.config, "num_experts", 0) > 0
    arch = "qwen3moe" if moe else "qwen3"
    w, put, sd, c = _decoder_gguf(model, path, arch, qtype)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_bool(f"{arch}.expert_weights_norm", bool(c.norm_topk_prob))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
        put(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            put(f"blk.{i}.{ours}.weight", sd[f"{p}self_attn.{theirs}.weight"], True)
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, ff = sd[p + "mlp.experts.gate_up_proj"], c.moe_intermediate_size
            put(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
            put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :ff], True)
            put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, ff:], True)
            put(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"], True)
        else:
            for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                put(f"blk.{i}.{ours}.weight", sd[f"{p}mlp.{theirs}.weight"], True)
    _finish(w)
    return path


def tiny_mixtral(seed: int = 0, tie: bool = False):
    """A Mixtral: every layer routes to the top 2 of 8 experts (each 32 wide)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=tie, initializer_range=0.15,
                        bos_token_id=1, eos_token_id=2, sliding_window=None)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)  # a router that really chooses
    return model


def write_mixtral_gguf(model, path: Path, qtype=None) -> Path:
    """llama.cpp's form of Mixtral: arch `llama`, Q/K rows permuted, experts stacked in 3-D tensors."""
    w, put, sd, c = _decoder_gguf(model, path, "llama", qtype)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        _put_llama_attention(put, sd, c, i)
        gate_up, ff = sd[p + "mlp.experts.gate_up_proj"], c.intermediate_size
        put(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :ff], True)
        put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, ff:], True)
        put(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"], True)
    _finish(w)
    return path


def tiny_gemma3(seed: int = 0, window: int = 16, softcap: float | None = None, scalar: int = 32,
                tie: bool = True, rope: dict | None = None):
    """A Gemma 3 of 12 layers, the default pattern (layers 5 and 11 global, the rest sliding over `window`
    positions), heads 32 wide, its own RoPE base per kind; norms made non-zero so their (1 + w) matters.
    rope: a scaling for the global layers (as Gemma 3 4B+ carry one)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    full = {"rope_type": "default", "rope_theta": 1e6, **(rope or {})}
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                           rms_norm_eps=1e-6, sliding_window=window, query_pre_attn_scalar=scalar,
                           final_logit_softcapping=softcap, tie_word_embeddings=tie, initializer_range=0.15,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": full},
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model


def write_gemma3_gguf(model, path: Path, qtype=None) -> Path:
    """llama.cpp's `gemma3` layout: norms stored as 1 + w, four norms a block, Q/K rows unpermuted, no pattern
    key (llama.cpp fixes every 6th layer global) and no local RoPE base (fixed at 10000)."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    full = c.rope_parameters["full_attention"]
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])

    def put(name, array, quantizable=False):
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype is not None and quantizable:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"] + 1)
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    matrices = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in norms.items():
            put(f"blk.{i}.{ours}.weight", sd[f"{p}{theirs}.weight"] + 1)
        for ours, theirs in matrices.items():
            put(f"blk.{i}.{ours}.weight", sd[f"{p}{theirs}.weight"], True)
    _finish(w)
    return path


def write_gpt2_gguf(model, path: Path) -> Path:
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)
    put = lambda name, a: w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    put("token_embd.weight", sd["transformer.wte.weight"])
    put("position_embd.weight", sd["transformer.wpe.weight"])
    put("output_norm.weight", sd["transformer.ln_f.weight"])
    put("output_norm.bias", sd["transformer.ln_f.bias"])
    names = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
             "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    for i in range(c.n_layer):
        for ours, theirs in names.items():
            weight = sd[f"transformer.h.{i}.{theirs}.weight"]
            put(f"blk.{i}.{ours}.weight", weight if weight.ndim == 1 else weight.T)
            put(f"blk.{i}.{ours}.bias", sd[f"transformer.h.{i}.{theirs}.bias"])
    _finish(w)
    return path


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_phi3(seed: int = 0, longrope: bool = True, original: int = 64, vocab: int = VOCAB):
    """A Phi-3 (fused qkv_proj and gate_up_proj); with `longrope`, the scaling of Phi-3-mini-128k: its own
    short and long factors per frequency, a context of 256 over a pretraining context of `original`."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [float(f) for f in rng.uniform(1.0, 2.5, 8)],
            "long_factor": [float(f) for f in rng.uniform(2.0, 8.0, 8)]} if longrope else {"rope_theta": 10000.0}
    cfg = Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     original_max_position_embeddings=original, rms_norm_eps=1e-5, initializer_range=0.15,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters=rope)
    return Phi3ForCausalLM(cfg).eval()


def write_phi3_gguf(model, path: Path, qtype=None) -> Path:
    """As llama.cpp's converter writes a Phi-3: arch `phi3`, the fused tensors kept fused (`attn_qkv`,
    `ffn_up` holding gate then up), no Q/K permutation, longrope as the two factor tensors with
    `rope.scaling.attn_factor` and the pretraining context."""
    w, put, sd, c = _decoder_gguf(model, path, "phi3", qtype)
    rope = c.rope_parameters
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_sliding_window(c.sliding_window or 0)
    if rope.get("long_factor"):
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))
        put("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        put("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"], True)
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], True)
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"], True)
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], True)
    _finish(w)
    return path
