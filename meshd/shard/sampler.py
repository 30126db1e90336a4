"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded per session.

Rule: a draw depends on the seed, the position it samples for and the logits only: the same text
alone, in a batch with other sessions, and after a reroute replays the session elsewhere (each
session owns its generator, reseeded from (seed, position) before each draw).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def sample(self, logits: torch.Tensor, position: int = 0) -> tuple[int, float]:
        """Token id (for `position`) and its log-probability under the (tempered, filtered) distribution."""
        logits = logits.float().reshape(-1)
        p = self.params
        if p.temperature == 0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the token that crosses top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        logprobs = torch.log_softmax(logits, -1)
        digest = hashlib.blake2b(f"{p.seed}:{position}".encode(), digest_size=8).digest()
        self.generator.manual_seed(int.from_bytes(digest, "little") >> 1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
        return token, float(logprobs[token])
