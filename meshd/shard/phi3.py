"""Phi-3 model math: Llama's, read from other names.

Rule: Phi-3 computes exactly what a Llama computes (RMSNorm, rotary attention, SiLU-gated MLP, no
biases); only its storage differs. Q, K and V are one tensor (`qkv_proj`, GGUF `attn_qkv`: Q's rows,
then K's, then V's) and gate and up another (`gate_up_proj`, GGUF `ffn_up`: gate's rows, then up's),
which are the fused matrices the Llama layer already runs. llama.cpp's converter does not permute
Phi-3's Q/K rows, so GGUF and HF rows agree. Its `longrope` scaling lives in `rope.py`.
"""

from __future__ import annotations

import numpy as np
import torch

from meshd.shard import blocks, llama
from meshd.shard.config import ModelConfig
from meshd.shard.linear import load_matrix

# shared with Llama: same math, same global tensors
global_names, load_head, embed, load_tail, final, layer_forward, layers_forward, in_kernel = (
    llama.global_names, llama.load_head, llama.embed, llama.load_tail, llama.final, llama.layer_forward,
    llama.layers_forward, llama.in_kernel)


def source_names(kind: str, i: int, cfg: ModelConfig) -> dict[str, str]:
    if kind == "gguf":
        names = {"attn_norm": "attn_norm", "qkv": "attn_qkv", "o": "attn_output", "ffn_norm": "ffn_norm",
                 "gate_up": "ffn_up", "down": "ffn_down"}
        return {k: f"blk.{i}.{v}.weight" for k, v in names.items()}
    names = {"attn_norm": "input_layernorm", "qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}
    return {k: f"model.layers.{i}.{v}.weight" for k, v in names.items()}


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    return list(source_names(kind, i, cfg).values())


def load_layer(artifact, i: int, recipe) -> llama.LlamaLayer:
    cfg = artifact.config
    n = source_names(artifact.kind, i, cfg)
    qkv_rows = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    rows = artifact.tensor_shape(n["qkv"])[0]
    if rows != qkv_rows:
        raise ValueError(f"{n['qkv']} has {rows} rows, not the {qkv_rows} of Q, K and V")
    norm = lambda key: blocks.norm_weight(  # noqa: E731
        torch.from_numpy(np.ascontiguousarray(artifact.read(n[key]))).float(), recipe)
    return llama.LlamaLayer(attn_norm=norm("attn_norm"), wqkv=load_matrix(artifact, [n["qkv"]], recipe), bqkv=None,
                            wo=load_matrix(artifact, [n["o"]], recipe), ffn_norm=norm("ffn_norm"),
                            w_gate_up=load_matrix(artifact, [n["gate_up"]], recipe),
                            w_down=load_matrix(artifact, [n["down"]], recipe))
