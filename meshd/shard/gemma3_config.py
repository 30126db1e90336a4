"""Gemma 3's shape, read from a Hugging Face `config.json` or GGUF metadata, as transformers and llama.cpp read it.

Rules: which layers slide, over how wide a window, and each kind's RoPE come from the config (transformers:
`layer_types`, else every 6th layer global; llama.cpp: `gemma3.attention.sliding_window`, the pattern fixed at
every 6th layer global and the local RoPE base at 10000, which its loader hard-codes). The attention scale is
`query_pre_attn_scalar ** -0.5` (llama.cpp: head_dim, or hidden / heads for the 62-layer 27B). Whatever else
changes the math is refused by name: attention logit soft-capping, bidirectional attention, another
activation, biases, a local RoPE other than plain, global scalings other than those `rope.py` computes.
"""

from __future__ import annotations

from typing import Any

from meshd.shard import rope
from meshd.shard.readings import UnsupportedArchitecture, first, opt_int

PATTERN = 6  # transformers' default and llama.cpp's fixed pattern: layers 5, 11, 17, ... attend globally
LOCAL_THETA = 10000.0  # transformers' default local base, llama.cpp's fixed one
GELU = "gelu_pytorch_tanh"


def sliding_layers(n_layers: int, window: int, layer_types=None, pattern=None) -> tuple[int, ...]:
    """The layers that attend over a sliding window: from a list of layer types, a period, or per-layer flags."""
    if not window:
        return ()
    if layer_types is not None:
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown or len(layer_types) != n_layers:
            raise UnsupportedArchitecture(f"Gemma 3 layer_types {sorted(set(layer_types))} for {n_layers} layers"
                                          " are not supported")
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if pattern is None or isinstance(pattern, (int, float)):
        period = int(pattern or PATTERN)
        return tuple(i for i in range(n_layers) if (i + 1) % period)
    flags = [bool(f) for f in pattern]
    if len(flags) != n_layers:
        raise UnsupportedArchitecture(f"a sliding-window pattern of {len(flags)} flags for {n_layers} layers")
    return tuple(i for i, f in enumerate(flags) if f)


def gemma3_from_hf(cls, c: dict[str, Any]):
    for key, neutral in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False),
                         ("attention_bias", False)):
        if c.get(key, neutral) not in (neutral, None, False):
            raise UnsupportedArchitecture(f"Gemma 3 with {key} = {c[key]!r} is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or GELU
    if act != GELU:
        raise UnsupportedArchitecture(f"Gemma 3 with activation {act!r} is not supported (only {GELU})")
    n_heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // n_heads
    max_positions = c.get("max_position_embeddings", 131072)
    params = c.get("rope_parameters") or {}
    nested = bool(params) and all(isinstance(v, dict) or v is None for v in params.values())
    if nested and set(params) - {"sliding_attention", "full_attention"}:
        raise UnsupportedArchitecture(f"RoPE parameters for layer types {sorted(params)} are not supported")
    full = dict((params.get("full_attention") if nested else params or c.get("rope_scaling")) or {})
    local = dict((params.get("sliding_attention") if nested else None) or {})
    theta = full.pop("rope_theta", None) or c.get("rope_theta") or 1e6
    local_theta = local.pop("rope_theta", None) or c.get("rope_local_base_freq") or LOCAL_THETA
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedArchitecture(f"Gemma 3 sliding layers with rope {local!r} are not supported")
    outer = {k: c[k] for k in ("partial_rotary_factor", "original_max_position_embeddings") if k in c}
    scaling = rope.from_hf({**outer, "rope_parameters": full}, max_positions)
    window = int(c.get("sliding_window") or 0)
    n_layers = c["num_hidden_layers"]
    return cls(arch="gemma3", family="gemma3", n_layers=n_layers, hidden=hidden, n_heads=n_heads,
               n_kv_heads=c.get("num_key_value_heads") or n_heads, head_dim=head_dim, ffn=c["intermediate_size"],
               vocab=c["vocab_size"], norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
               rope_scaling=scaling, max_positions=max_positions,
               tie_embeddings=bool(c.get("tie_word_embeddings", True)), bos_id=c.get("bos_token_id"),
               eos_id=first(c.get("eos_token_id")), sliding_window=window,
               sliding_layers=sliding_layers(n_layers, window, c.get("layer_types"), c.get("sliding_window_pattern")),
               local_rope_theta=float(local_theta), attn_scalar=float(c.get("query_pre_attn_scalar") or 256),
               final_softcap=float(c.get("final_logit_softcapping") or 0.0))


def gemma3_from_gguf(cls, md: dict[str, Any], tensor_names: set[str]):
    g = lambda key, default=None: md.get(f"gemma3.{key}", default)  # noqa: E731
    if g("attn_logit_softcapping"):
        raise UnsupportedArchitecture(f"GGUF key gemma3.attn_logit_softcapping = {g('attn_logit_softcapping')!r}"
                                      " is not supported")
    if any(n.endswith(".bias") for n in tensor_names):
        raise UnsupportedArchitecture("a GGUF gemma3 with bias tensors is not supported")
    n_layers, hidden, n_heads = int(g("block_count")), int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedArchitecture("a GGUF gemma3 whose value width differs from its key width")
    scaling = rope.from_gguf(md, "gemma3", tensor_names, head_dim)
    if scaling.kind not in ("default", "linear"):  # llama.cpp scales the global layers only, linearly
        raise UnsupportedArchitecture(f"a GGUF gemma3 with rope scaling {scaling.kind!r} is not supported")
    window = int(g("attention.sliding_window") or 0)
    vocab = g("vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    return cls(arch="gemma3", family="gemma3", n_layers=n_layers, hidden=hidden, n_heads=n_heads,
               n_kv_heads=int(g("attention.head_count_kv", n_heads)), head_dim=head_dim,
               ffn=int(g("feed_forward_length")), vocab=int(vocab),
               norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
               rope_theta=float(g("rope.freq_base", 1e6)), rope_scaling=scaling,
               max_positions=int(g("context_length", 131072)), tie_embeddings="output.weight" not in tensor_names,
               bos_id=opt_int(md.get("tokenizer.ggml.bos_token_id")),
               eos_id=opt_int(md.get("tokenizer.ggml.eos_token_id")), sliding_window=window,
               sliding_layers=sliding_layers(n_layers, window, pattern=g("attention.sliding_window_pattern")),
               local_rope_theta=LOCAL_THETA,
               attn_scalar=float(hidden // n_heads if n_layers == 62 else head_dim),
               final_softcap=float(g("final_logit_softcapping") or 0.0))
