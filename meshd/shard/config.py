"""The shape of a model, read from GGUF metadata or a Hugging Face `config.json`.

Rule: an architecture without a certified adapter is refused here, by name, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshd.shard import rope
from meshd.shard.gemma3_config import gemma3_from_gguf, gemma3_from_hf
from meshd.shard.readings import UnsupportedArchitecture, first, opt_int
from meshd.shard.rope import RopeScaling

SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "qwen3": "qwen3",
             "qwen3moe": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}  # GGUF `llama` with experts is Mixtral (family mixtral)
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
            "GPT2LMHeadModel": "gpt2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3",
            "MixtralForCausalLM": "mixtral", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
# Phi3Config's defaults: config.json leaves out what equals them, and transformers' Phi3Config always has an
# original_max_position_embeddings, which wins over the rope dict's
PHI3_DEFAULTS = {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                 "bos_token_id": 1, "eos_token_id": 32000, "vocab_size": 32064}
DEFAULT_THETA = {"MixtralForCausalLM": 1e6}  # transformers' default where config.json names none (else 1e4)
# GGUF MoE keys that change the routing, with the value meshd computes (softmax gating, weights unscaled)
MOE_NEUTRAL = {"expert_gating_func": 1, "expert_weights_scale": 1.0, "expert_shared_count": 0}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # the source's name: llama, mistral, qwen2, gpt2
    family: str  # the adapter that runs it: llama or gpt2
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()  # how the rotary frequencies are scaled (rope.py)
    max_positions: int = 2048
    tie_embeddings: bool = False
    attn_bias: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    # mixture of experts (Qwen3-MoE): experts per MoE layer, how many a token uses, their FFN width
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    norm_topk: bool = True  # renormalise the chosen experts' weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP although the model has experts
    sparse_step: int = 1  # every sparse_step-th layer is a MoE layer
    # Gemma 3: these layers attend over the last `sliding_window` positions only, with RoPE base local_rope_theta
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0
    attn_scalar: float = 0.0  # attention scores scaled by attn_scalar ** -0.5 (0: head_dim)
    final_softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap) (0: none)

    @property
    def adapter(self) -> str:
        """What computes this model, for recipe fingerprints: the family, and the RoPE scaling with the
        version of its math when there is one. Plain RoPE says only the family, so peers of versions
        that compute it alike still share routes; a scaled model's peers share them only with peers
        that read the same scaling the same way (a meshd before `rope.MATH` 1 ran a GGUF's
        `rope_freqs.weight` as plain RoPE)."""
        tag = self.rope_scaling.tag
        return f"{self.family}+{rope.MATH}:{tag}" if tag else self.family

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i not in self.dense_layers and (i + 1) % self.sparse_step == 0

    @classmethod
    def from_gguf(cls, md: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = md.get("general.architecture", "?")
        if arch == "gemma3":
            return gemma3_from_gguf(cls, md, tensor_names)
        if arch not in SUPPORTED:
            raise UnsupportedArchitecture(f"architecture {arch!r} has no meshd adapter (supported: {sorted(SUPPORTED)})")
        g = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
        n_heads = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        vocab = g("vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
        family = SUPPORTED[arch]
        if g("expert_count"):
            for key, neutral in MOE_NEUTRAL.items():
                if g(key) is not None and g(key) != neutral:
                    raise UnsupportedArchitecture(f"GGUF key {arch}.{key} = {g(key)!r} is not supported")
            if arch == "llama":
                family = "mixtral"
        eps_key = "attention.layer_norm_epsilon" if family == "gpt2" else "attention.layer_norm_rms_epsilon"
        head_dim = int(g("attention.key_length", hidden // n_heads))
        scaling = rope.from_gguf(md, arch, tensor_names, head_dim) if family != "gpt2" else RopeScaling()
        _longrope_phi3_only(scaling, family)
        max_positions = int(g("context_length", 2048))
        if family == "phi3" and g("attention.sliding_window"):
            max_positions = min(max_positions, int(g("attention.sliding_window")))  # as for Mistral below
        cfg = cls(
            arch=arch, family=family, n_layers=int(g("block_count")), hidden=hidden, n_heads=n_heads,
            n_kv_heads=int(g("attention.head_count_kv", n_heads)),
            head_dim=head_dim, ffn=int(g("feed_forward_length")), vocab=int(vocab), norm_eps=float(g(eps_key, 1e-5)),
            rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_positions=max_positions, tie_embeddings="output.weight" not in tensor_names,
            attn_bias="blk.0.attn_q.bias" in tensor_names or family == "gpt2",
            bos_id=opt_int(md.get("tokenizer.ggml.bos_token_id")),
            eos_id=opt_int(md.get("tokenizer.ggml.eos_token_id")),
            n_experts=int(g("expert_count", 0)), experts_per_token=int(g("expert_used_count", 0)),
            expert_ffn=int(g("expert_feed_forward_length", 0)), norm_topk=bool(g("expert_weights_norm", True)),
            # which layers route to experts is read off the tensors (a router or not)
            dense_layers=tuple(i for i in range(int(g("block_count"))) if g("expert_count")
                               and f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
        )
        if family == "mixtral" and cfg.dense_layers:
            raise UnsupportedArchitecture(f"a GGUF llama with experts (Mixtral) but plain MLP layers {cfg.dense_layers}")
        if family == "mixtral" and "blk.0.ffn_gate.0.weight" in tensor_names:
            raise UnsupportedArchitecture("this GGUF stores Mixtral's experts one tensor each (llama.cpp's layout"
                                          " before stacked ffn_*_exps tensors); convert the model again with a current"
                                          " llama.cpp, or give meshd its Hugging Face directory")
        return cfg

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "ModelConfig":
        archs = c.get("architectures") or [c.get("model_type", "?")]
        family = HF_ARCHS.get(archs[0])
        if family is None:
            raise UnsupportedArchitecture(f"architecture {archs[0]!r} has no meshd adapter (supported: {sorted(HF_ARCHS)})")
        if family == "gemma3":
            return gemma3_from_hf(cls, c)
        if family == "gpt2":
            return cls(arch="gpt2", family="gpt2", n_layers=c["n_layer"], hidden=c["n_embd"], n_heads=c["n_head"],
                       n_kv_heads=c["n_head"], head_dim=c["n_embd"] // c["n_head"],
                       ffn=c.get("n_inner") or 4 * c["n_embd"], vocab=c["vocab_size"],
                       norm_eps=c.get("layer_norm_epsilon", 1e-5), max_positions=c.get("n_positions", 1024),
                       tie_embeddings=c.get("tie_word_embeddings", True), attn_bias=True,
                       bos_id=c.get("bos_token_id"), eos_id=first(c.get("eos_token_id")))
        if family == "phi3":
            c = _phi3_config(c)
        if c.get("use_sliding_window"):
            raise UnsupportedArchitecture("sliding-window attention is not supported yet")
        n_heads = c["num_attention_heads"]
        max_positions = c.get("max_position_embeddings", 2048)
        scaling = rope.from_hf(c, max_positions)
        _longrope_phi3_only(scaling, family)
        if archs[0] in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM") and c.get("sliding_window"):
            # transformers masks keys more than a window back; within one window that is full attention
            max_positions = min(max_positions, int(c["sliding_window"]))
        # transformers: the rope dict's theta before the top-level one
        theta = (rope.hf_parameters(c).get("rope_theta") or c.get("rope_theta")
                 or DEFAULT_THETA.get(archs[0], 10000.0))
        moe_ffn = c["intermediate_size"] if family == "mixtral" else c.get("moe_intermediate_size") or 0
        return cls(arch=c.get("model_type", "llama"), family=family, n_layers=c["num_hidden_layers"],
                   hidden=c["hidden_size"], n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // n_heads, ffn=c["intermediate_size"],
                   vocab=c["vocab_size"], norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                   rope_scaling=scaling, max_positions=max_positions,
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   attn_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
                   bos_id=c.get("bos_token_id"), eos_id=first(c.get("eos_token_id")),
                   n_experts=c.get("num_experts") or c.get("num_local_experts") or 0,
                   experts_per_token=c.get("num_experts_per_tok") or 0,
                   expert_ffn=moe_ffn, norm_topk=bool(c.get("norm_topk_prob", True)),
                   dense_layers=tuple(c.get("mlp_only_layers") or ()), sparse_step=c.get("decoder_sparse_step") or 1)


def _longrope_phi3_only(scaling: RopeScaling, family: str) -> None:
    """longrope is proven equal to transformers on Phi-3 (tests/test_phi3.py) and nowhere else yet."""
    if scaling.kind == "longrope" and family != "phi3":
        raise UnsupportedArchitecture(f"rope scaling 'longrope' is supported for Phi-3 only, not family {family!r}")


def _phi3_config(c: dict[str, Any]) -> dict[str, Any]:
    """A Phi-3 config.json as transformers' Phi3Config reads it: its defaults under what the file says.
    Phi3Config renames rope types 'su' and 'yarn' to 'longrope' (after moving the pretraining context into
    the rope dict only for 'yarn'); such spellings are refused rather than read twice ways."""
    c = {**PHI3_DEFAULTS, **c}
    kind = (c.get("rope_scaling") or c.get("rope_parameters") or {}).get("rope_type") or \
        (c.get("rope_scaling") or c.get("rope_parameters") or {}).get("type")
    if kind in ("su", "yarn"):
        raise UnsupportedArchitecture(f"Phi-3 rope scaling {kind!r} (which transformers reads as 'longrope') is not"
                                      " supported; spell it 'longrope'")
    return c
