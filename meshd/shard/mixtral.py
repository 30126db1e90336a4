"""Mixtral model math: Llama's attention with a mixture of experts in place of the MLP.

Rules: attention is Llama's to the row (GGUF Q/K rows permuted as llama.cpp stores them for arch `llama`); every
layer routes each token to its top-k experts with a softmax over all experts' logits renormalised over the
chosen ones, which equals a softmax over the chosen logits alone (Mixtral's routing); the experts run as
Qwen3-MoE's do (`qwen3.MoE`). A GGUF file spells Mixtral as arch `llama` with expert tensors (stacked in 3-D);
a Hugging Face checkpoint as `block_sparse_moe.experts.{e}.w1/w2/w3`. Like `llama`, this module knows
nothing of sessions or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshd.shard import llama
from meshd.shard.config import ModelConfig
from meshd.shard.linear import Weight, load_expert_matrices, load_matrix
from meshd.shard.qwen3 import DenseMLP, MoE
from meshd.shard.rows import Rows

global_names, load_head, embed, load_tail, final = (llama.global_names, llama.load_head, llama.embed,
                                                     llama.load_tail, llama.final)


@dataclass
class MixtralLayer:
    attn_norm: torch.Tensor
    wqkv: Weight
    wo: Weight
    ffn_norm: torch.Tensor
    mlp: MoE


def source_names(kind: str, i: int, cfg: ModelConfig) -> dict[str, str]:
    attention = {k: v for k, v in llama.source_names(kind, i, cfg).items() if k not in ("gate", "up", "down")}
    if kind == "gguf":
        p = f"blk.{i}."
        return attention | {"router": p + "ffn_gate_inp.weight", "gate": p + "ffn_gate_exps.weight",
                            "up": p + "ffn_up_exps.weight", "down": p + "ffn_down_exps.weight"}
    p = f"model.layers.{i}.block_sparse_moe."
    names = attention | {"router": p + "gate.weight"}
    for e in range(cfg.n_experts):  # w1: gate, w3: up, w2: down
        names |= {f"gate.{e}": f"{p}experts.{e}.w1.weight", f"up.{e}": f"{p}experts.{e}.w3.weight",
                  f"down.{e}": f"{p}experts.{e}.w2.weight"}
    return names


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    return list(source_names(kind, i, cfg).values())


def load_layer(artifact, i: int, recipe) -> MixtralLayer:
    cfg = artifact.config
    n = source_names(artifact.kind, i, cfg)
    heads = {n["q"]: cfg.n_heads, n["k"]: cfg.n_kv_heads}
    permuted = artifact.kind == "gguf"

    def rows(name, a):
        return llama.unpermute_rope(a, heads[name]) if permuted and name in heads else a

    vector = lambda key: torch.from_numpy(np.ascontiguousarray(artifact.read(n[key]))).float()  # noqa: E731
    if artifact.kind == "gguf":  # experts stacked in 3-D tensors
        gate_up = load_expert_matrices(artifact, [n["gate"], n["up"]], recipe)
        experts = [DenseMLP(a, b) for a, b in zip(gate_up, load_expert_matrices(artifact, [n["down"]], recipe))]
    else:
        experts = [DenseMLP(load_matrix(artifact, [n[f"gate.{e}"], n[f"up.{e}"]], recipe),
                            load_matrix(artifact, [n[f"down.{e}"]], recipe)) for e in range(cfg.n_experts)]
    router = load_matrix(artifact, [n["router"]], recipe)
    return MixtralLayer(attn_norm=vector("attn_norm"), wqkv=load_matrix(artifact, [n["q"], n["k"], n["v"]], recipe, rows),
                        wo=load_matrix(artifact, [n["o"]], recipe), ffn_norm=vector("ffn_norm"),
                        mlp=MoE(router, experts, cfg.experts_per_token, norm_topk=True))


def layer_forward(p: MixtralLayer, x: torch.Tensor, cfg: ModelConfig, rotary: llama.Rotary, rows: Rows,
                  li: int) -> torch.Tensor:
    """One decoder layer over x [1, R, hidden], the stacked positions of `rows`' sessions."""
    nh, nkv, hd, r = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, x.shape[1]
    h = llama.rms_norm(x, p.attn_norm, cfg.norm_eps)
    qkv = rows.linear(h, p.wqkv)
    qk = rotary.apply_rows(qkv[..., :(nh + nkv) * hd].view(1, r, nh + nkv, hd).transpose(1, 2), rows)
    v = qkv[..., (nh + nkv) * hd:].view(1, r, nkv, hd).transpose(1, 2)
    x = x + rows.linear(llama.attend(qk[:, :nh], qk[:, nh:], v, rows, li), p.wo)
    return x + p.mlp(llama.rms_norm(x, p.ffn_norm, cfg.norm_eps), rows)
