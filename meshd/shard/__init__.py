"""meshd.shard: a layer worker. Open a model, hold a contiguous range of its layers, run sessions.

This is the public surface (docs/layer-worker.md): what anybody running layers remotely can reuse,
apart from mesh policy (routing, records, relays). Names load lazily, so importing one submodule
(say `meshd.shard.kv`) does not import torch and every model adapter.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_artifact": "artifact", "Artifact": "artifact", "ArtifactError": "artifact",
    "ModelConfig": "config", "UnsupportedArchitecture": "config",
    "Shard": "runtime", "Owns": "runtime", "PASS": "runtime", "STEPS": "runtime", "SCORE": "runtime",
    "Recipe": "recipe", "EXACT": "recipe", "NATIVE": "recipe", "COMPACT": "recipe", "get_recipe": "recipe",
    "CacheMiss": "kv", "KVBudgetExceeded": "kv",
    "UnsupportedQuantization": "quant",
    "MemoryRefused": "footprint", "weight_bytes": "footprint",
    "SHORT": "rope", "LONG": "rope", "PastContext": "rope",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshd.shard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"meshd.shard.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
