"""Runtime recipes: how weights, compute, KV and activations on the wire are typed.

Rule: lanes kept apart. `exact` (float32 everywhere) makes a split run equal transformers' whole model.
`native` keeps every GGUF tensor at its stored bit width (as the file's blocks, multiplied by meshd's
C kernel against activations quantized to 8 bits per block; where the kernel did not build, in torch's
int4 layout, fed bfloat16 activations), while the residual stream, norms and the wire stay float32,
so a route's output does not depend on where the model is split. `compact` (int8 weights with a
scale per row, bfloat16 everywhere) is for models stored in float, where `native` keeps the floats.
Everything that changes the numbers goes into the recipe fingerprint, so peers with different
recipes never form a route.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from meshd.shard import blocks, quant
from meshd.wire import PROTOCOL_VERSION

KV_LAYOUT = "layer-major-contiguous-v1"
# the block types meshd's C kernel runs, the rest in torch's int4 layout; without the kernel, all int4
LAYOUT = f"{blocks.LAYOUT} | {quant.LAYOUT}" if blocks.KERNEL is not None else quant.LAYOUT


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    weight_dtype: str  # float32, int8, or "stored" (the artifact's own width)
    compute_dtype: str  # the residual stream and norms
    wire_dtype: str
    kv_dtype: str
    matmul_dtype: str = ""  # activations fed to the weight kernels (default: compute_dtype)
    layout: str = ""  # how stored weights are laid out in memory, when that changes the numbers

    @property
    def torch_matmul(self) -> torch.dtype:
        return getattr(torch, self.matmul_dtype or self.compute_dtype)

    @property
    def torch_compute(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    @property
    def torch_wire(self) -> torch.dtype:
        return getattr(torch, self.wire_dtype)

    def fingerprint(self, model_fingerprint: str, adapter: str, tokenizer: str) -> str:
        doc = asdict(self) | {"kv_layout": KV_LAYOUT, "adapter": adapter, "tokenizer": tokenizer,
                              "model": model_fingerprint, "protocol": PROTOCOL_VERSION}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


EXACT = Recipe("exact", weight_dtype="float32", compute_dtype="float32", wire_dtype="float32", kv_dtype="float32")
COMPACT = Recipe("compact", weight_dtype="int8", compute_dtype="bfloat16", wire_dtype="bfloat16",
                 kv_dtype="bfloat16")
NATIVE = Recipe("native", weight_dtype="stored", compute_dtype="float32", wire_dtype="float32",
                kv_dtype="bfloat16", matmul_dtype="bfloat16", layout=LAYOUT)
RECIPES = {r.name: r for r in (EXACT, COMPACT, NATIVE)}
CHOICES = ["auto", *RECIPES]


def get_recipe(name: str, artifact=None) -> Recipe:
    """A recipe by name; "auto" is `native` for a quantized GGUF artifact and `exact` otherwise."""
    if name == "auto":
        return NATIVE if artifact is not None and artifact.is_quantized else EXACT
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {CHOICES}")
    return RECIPES[name]
