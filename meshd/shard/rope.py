"""RoPE scaling: which inverse frequencies a model's rotary embeddings use, read from its config, for every adapter.

Rules: the frequencies are computed as transformers' `modeling_rope_utils` computes them (float32, the same
operations in the same order, so the tables carry the reference's bits) for `default`, `linear`, `llama3`,
`yarn` and `longrope`. A GGUF file from llama.cpp's converter spells `llama3` as a `rope_freqs.weight` tensor
and no `rope.scaling.type` key: ggml divides each base frequency by its factor, and so does meshd; every hop
that runs attention holds that tensor. It spells `longrope` (Phi-3) as two tensors, `rope_factors_short.weight`
and `rope_factors_long.weight`, with the attention factor in `rope.scaling.attn_factor`.

`longrope` has two tables, and a session rotates with one of them from its first position to its last
(`SHORT`, `LONG`: the table a session is opened with, `OpenSession.rope_table`). Why: transformers picks the
short or the long factors for a whole forward call from that call's largest position
(`longrope_frequency_update`), and once a generated sequence first grows past the pretraining length
(`original_max_position_embeddings`, `switch` here) Phi-3's `prepare_inputs_for_generation` throws the KV cache
away and computes every position again with the long factors. So a sequence of at most `switch` positions
runs on the short table, a longer one on the long table from position 0: a prompt already longer opens its
sessions on the long table, and a generation that grows past the switch is opened again on the long table
and computes its whole sequence anew (the entry does that, `meshd/entry/`). Each table is per position, so
the KV cache of a session holds the reference's bits. The short table reaches position `switch - 1` and no
further: a short session asked for more is refused (`PastContext`), never rotated with the wrong factors.

Whatever else changes the math is refused by name, never guessed: `dynamic` NTK (its frequencies follow the
running length, so keys cached at one length would be rotated for another), partial rotary dimensions,
per-layer-type parameters, keys this module does not compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshd.shard.readings import UnsupportedArchitecture

FREQ_FACTORS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.x)
SHORT_FACTORS, LONG_FACTORS = "rope_factors_short.weight", "rope_factors_long.weight"  # longrope (Phi-3)
# in the recipe fingerprint of every scaled model (`ModelConfig.adapter`): bumped whenever the tables change
# for a file whose bytes did not (1: a GGUF's rope_freqs.weight is read; before, it was ignored and such
# files ran with plain RoPE), so peers that read the same file differently never share a route. Within
# one version the scaling comes from the artifact's bytes, which the model fingerprint covers. (longrope's
# long table did not bump it: its tag names the long factors now, which parts longrope peers that compute
# it from those that refuse it, and leaves every other scaled model's routes as they were.)
MATH = "rope-1"
SHORT, LONG = 0, 1  # a session's table: every model's, and a longrope model's past its switch (see above)


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
    freq_factors: str | None = None  # freq_factors: the tensor that holds the divisors; longrope: the short ones
    short_factor: tuple[float, ...] = ()  # longrope from an HF config (a GGUF file holds them in `freq_factors`)
    long_factors: str | None = None  # longrope from a GGUF file: the tensor of the long factors
    long_factor: tuple[float, ...] = ()  # longrope from an HF config

    @property
    def tag(self) -> str:
        """A stable description of the math ("" for plain RoPE), for fingerprints and logs."""
        if self.kind == "default":
            return ""
        fields = {"linear": ("factor",), "freq_factors": ("freq_factors",),
                  "llama3": ("factor", "original_context", "low_freq_factor", "high_freq_factor"),
                  "yarn": ("factor", "original_context", "beta_fast", "beta_slow", "attention_factor", "mscale",
                           "mscale_all_dim", "truncate"),
                  "longrope": ("factor", "original_context", "attention_factor", "freq_factors", "short_factor",
                               "long_factors", "long_factor")
                  }[self.kind]
        return f"{self.kind}(" + ",".join(f"{f}={getattr(self, f)!r}" for f in fields) + ")"


class PastContext(ValueError):
    """A forward asked for positions past what its rotary table computes."""


def switch(scaling: RopeScaling) -> int:
    """The longest sequence the short table rotates: a longer one runs on the long table from position 0
    (0: the model has one table)."""
    return scaling.original_context if scaling.kind == "longrope" else 0


def tables(scaling: RopeScaling) -> tuple[int, ...]:
    """The tables a session of this model may be opened with."""
    return (SHORT, LONG) if scaling.kind == "longrope" else (SHORT,)


def table_positions(scaling: RopeScaling, table: int, max_positions: int) -> int:
    """The positions a table rotates: longrope's short one up to the switch, any other the whole context."""
    return min(max_positions, switch(scaling)) if scaling.kind == "longrope" and table == SHORT else max_positions


def factors_tensor(scaling: RopeScaling, table: int) -> str | None:
    """The tensor a table's factors come from (None: from the config, or none at all)."""
    return scaling.long_factors if table == LONG else scaling.freq_factors


def past_context(scaling: RopeScaling, end: int, limit: int, table: int = SHORT) -> PastContext:
    """The refusal for a forward that reaches position `end - 1` where its table computes `limit` positions."""
    if scaling.kind == "longrope" and table == SHORT and limit == switch(scaling):
        return PastContext(f"position {end - 1} is past {limit}, where this longrope session's short table ends:"
                           " transformers rotates every position of a longer sequence with the long factors, so the"
                           " session must be opened again on the long table (OpenSession.rope_table) and compute"
                           " the whole sequence anew")
    return PastContext(f"position {end - 1} is past the model's context ({limit} positions)")


def _refuse(message: str):
    raise UnsupportedArchitecture(message)


# keys of an HF rope dict that each kind reads (transformers ignores the rest, and so do we)
_HF_KEYS = {"default": set(), "linear": {"factor"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
            "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim", "truncate"},
            "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                         "attention_factor"}}


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
    if kind in ("llama3", "yarn", "longrope"):
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
    if kind == "longrope":
        short, long = (_factors(params, name) for name in ("short_factor", "long_factor"))
        return longrope(float(factor), int(original), _opt_float(params.get("attention_factor")),
                        short_factor=short, long_factor=long)
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


def longrope(factor: float, original: int, attention: float | None, **factors) -> RopeScaling:
    """`longrope` as transformers reads it: the attention factor, where none is given, from the ratio of the
    contexts (sqrt(1 + ln(factor) / ln(original)) past 1, else 1)."""
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor=factor, original_context=original, attention_factor=attention, **factors)


def _gguf_longrope(g, arch: str, tensor_names: set[str]) -> RopeScaling:
    """llama.cpp's form of `longrope`: both factor tensors, the pretraining context, and the attention factor
    its converter computed from the contexts (checked against transformers' formula, then recomputed in
    float64 as transformers does: the key holds it rounded to float32)."""
    if SHORT_FACTORS not in tensor_names or LONG_FACTORS not in tensor_names:
        _refuse(f"longrope needs both {SHORT_FACTORS} and {LONG_FACTORS}")
    original = g("rope.scaling.original_context_length")
    if original is None:
        _refuse(f"{LONG_FACTORS} and {SHORT_FACTORS} without {arch}.rope.scaling.original_context_length")
    scaling = longrope(int(g("context_length")) / int(original), int(original), None, freq_factors=SHORT_FACTORS,
                       long_factors=LONG_FACTORS)
    stored = g("rope.scaling.attn_factor")
    if stored is not None and abs(float(stored) - scaling.attention_factor) > 1e-6 * scaling.attention_factor:
        _refuse(f"GGUF key {arch}.rope.scaling.attn_factor = {stored!r} is not longrope's"
                f" {scaling.attention_factor!r} for these contexts; meshd does not compute it")
    return scaling


def from_gguf(md: dict[str, Any], arch: str, tensor_names: set[str], head_dim: int) -> RopeScaling:
    """The scaling a GGUF file carries, in the keys and tensors llama.cpp's converter writes."""
    g = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
    kind = g("rope.scaling.type") or "none"
    factored = bool({SHORT_FACTORS, LONG_FACTORS} & tensor_names)
    for key, neutral in _GGUF_NEUTRAL.items():
        if factored and key == "rope.scaling.attn_factor":
            continue  # longrope's, checked below
        if g(key) is not None and (neutral is None or float(g(key)) != neutral):
            _refuse(f"GGUF key {arch}.{key} = {g(key)!r} changes RoPE in a way meshd does not compute")
    dims = g("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        _refuse(f"partial rotary embeddings ({arch}.rope.dimension_count = {dims}, head dim {head_dim})"
                " are not supported")
    known = {FREQ_FACTORS, SHORT_FACTORS, LONG_FACTORS}
    extra = sorted(n for n in tensor_names if (n.startswith("rope_") or ".rope_" in n) and n not in known)
    if extra:
        _refuse(f"RoPE tensors {extra} are not supported")
    if factored:
        if kind != "none" or FREQ_FACTORS in tensor_names:
            _refuse(f"longrope's factor tensors together with rope scaling {kind!r} or {FREQ_FACTORS}"
                    " are not supported")
        return _gguf_longrope(g, arch, tensor_names)
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


def inverse_frequencies(scaling: RopeScaling, theta: float, dim: int, freq_factors=None, table: int = SHORT):
    """(inv_freq [dim / 2] float32, attention factor): transformers' bits for each kind; for `freq_factors`,
    the base frequencies divided by the file's factors (`freq_factors`, a tensor of dim / 2), as ggml does;
    for `longrope`, those of `table`, its factors from the file's tensor (`freq_factors`) or the config."""
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
    if scaling.kind == "longrope":
        return _longrope(scaling, base, dim, freq_factors, table), scaling.attention_factor
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


def _longrope(s: RopeScaling, base: float, dim: int, freq_factors=None, table: int = SHORT):
    """longrope's frequencies of one table: the base ones divided by its factors (short: sequences within the
    pretraining context; long: longer ones), in transformers' order (1 / (factor * base^(2i/d)), not
    base^(-2i/d) / factor)."""
    import torch

    name = "long" if table == LONG else "short"
    ext = torch.tensor(s.long_factor if table == LONG else s.short_factor, dtype=torch.float32) \
        if freq_factors is None else torch.as_tensor(freq_factors, dtype=torch.float32).reshape(-1)
    if ext.numel() != dim // 2:
        _refuse(f"longrope's {name} factors number {ext.numel()}, the head has {dim // 2} frequencies")
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


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
    return [name for name in (scaling.freq_factors, scaling.long_factors) if name]


def _number(v, name: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        _refuse(f"rope scaling needs a number for {name}, got {v!r}")
    return float(v)


def _factors(params: dict[str, Any], name: str) -> tuple[float, ...]:
    v = params.get(name)
    if not isinstance(v, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in v):
        _refuse(f"rope scaling 'longrope' needs a list of numbers for {name}, got {v!r}")
    return tuple(float(f) for f in v)


def _opt_float(v) -> float | None:
    return None if v is None else float(v)
