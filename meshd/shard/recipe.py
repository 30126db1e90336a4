"""Runtime recipes: how weights, compute, KV and activations on the wire are typed.

Rule: two lanes kept apart. `exact` (float32 everywhere) makes a split run equal the whole model;
`compact` (int8 weights with a scale per row, bfloat16 compute, KV and wire) trades a measured drift for speed and fit.
Everything that changes the numbers goes into the recipe fingerprint, so peers with different
recipes never form a route.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from meshd.wire import PROTOCOL_VERSION

KV_LAYOUT = "layer-major-contiguous-v1"


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    weight_dtype: str
    compute_dtype: str
    wire_dtype: str
    kv_dtype: str

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
RECIPES = {r.name: r for r in (EXACT, COMPACT)}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]
