"""The model families meshd runs, by the name a model's config gives (`ModelConfig.family`): each a module
with the same few functions (its layers' math, what a shard of it loads). Below both the runtime, which
runs a family's layers, and the footprint, which sizes them, so neither imports the other for it."""

from __future__ import annotations

from meshd.shard import gemma3, gpt2, llama, mixtral, phi3, qwen3

FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen3": qwen3, "mixtral": mixtral, "gemma3": gemma3, "phi3": phi3}
