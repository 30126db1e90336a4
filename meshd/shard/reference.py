"""The correctness reference: Hugging Face transformers running the whole model in one process.

Used by tests and benchmarks only; the runtime never imports it.
"""

from __future__ import annotations

import torch

from meshd.shard.artifact import Artifact


def load_reference(artifact: Artifact):
    """A transformers causal LM for the artifact, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    if artifact.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(artifact.path.parent, gguf_file=artifact.path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(artifact.path, dtype=torch.float32)
    return model.eval()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt, by transformers `generate`, not stopping at end-of-text."""
    config = model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = None  # generate() merges None arguments with the model's config; clear it there
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        config.eos_token_id = saved
    return out[0, len(ids):].tolist()
