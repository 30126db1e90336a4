"""Qwen3 and Qwen3-MoE model math: what differs from Llama, in its own code.

Rules: Q and K are RMS-normalised per head (their own weights) before RoPE; the attention width
(heads x head_dim) need not equal the hidden size; GGUF files keep Q/K rows in Hugging Face order
(no permutation). A MoE layer routes each token to its top-k experts (softmax over all experts,
optionally renormalised over the chosen ones) and runs only the experts some token chose; a shard
holds the experts of its own layers only, each stored as the recipe says. Like `llama`, this module
knows nothing of sessions or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshd.shard import llama
from meshd.shard.config import ModelConfig
from meshd.shard.linear import Weight, linear, load_expert_matrices, load_matrix, weight_tensors
from meshd.shard.rows import Rows, row_invariant

# shared with Llama: same names and math for these parts
global_names, load_head, embed, load_tail, final = (llama.global_names, llama.load_head, llama.embed,
                                                     llama.load_tail, llama.final)


@dataclass
class DenseMLP:
    w_gate_up: Weight
    w_down: Weight

    def tensors(self) -> list[torch.Tensor]:
        return weight_tensors(self.w_gate_up) + weight_tensors(self.w_down)

    def row_invariant(self) -> bool:
        return row_invariant(self.w_gate_up) and row_invariant(self.w_down)

    def __call__(self, h: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        """h's rows through the MLP; `rows` says which sessions they belong to (None: one matmul)."""
        mm = linear if rows is None else rows.linear
        gate, up = mm(h, self.w_gate_up).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, self.w_down)


@dataclass
class MoE:
    router: Weight  # [experts, hidden]
    experts: list[DenseMLP]
    top_k: int
    norm_topk: bool

    def tensors(self) -> list[torch.Tensor]:
        return weight_tensors(self.router) + [t for e in self.experts for t in e.tensors()]

    def __call__(self, h: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Each row through its top-k experts. An expert's matmul takes the rows routed to it, a
        count that depends on the batch: all rows at once only where the kernels are row-invariant."""
        if row_invariant(self.router) and all(e.row_invariant() for e in self.experts):
            return self._rows(h)
        return rows.each(lambda _, part: self._rows(part), h)

    def _rows(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        probs = torch.softmax(linear(flat, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros(flat.shape, dtype=torch.float32)  # summed in float32 whatever the lane
        for e in torch.unique(chosen).tolist():  # an expert no token chose costs nothing
            token, slot = torch.where(chosen == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.float())
        return out.reshape(h.shape)


@dataclass
class Qwen3Layer:
    attn_norm: torch.Tensor
    wqkv: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wo: Weight
    ffn_norm: torch.Tensor
    mlp: DenseMLP | MoE


def source_names(kind: str, i: int, cfg: ModelConfig) -> dict[str, str]:
    moe = cfg.is_moe_layer(i)
    if kind == "gguf":
        p = f"blk.{i}."
        names = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                 "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "ffn_norm": "ffn_norm"}
        names |= ({"router": "ffn_gate_inp", "gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
                  if moe else {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"})
        return {k: f"{p}{v}.weight" for k, v in names.items()}
    p = f"model.layers.{i}."
    names = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
             "k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm"}
    if moe:
        names["router"] = "mlp.gate"
        for e in range(cfg.n_experts):
            names |= {f"gate.{e}": f"mlp.experts.{e}.gate_proj", f"up.{e}": f"mlp.experts.{e}.up_proj",
                      f"down.{e}": f"mlp.experts.{e}.down_proj"}
    else:
        names |= {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    return {k: f"{p}{v}.weight" for k, v in names.items()}


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    return list(source_names(kind, i, cfg).values())


def load_layer(artifact, i: int, recipe) -> Qwen3Layer:
    cfg = artifact.config
    n = source_names(artifact.kind, i, cfg)
    vector = lambda key: torch.from_numpy(np.ascontiguousarray(artifact.read(n[key]))).float()  # noqa: E731
    if not cfg.is_moe_layer(i):
        mlp = DenseMLP(load_matrix(artifact, [n["gate"], n["up"]], recipe), load_matrix(artifact, [n["down"]], recipe))
    elif artifact.kind == "gguf":  # experts stacked in 3-D tensors
        gate_up = load_expert_matrices(artifact, [n["gate"], n["up"]], recipe)
        down = load_expert_matrices(artifact, [n["down"]], recipe)
        mlp = MoE(load_matrix(artifact, [n["router"]], recipe), [DenseMLP(a, b) for a, b in zip(gate_up, down)],
                  cfg.experts_per_token, cfg.norm_topk)
    else:
        experts = [DenseMLP(load_matrix(artifact, [n[f"gate.{e}"], n[f"up.{e}"]], recipe),
                            load_matrix(artifact, [n[f"down.{e}"]], recipe)) for e in range(cfg.n_experts)]
        mlp = MoE(load_matrix(artifact, [n["router"]], recipe), experts, cfg.experts_per_token, cfg.norm_topk)
    return Qwen3Layer(attn_norm=vector("attn_norm"), wqkv=load_matrix(artifact, [n["q"], n["k"], n["v"]], recipe),
                      q_norm=vector("q_norm"), k_norm=vector("k_norm"), wo=load_matrix(artifact, [n["o"]], recipe),
                      ffn_norm=vector("ffn_norm"), mlp=mlp)


def layer_forward(p: Qwen3Layer, x: torch.Tensor, cfg: ModelConfig, rotary: llama.Rotary, rows: Rows,
                  li: int) -> torch.Tensor:
    """One decoder layer over x [1, R, hidden], the stacked positions of `rows`' sessions."""
    nh, nkv, hd, r = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, x.shape[1]
    h = llama.rms_norm(x, p.attn_norm, cfg.norm_eps)
    qkv = rows.linear(h, p.wqkv)
    q = llama.rms_norm(qkv[..., :nh * hd].view(1, r, nh, hd), p.q_norm, cfg.norm_eps)
    k = llama.rms_norm(qkv[..., nh * hd:(nh + nkv) * hd].view(1, r, nkv, hd), p.k_norm, cfg.norm_eps)
    v = qkv[..., (nh + nkv) * hd:].view(1, r, nkv, hd).transpose(1, 2)
    q, k = rotary.apply_rows(q.transpose(1, 2), rows), rotary.apply_rows(k.transpose(1, 2), rows)
    x = x + rows.linear(llama.attend(q, k, v, rows, li), p.wo)
    return x + p.mlp(llama.rms_norm(x, p.ffn_norm, cfg.norm_eps), rows)
