"""RoPE scaling: which inverse frequencies a model's rotary embeddings use, read from its config, for every adapter.

Rules: the frequencies are computed as transformers' `modeling_rope_utils` computes them (float32, the same
operations in the same order, so the tables carry the reference's bits) for `default`, `linear`, `llama3` and
`yarn`. A GGUF file from llama.cpp's converter spells `llama3` as a `rope_freqs.weight` tensor and no
`rope.scaling.type` key: ggml divides each base frequency by its factor, and so does meshd; every hop that runs
attention holds that tensor. Whatever else changes the math is refused by name, never guessed: `dynamic` NTK
(its frequencies follow the running length, so keys cached at one length would be rotated for another),
`longrope`, partial rotary dimensions, per-layer-type parameters, keys this module does not compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FREQ_FACTORS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.x)
# in the recipe fingerprint of every scaled model (`ModelConfig.adapter`): bumped whenever the tables change
# for a file whose bytes did not (1: a GGUF's rope_freqs.weight is read; before, it was ignored and such
# files ran with plain RoPE), so peers that read the same file differently never share a route. Within
# one version the scaling comes from the artifact's bytes, which the model fingerprint covers.
MATH = "rope-1"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the base frequencies theta^(-2i/d) are scaled; `kind` says which fields count."""

    kind: str = "default"
    factor: float = 1.0  # linear, llama3, yarn
    original_context: int = 0  # llama3, yarn: the context the model was pretrained on
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale (None: from factor, mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    freq_factors: str | None = None  # freq_factors: the tensor that holds the divisors

    @property
    def tag(self) -> str:
        """A stable description of the math ("" for plain RoPE), for fingerprints and logs."""
        if self.kind == "default":
            return ""
        fields = {"linear": ("factor",), "freq_factors": ("freq_factors",),
                  "llama3": ("factor", "original_context", "low_freq_factor", "high_freq_factor"),
                  "yarn": ("factor", "original_context", "beta_fast", "beta_slow", "attention_factor", "mscale",
                           "mscale_all_dim", "truncate")}[self.kind]
        return f"{self.kind}(" + ",".join(f"{f}={getattr(self, f)!r}" for f in fields) + ")"


def _refuse(message: str):
    from meshd.shard.config import UnsupportedArchitecture  # config imports this module

    raise UnsupportedArchitecture(message)


# keys of an HF rope dict that each kind reads (transformers ignores the rest, and so do we)
_HF_KEYS = {"default": set(), "linear": {"factor"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
            "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim", "truncate"}}


def hf_parameters(c: dict[str, Any]) -> dict[str, Any]:
    """The rope dict of an HF config.json, as transformers picks it (`rope_scaling` before `rope_parameters`)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        _refuse(f"RoPE parameters per layer type ({sorted(params)}) are not supported")
    return params


def from_hf(c: dict[str, Any], max_positions: int) -> RopeScaling:
    """The scaling an HF config.json asks for, read as transformers 4.x/5.x read it."""
    params = hf_parameters(c)
    kind = params.get("rope_type", params.get("type", "default"))
    for where in (c, params):
        if where.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse(f"partial rotary embeddings (partial_rotary_factor={where['partial_rotary_factor']})"
                    " are not supported")
    if params.get("mrope_section"):
        _refuse("multimodal RoPE (mrope_section) is not supported")
    if kind == "dynamic":
        _refuse("rope scaling 'dynamic' (NTK that follows the running sequence length) is not supported: its"
                " frequencies change with the length, which cached keys cannot follow")
    if kind not in _HF_KEYS:
        _refuse(f"rope scaling {kind!r} is not supported (supported: {sorted(_HF_KEYS)})")
    if kind == "default":
        return RopeScaling()
    factor = params.get("factor")
    if kind in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins, else the dict's, else the context
        original = c["original_max_position_embeddings"] if "original_max_position_embeddings" in c else \
            params.get("original_max_position_embeddings", max_positions)
    if kind == "linear":
        return RopeScaling("linear", factor=_number(factor, "factor"))
    if kind == "llama3":
        return RopeScaling("llama3", factor=_number(factor, "factor"), original_context=int(original),
                           low_freq_factor=_number(params.get("low_freq_factor"), "low_freq_factor"),
                           high_freq_factor=_number(params.get("high_freq_factor"), "high_freq_factor"))
    if factor is None:  # transformers: the ratio of the contexts
        factor = max_positions / original
    return RopeScaling("yarn", factor=float(factor), original_context=int(original),
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       attention_factor=_opt_float(params.get("attention_factor")),
                       mscale=_opt_float(params.get("mscale")), mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
                       truncate=bool(params.get("truncate", True)))


# GGUF keys (under `{arch}.`) that would change the math in ways this module does not compute, with the value
# that leaves it unchanged
_GGUF_NEUTRAL = {"rope.scaling.attn_factor": 1.0, "rope.scaling.yarn_ext_factor": 1.0,
                 "rope.scaling.yarn_log_multiplier": 0.0, "rope.scaling.alpha": None,
                 "rope.scaling.yarn_attn_factor": None, "rope.dimension_sections": None}


def from_gguf(md: dict[str, Any], arch: str, tensor_names: set[str], head_dim: int) -> RopeScaling:
    """The scaling a GGUF file carries, in the keys and tensors llama.cpp's converter writes."""
    g = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
    kind = g("rope.scaling.type") or "none"
    for key, neutral in _GGUF_NEUTRAL.items():
        if g(key) is not None and (neutral is None or float(g(key)) != neutral):
            _refuse(f"GGUF key {arch}.{key} = {g(key)!r} changes RoPE in a way meshd does not compute")
    dims = g("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        _refuse(f"partial rotary embeddings ({arch}.rope.dimension_count = {dims}, head dim {head_dim})"
                " are not supported")
    extra = sorted(n for n in tensor_names if (n.startswith("rope_") or ".rope_" in n) and n != FREQ_FACTORS)
    if extra:
        _refuse(f"RoPE tensors {extra} are not supported")
    has_factors = FREQ_FACTORS in tensor_names
    if has_factors and kind != "none":
        _refuse(f"{FREQ_FACTORS} together with rope scaling {kind!r} is not supported")
    if kind == "none":
        return RopeScaling("freq_factors", freq_factors=FREQ_FACTORS) if has_factors else RopeScaling()
    factor = g("rope.scaling.factor")
    if kind == "linear":
        return RopeScaling("linear", factor=_number(factor, f"{arch}.rope.scaling.factor"))
    if kind == "yarn":
        original = g("rope.scaling.original_context_length")
        if original is None:
            _refuse(f"rope scaling 'yarn' without {arch}.rope.scaling.original_context_length")
        return RopeScaling("yarn", factor=_number(factor, f"{arch}.rope.scaling.factor"),
                           original_context=int(original), beta_fast=float(g("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(g("rope.scaling.yarn_beta_slow", 1.0)))
    _refuse(f"rope scaling {kind!r} is not supported (supported in GGUF: none, linear, yarn, {FREQ_FACTORS})")


def inverse_frequencies(scaling: RopeScaling, theta: float, dim: int, freq_factors=None):
    """(inv_freq [dim / 2] float32, attention factor): transformers' bits for each kind; for `freq_factors`,
    the base frequencies divided by the file's factors (`freq_factors`, a tensor of dim / 2), as ggml does."""
    import torch

    base = float(theta)
    if scaling.kind == "yarn":
        return _yarn(scaling, base, dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling.kind == "default":
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "freq_factors":
        factors = torch.as_tensor(freq_factors, dtype=torch.float32).reshape(-1)
        if factors.numel() != dim // 2:
            _refuse(f"{scaling.freq_factors} holds {factors.numel()} factors, the head has {dim // 2} frequencies")
        return inv_freq / factors, 1.0
    if scaling.kind == "llama3":
        return _llama3(scaling, inv_freq), 1.0
    _refuse(f"rope scaling {scaling.kind!r} is not supported")


def _llama3(s: RopeScaling, inv_freq):
    import torch

    old, low, high = s.original_context, s.low_freq_factor, s.high_freq_factor
    low_freq_wavelen, high_freq_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)  # long waves: divided
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled  # between: a blend
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(s: RopeScaling, base: float, dim: int):
    import torch

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
                     if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations):  # the dimension that turns `rotations` times over the original context
        return (dim * math.log(s.original_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, attention


def tensor_names(scaling: RopeScaling) -> list[str]:
    """The tensors every hop that runs attention holds for its rotary tables."""
    return [scaling.freq_factors] if scaling.freq_factors else []


def _number(v, name: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        _refuse(f"rope scaling needs a number for {name}, got {v!r}")
    return float(v)


def _opt_float(v) -> float | None:
    return None if v is None else float(v)
