"""GPT-2 model math: learned positions, LayerNorm with bias, fused QKV with bias, GELU (tanh).

Rule: as in `llama`, only math and tensor names; weights are held in Linear (out, in) layout,
so Hugging Face's Conv1D (in, out) weights are transposed on load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshd.shard.config import ModelConfig
from meshd.shard.linear import Weight, linear, load_matrix, load_table, lookup
from meshd.shard.rows import Rows


@dataclass
class GPT2Layer:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w_qkv: Weight
    b_qkv: torch.Tensor
    wo: Weight
    bo: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    w_fc: Weight
    b_fc: torch.Tensor
    w_proj: Weight
    b_proj: torch.Tensor


_GGUF = {"ln1_w": "attn_norm.weight", "ln1_b": "attn_norm.bias", "w_qkv": "attn_qkv.weight",
         "b_qkv": "attn_qkv.bias", "wo": "attn_output.weight", "bo": "attn_output.bias",
         "ln2_w": "ffn_norm.weight", "ln2_b": "ffn_norm.bias", "w_fc": "ffn_up.weight", "b_fc": "ffn_up.bias",
         "w_proj": "ffn_down.weight", "b_proj": "ffn_down.bias"}
_HF = {"ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias", "w_qkv": "attn.c_attn.weight", "b_qkv": "attn.c_attn.bias",
       "wo": "attn.c_proj.weight", "bo": "attn.c_proj.bias", "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias",
       "w_fc": "mlp.c_fc.weight", "b_fc": "mlp.c_fc.bias", "w_proj": "mlp.c_proj.weight", "b_proj": "mlp.c_proj.bias"}
_CONV1D = {"w_qkv", "wo", "w_fc", "w_proj"}


def _hf_prefix(artifact) -> str:
    return "transformer." if artifact.has("transformer.wte.weight") else ""


def source_names(artifact, i: int) -> dict[str, str]:
    if artifact.kind == "gguf":
        return {k: f"blk.{i}.{v}" for k, v in _GGUF.items()}
    return {k: f"{_hf_prefix(artifact)}h.{i}.{v}" for k, v in _HF.items()}


def global_names(artifact) -> dict[str, str]:
    if artifact.kind == "gguf":
        lm = "output.weight" if artifact.has("output.weight") else "token_embd.weight"
        return {"embed": "token_embd.weight", "pos_embed": "position_embd.weight",
                "norm_w": "output_norm.weight", "norm_b": "output_norm.bias", "lm_head": lm}
    p = _hf_prefix(artifact)
    lm = "lm_head.weight" if artifact.has("lm_head.weight") else f"{p}wte.weight"
    return {"embed": f"{p}wte.weight", "pos_embed": f"{p}wpe.weight", "norm_w": f"{p}ln_f.weight",
            "norm_b": f"{p}ln_f.bias", "lm_head": lm}


def load_layer(artifact, i: int, recipe) -> GPT2Layer:
    out = {}
    for key, name in source_names(artifact, i).items():
        if key in _CONV1D:
            out[key] = load_matrix(artifact, [name], recipe, transpose_hf=True)
            continue
        t = torch.from_numpy(np.ascontiguousarray(artifact.read(name)))
        out[key] = t.float() if key.startswith("ln") else t.to(recipe.torch_compute)
    return GPT2Layer(**out)


def load_head(artifact, recipe) -> dict:
    names = global_names(artifact)
    return {"embed": load_table(artifact, names["embed"], recipe),
            "pos_embed": torch.from_numpy(artifact.read(names["pos_embed"]))}


def embed(head, ids: torch.Tensor, pos: int, dtype: torch.dtype) -> torch.Tensor:
    positions = torch.arange(pos, pos + ids.shape[1])
    return (lookup(head["embed"], ids) + head["pos_embed"][positions]).to(dtype)


def load_tail(artifact, recipe, head: dict | None = None) -> dict:
    names = global_names(artifact)
    if head is not None and names["lm_head"] == names["embed"] and recipe.weight_dtype == "float32":
        lm_head = head["embed"]
    else:
        lm_head = load_matrix(artifact, [names["lm_head"]], recipe)
    return {"norm_w": torch.from_numpy(artifact.read(names["norm_w"])).float(),
            "norm_b": torch.from_numpy(artifact.read(names["norm_b"])).float(), "lm_head": lm_head}


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def final(tail, x: torch.Tensor, cfg: ModelConfig, rows: Rows) -> torch.Tensor:
    h = layer_norm(x, tail["norm_w"], tail["norm_b"], cfg.norm_eps)
    return rows.linear(h, tail["lm_head"])


def layer_forward(p: GPT2Layer, x: torch.Tensor, cfg: ModelConfig, rotary, rows: Rows, li: int) -> torch.Tensor:
    from meshd.shard.llama import attend

    r, nh, hd = x.shape[1], cfg.n_heads, cfg.head_dim
    h = layer_norm(x, p.ln1_w, p.ln1_b, cfg.norm_eps)
    q, k, v = (t.view(1, r, nh, hd).transpose(1, 2) for t in rows.linear(h, p.w_qkv, p.b_qkv).split(nh * hd, dim=-1))
    x = x + rows.linear(attend(q, k, v, rows, li), p.wo, p.bo)
    h = layer_norm(x, p.ln2_w, p.ln2_b, cfg.norm_eps)
    return x + rows.linear(F.gelu(rows.linear(h, p.w_fc, p.b_fc), approximate="tanh"), p.w_proj, p.b_proj)


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    table = _GGUF if kind == "gguf" else _HF
    prefix = f"blk.{i}." if kind == "gguf" else f"transformer.h.{i}."
    return [prefix + v for v in table.values()]
