"""Real activations for benchmarks: SmolLM2's residual stream after its first ten layers."""

from __future__ import annotations

import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.runtime import Shard

TEXT = ("The mesh splits a language model across ordinary machines. Each daemon serves a range of layers "
        "and streams activations to the next one, which keeps going until the last layer samples a token. ")


def real_hidden_states(n_tokens: int, hidden: int = 576) -> torch.Tensor:
    """[1, n_tokens, hidden] float32 hidden states of SmolLM2 at layer 10 on English text."""
    artifact = open_artifact("smollm2")
    if artifact.config.hidden != hidden:
        raise ValueError(f"SmolLM2's hidden size is {artifact.config.hidden}, not {hidden}")
    from meshd.shard.tokenizer import load_tokenizer

    ids = load_tokenizer(artifact)(TEXT * 20).input_ids[:n_tokens]
    shard = Shard(artifact, 0, 10, progress=False)
    shard.open_session("bench")
    return shard.forward("bench", torch.tensor([ids]), 0)
