"""Llama-family model math (SmolLM2, TinyLlama, Llama, Mistral, Qwen2): weights and one layer's forward.

Rule: this module knows nothing of sessions, shards or the network. It reads tensors by source name
from an artifact and runs layers against a KV cache it is handed. Q, K and V share one matmul, and
gate and up another, which is the same math as the reference with fewer kernel launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshd.shard import blocks, rope
from meshd.shard.config import ModelConfig
from meshd.shard.linear import Weight, load_matrix, load_table, lookup
from meshd.shard.quant import QuantRows
from meshd.shard.rows import Rows

TABLE_START = 256  # rotary positions at first, doubled as needed


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    wqkv: Weight
    bqkv: torch.Tensor | None
    wo: Weight
    ffn_norm: torch.Tensor
    w_gate_up: Weight
    w_down: Weight
    kernel_args: tuple | None = None  # the weights as the block kernel's `layer` takes them (built once)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> halves, as in HF)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_names(artifact_kind: str, i: int, cfg: ModelConfig) -> dict[str, str]:
    if artifact_kind == "gguf":
        p = f"blk.{i}."
        names = {"attn_norm": p + "attn_norm.weight", "q": p + "attn_q.weight", "k": p + "attn_k.weight",
                 "v": p + "attn_v.weight", "o": p + "attn_output.weight", "ffn_norm": p + "ffn_norm.weight",
                 "gate": p + "ffn_gate.weight", "up": p + "ffn_up.weight", "down": p + "ffn_down.weight"}
        if cfg.attn_bias:
            names |= {"bq": p + "attn_q.bias", "bk": p + "attn_k.bias", "bv": p + "attn_v.bias"}
        return names
    p = f"model.layers.{i}."
    names = {"attn_norm": p + "input_layernorm.weight", "q": p + "self_attn.q_proj.weight",
             "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
             "o": p + "self_attn.o_proj.weight", "ffn_norm": p + "post_attention_layernorm.weight",
             "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight"}
    if cfg.attn_bias:
        names |= {"bq": p + "self_attn.q_proj.bias", "bk": p + "self_attn.k_proj.bias", "bv": p + "self_attn.v_proj.bias"}
    return names


def global_names(kind: str, cfg: ModelConfig) -> dict[str, str]:
    if kind == "gguf":
        return {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                "lm_head": "token_embd.weight" if cfg.tie_embeddings else "output.weight"}
    return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
            "lm_head": "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"}


def load_layer(artifact, i: int, recipe) -> LlamaLayer:
    cfg = artifact.config
    names = source_names(artifact.kind, i, cfg)
    heads = {names["q"]: cfg.n_heads, names["k"]: cfg.n_kv_heads}
    if cfg.attn_bias:
        heads |= {names["bq"]: cfg.n_heads, names["bk"]: cfg.n_kv_heads}
    permuted = artifact.kind == "gguf" and cfg.arch in ("llama", "mistral")

    def rows(name, a):
        return unpermute_rope(a, heads[name]) if permuted and name in heads else a

    vector = lambda key: torch.from_numpy(np.ascontiguousarray(artifact.read(names[key]))).float()  # noqa: E731
    norm = lambda key: blocks.norm_weight(vector(key), recipe)  # noqa: E731
    bqkv = None
    if cfg.attn_bias:
        bqkv = torch.from_numpy(np.concatenate([rows(names[k], artifact.read(names[k])) for k in ("bq", "bk", "bv")]))
        bqkv = bqkv.to(recipe.torch_compute)
    return LlamaLayer(
        attn_norm=norm("attn_norm"),
        wqkv=load_matrix(artifact, [names["q"], names["k"], names["v"]], recipe, rows), bqkv=bqkv,
        wo=load_matrix(artifact, [names["o"]], recipe),
        ffn_norm=norm("ffn_norm"),
        w_gate_up=load_matrix(artifact, [names["gate"], names["up"]], recipe),
        w_down=load_matrix(artifact, [names["down"]], recipe),
    )


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (float32 weights), returned in x's dtype; a `blocks.Norm` weight
    runs in the native lane's kernel."""
    if isinstance(weight, blocks.Norm):
        return weight.apply(x, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


class Rotary:
    """cos/sin tables for rotary embeddings, computed as the reference does (float32), with the model's
    RoPE scaling (`rope.py`; `freq_factors`: the tensor of factors the scaling names for `table`, a
    longrope model's short or long one).

    rotate_half(x) * sin == roll(x, half) * signed_sin, with signed_sin = [-sin, sin] per half:
    the same products and sums as the reference, in three ops instead of six. An attention factor
    (YaRN) scales both tables, as the reference scales its cos and sin. The tables reach the
    positions asked for so far (`first` at first, doubled as they grow, at most the model's context:
    128k positions of 128-wide heads would be 134 MB held from the start): a position's entries are
    elementwise functions of its index, the same bits whatever the length.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None,
                 first: int = TABLE_START, table: int = rope.SHORT) -> None:
        self._args, self.max_positions, self.table = (cfg, freq_factors), max_positions, table
        self.scaling = getattr(cfg, "rope_scaling", None) or rope.RopeScaling()
        self._build(min(max_positions, first))

    def _build(self, positions: int) -> None:
        """The tables on one torch thread: torch hands a float `cos` of this size to MKL's vector math in
        per-thread chunks, and in about 1 of 75 fresh processes on a loaded box (2 threads, the process's
        first such call) the second thread's half (positions 128-255) came out of MKL's low-accuracy
        variant, up to 1.5e-4 off: that process's text parted from every other's. One thread gives the
        usual bits."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._build_tables(positions)
        finally:
            torch.set_num_threads(threads)

    def _build_tables(self, positions: int) -> None:
        cfg, freq_factors = self._args
        inv_freq, attention = rope.inverse_frequencies(self.scaling, cfg.rope_theta, cfg.head_dim, freq_factors,
                                                       self.table)
        pos = torch.arange(positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, sin = emb.cos(), freqs.sin()
        if attention != 1.0:
            self.cos, sin = self.cos * attention, sin * attention
        self.signed_sin = torch.cat([-sin, sin], dim=-1)
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {torch.float32: (self.cos, self.signed_sin)}

    def cover(self, end: int) -> None:
        """Make the tables reach position `end` (doubling, at most `max_positions`); past them, refuse
        (`rope.PastContext`) rather than rotate with tables that do not reach."""
        if end > self.max_positions:
            raise rope.past_context(self.scaling, end, self.max_positions, self.table)
        have = self.cos.shape[0]
        if have < end:
            self._build(min(self.max_positions, max(end, 2 * have)))

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: [1, heads, n, head_dim] at positions start..start+n-1."""
        n = x.shape[2]
        self.cover(start + n)
        cos, sin = self._tables(x.dtype)
        return self._rotate(x, cos[start:start + n], sin[start:start + n])

    def apply_rows(self, x: torch.Tensor, rows) -> torch.Tensor:
        """x: [1, heads, R, head_dim], the stacked rows of `rows`' sessions, each at its positions
        (elementwise: a row gets the same bits as alone)."""
        if len(rows.segments) == 1:
            return self.apply(x, rows.segments[0].position)
        self.cover(max(seg.position + seg.n for seg in rows.segments))
        cos, sin = self._tables(x.dtype)
        at = rows.positions()
        return self._rotate(x, cos[at], sin[at])

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._by_dtype.get(dtype)
        if tables is None:
            tables = self._by_dtype[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        return tables

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def layer_forward(p: LlamaLayer, x: torch.Tensor, cfg: ModelConfig, rotary: Rotary, rows: Rows,
                  li: int) -> torch.Tensor:
    """One decoder layer over x [1, R, hidden], the stacked positions of `rows`' sessions; appends
    to each session's KV layer li."""
    if in_kernel(p):
        return _layer_forward_blocks(p, x, cfg, rotary, rows, li)
    nh, nkv, hd, r = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, x.shape[1]
    h = rms_norm(x, p.attn_norm, cfg.norm_eps)
    qkv = rows.linear(h, p.wqkv, p.bqkv)
    qk = rotary.apply_rows(qkv[..., :(nh + nkv) * hd].view(1, r, nh + nkv, hd).transpose(1, 2), rows)
    v = qkv[..., (nh + nkv) * hd:].view(1, r, nkv, hd).transpose(1, 2)
    x = x + rows.linear(attend(qk[:, :nh], qk[:, nh:], v, rows, li), p.wo)
    h = rms_norm(x, p.ffn_norm, cfg.norm_eps)
    gate, up = rows.linear(h, p.w_gate_up).chunk(2, dim=-1)
    return x + rows.linear(F.silu(gate) * up, p.w_down)


def in_kernel(p: LlamaLayer) -> bool:
    """Whether the whole layer runs in the block kernel (the native lane on Q4_0/Q4_1/Q8_0 weights)."""
    return (isinstance(p.attn_norm, blocks.Norm) and p.bqkv is None
            and all(isinstance(w, blocks.BlockWeight) for w in (p.wqkv, p.wo, p.w_gate_up, p.w_down)))


def _layer_forward_blocks(p: LlamaLayer, x: torch.Tensor, cfg: ModelConfig, rotary: Rotary, rows: Rows,
                          li: int) -> torch.Tensor:
    """`layer_forward` as one kernel call (per row: the same bits whatever the batch): the norms, the
    matmuls (the residual added inside the o and down ones), RoPE straight into each session's KV
    cache, attention per session, silu(gate) * up."""
    return _layers_in_kernel([p], x, cfg, rotary, rows, li)


def _layers_in_kernel(layers: list[LlamaLayer], x: torch.Tensor, cfg: ModelConfig, rotary: Rotary, rows: Rows,
                      first: int) -> torch.Tensor:
    """Layers in the kernel, one call for all of them, their sessions' KV at slots first, first + 1, ..."""
    y = x.reshape(x.shape[1], x.shape[2]).to(torch.float32, copy=True)
    for p in layers:
        if p.kernel_args is None:
            p.kernel_args = blocks.layer_args(p)
    rotary.cover(max(s.position + s.n for s in rows.segments))
    segments = [[(s.row, s.n, s.position, *s.kv.layer(li, s.position + s.n)) for s in rows.segments]
                for li in range(first, first + len(layers))]
    blocks.layers(y, [p.kernel_args for p in layers], cfg.norm_eps, rotary.cos, rotary.signed_sin, cfg.n_heads,
                  cfg.n_kv_heads, cfg.head_dim, segments)
    return y.view(1, x.shape[1], -1)


def layers_forward(layers: list[LlamaLayer], x: torch.Tensor, cfg: ModelConfig, rotary: Rotary, rows: Rows
                   ) -> torch.Tensor:
    """`layer_forward` through `layers` (KV slots 0, 1, ... of the sessions), in one kernel call where
    every layer runs in the kernel (the bits of the calls one by one; Python between 30 layer calls
    was a fifth of a SmolLM2 decode step), else layer by layer."""
    if not layers or not all(in_kernel(p) for p in layers):
        for li, p in enumerate(layers):
            x = layer_forward(p, x, cfg, rotary, rows, li)
        return x
    return _layers_in_kernel(layers, x, cfg, rotary, rows, 0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows, li: int) -> torch.Tensor:
    """Attention of every session over its own KV: q [1, heads, R, hd], k and v [1, kv heads, R, hd]
    (RoPE applied) in; [1, R, heads * hd] out. Each session's new keys and values go into its cache
    at layer li first."""
    heads, r, hd = q.shape[1], q.shape[2], q.shape[3]
    outs = []
    for seg, qs, ks, vs in zip(rows.segments, rows.split_heads(q), rows.split_heads(k), rows.split_heads(v)):
        keys, values = seg.kv.append(li, ks, vs, seg.position)
        if blocks.attends(qs, keys):
            outs.append(blocks.attention(qs, keys, values, seg.position))
        else:
            outs.append(attention(qs if qs.dtype == keys.dtype else qs.to(keys.dtype), keys, values, seg.position))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).reshape(1, r, heads * hd)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
    """Causal attention of queries at pos.. over all cached keys (grouped-query aware)."""
    b, heads, n, hd = q.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    if n == 1:
        # a decode step: the query heads that share a KV head go as that head's batch of queries
        # (the same sums; torch's enable_gqa path is 3-5x slower for one query in bfloat16)
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads, hd), keys, values)
        return out.view(b, heads, 1, hd)
    if pos == 0:
        mask, causal = None, True
    else:
        qpos = torch.arange(pos, pos + n)[:, None]
        mask, causal = torch.arange(total)[None, :] <= qpos, False
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                          enable_gqa=kv_heads != heads)


def load_head(artifact, recipe) -> dict:
    names = global_names(artifact.kind, artifact.config)
    return {"embed": load_table(artifact, names["embed"], recipe)}


def embed(head: dict, ids: torch.Tensor, pos: int, dtype: torch.dtype) -> torch.Tensor:
    return lookup(head["embed"], ids).to(dtype)


def lm_head(artifact, recipe, names: dict, head: dict | None = None):
    """The LM head. Tied to the embedding on a shard that is head and tail both, it is the head's table
    itself: the float32 tensor, or in the native lane the same GGUF bytes the embedding looks rows up
    in, multiplied by the block kernel (Gemma 3 270M's 262144 x 640 table is 178 MB: held once); in
    tiles where they pay, the embedding then reading its rows back out of them."""
    if head is not None and names["lm_head"] == names["embed"]:
        table = head["embed"]
        if recipe.weight_dtype == "float32":
            return table
        if isinstance(table, QuantRows) and blocks.available(table.qtype):
            if blocks.tiles_pay(table.qtype) and table.shape[0] % blocks.TILE == 0:
                table.retile()
            return blocks.BlockWeight(table.qtype, table.data, table.shape[0], table.shape[1], tiled=table.tiled)
    return load_matrix(artifact, [names["lm_head"]], recipe)


def load_tail(artifact, recipe, head: dict | None = None) -> dict:
    names = global_names(artifact.kind, artifact.config)
    return {"final_norm": blocks.norm_weight(torch.from_numpy(artifact.read(names["final_norm"])), recipe),
            "lm_head": lm_head(artifact, recipe, names, head)}


def final(tail: dict[str, torch.Tensor], x: torch.Tensor, cfg: ModelConfig, rows: Rows) -> torch.Tensor:
    """Logits [1, sessions, vocab] of the last rows x [1, sessions, hidden] (one row a session)."""
    return rows.linear(rms_norm(x, tail["final_norm"], cfg.norm_eps), tail["lm_head"])


def tensor_names(kind: str, cfg: ModelConfig, i: int) -> list[str]:
    return list(source_names(kind, i, cfg).values())
