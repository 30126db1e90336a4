"""Gemma 3 model math (Gemma3ForCausalLM, GGUF `gemma3`): what differs from Llama, in its own code.

Rules: every RMSNorm multiplies by (1 + w): a Hugging Face checkpoint stores w, so meshd adds the one (in
float32, as transformers does); llama.cpp's converter stores 1 + w already, so a GGUF's norms are taken as
they are. A block has four norms (input, post-attention, pre-feedforward, post-feedforward) and Q/K
norms per head; the MLP is GeGLU with tanh-approximated GELU; the embedding rows are scaled by
sqrt(hidden) in float32 (transformers' scale cast to a float32 model's dtype). Sliding layers attend
over the last `sliding_window` positions only and rotate with their own RoPE base; global layers attend
over everything with the model's RoPE (and scaling). Scores are scaled by query_pre_attn_scalar ** -0.5;
logits are soft-capped when the config says so. GGUF Q/K rows are in Hugging Face order (no permutation).
Like `llama`, this module knows nothing of sessions or the network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshd.shard import blocks, llama
from meshd.shard.config import ModelConfig
from meshd.shard.linear import Weight, load_matrix, load_table, lookup
from meshd.shard.rope import RopeScaling
from meshd.shard.rows import Rows

global_names = llama.global_names


@dataclass
class Gemma3Layer:
    attn_norm: torch.Tensor
    wqkv: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wo: Weight
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: Weight
    w_down: Weight
    post_ffn_norm: torch.Tensor
    sliding: bool  # attends over the last `sliding_window` positions, with the local RoPE


NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")


def source_names(kind: str, i: int, cfg: ModelConfig) -> dict[str, str]:
    if kind == "gguf":
        names = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                 "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
                 "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
                 "post_ffn_norm": "post_ffw_norm"}
        return {k: f"blk.{i}.{v}.weight" for k, v in names.items()}
    names = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
             "k_norm": "self_attn.k_norm", "post_attn_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj", "post_ffn_norm": "post_feedforward_layernorm"}
    return {k: f"model.layers.{i}.{v}.weight" for k, v in names.items()}


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    return list(source_names(kind, i, cfg).values())


def _norm(artifact, name: str, recipe):
    """A norm's multiplier 1 + w, float32: read as stored from GGUF (it holds 1 + w), one added to an HF w."""
    w = torch.from_numpy(np.ascontiguousarray(artifact.read(name))).float()
    return blocks.norm_weight(w if artifact.kind == "gguf" else 1.0 + w, recipe)


def load_layer(artifact, i: int, recipe) -> Gemma3Layer:
    cfg = artifact.config
    n = source_names(artifact.kind, i, cfg)
    norms = {key: _norm(artifact, n[key], recipe) for key in NORMS}
    return Gemma3Layer(**norms, wqkv=load_matrix(artifact, [n["q"], n["k"], n["v"]], recipe),
                       wo=load_matrix(artifact, [n["o"]], recipe),
                       w_gate_up=load_matrix(artifact, [n["gate"], n["up"]], recipe),
                       w_down=load_matrix(artifact, [n["down"]], recipe), sliding=i in cfg.sliding_layers)


@dataclass
class Rotaries:
    full: llama.Rotary  # global layers: the model's base and scaling
    local: llama.Rotary  # sliding layers: their own base, unscaled


def rotary(cfg: ModelConfig, *rope_tensors: torch.Tensor) -> Rotaries:
    local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=RopeScaling())
    return Rotaries(llama.Rotary(cfg, cfg.max_positions, *rope_tensors), llama.Rotary(local, cfg.max_positions))


def layer_forward(p: Gemma3Layer, x: torch.Tensor, cfg: ModelConfig, rotaries: Rotaries, rows: Rows,
                  li: int) -> torch.Tensor:
    """One decoder layer over x [1, R, hidden], the stacked positions of `rows`' sessions. Matmul outputs go
    to float32 first (the native lane's int4 kernel returns bfloat16), so norms, GELU and RoPE run in float32."""
    nh, nkv, hd, r, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, x.shape[1], cfg.norm_eps
    qkv = rows.linear(llama.rms_norm(x, p.attn_norm, eps), p.wqkv).float()
    q = llama.rms_norm(qkv[..., :nh * hd].view(1, r, nh, hd), p.q_norm, eps)
    k = llama.rms_norm(qkv[..., nh * hd:(nh + nkv) * hd].view(1, r, nkv, hd), p.k_norm, eps)
    v = qkv[..., (nh + nkv) * hd:].view(1, r, nkv, hd).transpose(1, 2)
    rot = rotaries.local if p.sliding else rotaries.full
    q, k = rot.apply_rows(q.transpose(1, 2), rows), rot.apply_rows(k.transpose(1, 2), rows)
    window = cfg.sliding_window if p.sliding else 0
    a = rows.linear(attend(q, k, v, rows, li, cfg, window), p.wo).float()
    x = x + llama.rms_norm(a, p.post_attn_norm, eps)
    gate, up = rows.linear(llama.rms_norm(x, p.ffn_norm, eps), p.w_gate_up).float().chunk(2, dim=-1)
    m = rows.linear(F.gelu(gate, approximate="tanh") * up, p.w_down).float()
    return x + llama.rms_norm(m, p.post_ffn_norm, eps)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows, li: int, cfg: ModelConfig,
           window: int) -> torch.Tensor:
    """Attention of every session over its own KV (keys more than `window` - 1 positions back masked, when
    `window`): q [1, heads, R, hd], k and v [1, kv heads, R, hd] in; [1, R, heads * hd] out. Each session's
    new keys and values go into its cache at layer li first."""
    heads, r, hd = q.shape[1], q.shape[2], q.shape[3]
    outs = []
    for seg, qs, ks, vs in zip(rows.segments, rows.split_heads(q), rows.split_heads(k), rows.split_heads(v)):
        keys, values = seg.kv.append(li, ks, vs, seg.position)
        first = seg.kv.first(li)  # a windowed layer's cache holds positions from `first` on (kv.py)
        if blocks.attends(qs, keys):
            outs.append(_kernel_attention(qs, keys, values, seg.position, window, cfg, first))
        else:
            outs.append(attention(qs.to(keys.dtype), keys, values, seg.position, window, cfg.attn_scalar ** -0.5,
                                  first))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).reshape(1, r, heads * hd)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int,
              scale: float, first: int = 0) -> torch.Tensor:
    """Causal attention of queries at pos.. over the cached keys of positions [first, pos + n), those at or
    beyond `window` positions back masked (window 0: none), scores scaled by `scale`."""
    b, heads, n, hd = q.shape
    kv_heads = keys.shape[1]
    start = max(first, pos - window + 1) if window else first  # no query reaches further back
    keys, values = keys[:, :, start - first:], values[:, :, start - first:]
    if n == 1:  # a decode step: the query heads that share a KV head go as its batch (see llama.attention)
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads, hd), keys, values, scale=scale)
        return out.view(b, heads, 1, hd)
    qpos = torch.arange(pos, pos + n)[:, None]
    kpos = torch.arange(start, pos + n)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads)


def _kernel_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, window: int,
                      cfg: ModelConfig, first: int = 0) -> torch.Tensor:
    """`attention` in the block kernel (float32 queries over bfloat16 KV), every row as its decode step
    computes it: rows whose window reaches back to key 0 in one call, each later row over its own window
    (the same keys in the same order wherever the cache starts). The kernel scales by head_dim ** -0.5;
    another query_pre_attn_scalar scales the queries first."""
    if cfg.attn_scalar != cfg.head_dim:
        q = q * float((cfg.head_dim / cfg.attn_scalar) ** 0.5)
    n = q.shape[2]
    if first == 0 and (not window or pos + n <= window):
        return blocks.attention(q, keys, values, pos)
    whole = max(0, window - pos) if first == 0 else 0  # rows at positions < window see every key from 0
    outs = [blocks.attention(q[:, :, :whole], keys[:, :, :pos + whole], values[:, :, :pos + whole], pos)] if whole else []
    for row in range(whole, n):
        at = pos + row
        span = slice(at - window + 1 - first, at + 1 - first)
        outs.append(blocks.attention(q[:, :, row:row + 1], keys[:, :, span], values[:, :, span], window - 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def load_head(artifact, recipe) -> dict:
    return {"embed": load_table(artifact, global_names(artifact.kind, artifact.config)["embed"], recipe),
            "scale": artifact.config.hidden ** 0.5}


def embed(head: dict, ids: torch.Tensor, pos: int, dtype: torch.dtype) -> torch.Tensor:
    """Embedding rows times sqrt(hidden), the scale rounded to float32 as transformers' buffer is."""
    return (lookup(head["embed"], ids) * torch.tensor(head["scale"], dtype=torch.float32)).to(dtype)


def load_tail(artifact, recipe, head: dict | None = None) -> dict:
    names = global_names(artifact.kind, artifact.config)
    return {"final_norm": _norm(artifact, names["final_norm"], recipe),
            "lm_head": llama.lm_head(artifact, recipe, names, head)}


def final(tail: dict, x: torch.Tensor, cfg: ModelConfig, rows: Rows) -> torch.Tensor:
    """Logits [1, sessions, vocab] of the last rows x [1, sessions, hidden], soft-capped when the model is."""
    logits = rows.linear(llama.rms_norm(x, tail["final_norm"], cfg.norm_eps), tail["lm_head"]).float()
    if cfg.final_softcap:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits
