"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded per session, and
verifying an entry's draft tokens against the logits of every position they occupy.

Rules: a draw depends on the seed, the position it samples for and the logits only: the same text
alone, in a batch with other sessions, and after a reroute replays the session elsewhere (each
session owns its generator, reseeded from (seed, position) before each draw). Verification keeps the
distribution of plain sampling: greedy accepts a draft where it equals the argmax; sampling accepts a
draft d with probability p(d) and otherwise draws from p without d, renormalised (the standard rule
for a draft proposed with certainty), each uniform draw seeded from (seed, position) too.
A session with a grammar (`meshd/shard/grammar.py`) draws from its logits masked to what the grammar allows
at that position; a draft the grammar forbids has probability 0, so it is rejected like a wrong one. Greedy
under a grammar takes the first largest log-probability among the allowed tokens, and reports the model's own
log-probability of it: where the largest is allowed (most positions) that needs one bit of the grammar's mask,
not the mask applied to every logit (~200 us a position).
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


def _seed(seed: int, position: int, purpose: str = "") -> int:
    digest = hashlib.blake2b(f"{seed}:{position}{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def first_max(values: torch.Tensor) -> int:
    """The index of the first largest value (a NaN counts as largest), as `torch.argmax` gives it: numpy's
    argmax is the same rule and took 3 us over SmolLM2's 49152 logits where torch's took 64 (bfloat16 and
    float16 widen to float32 exactly, so the order and the ties stay)."""
    return int(values.detach().float().numpy().argmax())


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the distribution tokens are drawn from (tempered, top-k, top-p); for
        greedy, of the plain softmax."""
        logits = logits.float().reshape(-1)
        p = self.params
        if p.temperature == 0:
            return torch.log_softmax(logits, -1)
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the token that crosses top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        return torch.log_softmax(logits, -1)

    def sample(self, logits: torch.Tensor, position: int = 0, constraint=None) -> tuple[int, float]:
        """Token id (for `position`) and its log-probability under the (tempered, filtered) distribution,
        of the tokens `constraint` allows (all without one)."""
        if self.params.temperature == 0:
            logprobs = self.logprobs(logits)
            token = self._greedy(logprobs, constraint)
            return token, float(logprobs[token])
        logprobs = self.logprobs(logits if constraint is None else constraint.mask(logits))
        self.generator.manual_seed(_seed(self.params.seed, position))
        token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
        return token, float(logprobs[token])

    def verify(self, logits: torch.Tensor, drafts: list[int], position: int, constraint=None,
               exact: bool = False) -> tuple[int, int, float]:
        """Check drafts against logits [len(drafts) + 1, vocab], whose row i scores the token at
        `position + i` (row i follows draft i - 1). Returns how many drafts are accepted, the token
        after them, and its log-probability. With `constraint`, each row is masked to what it allows
        after the drafts before it, which it takes as they are accepted. `exact`: a draft stands only
        where `sample` gives that very token at its position (a check's window, whose drafts are the
        tokens another route sampled; speculation's rule keeps the distribution, not the draw)."""
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(drafts)} drafts")
        for i, draft in enumerate(drafts):
            kept = (self._same(logits[i], draft, position + i, constraint) if exact
                    else self._check(logits[i], draft, position + i, constraint))
            if kept is not None:
                return i, *kept
            if constraint is not None:
                constraint.take(draft)
        return len(drafts), *self.sample(logits[-1], position + len(drafts), constraint)

    @staticmethod
    def _greedy(logprobs: torch.Tensor, constraint) -> int:
        """The first largest log-probability, among the tokens `constraint` allows where there is one."""
        token = first_max(logprobs)
        if constraint is not None and not constraint.allows(token):
            token = first_max(constraint.mask(logprobs))
        return token

    def _same(self, logits: torch.Tensor, draft: int, position: int, constraint=None) -> tuple[int, float] | None:
        """None where `sample` gives the draft at `position`; else the token it gives and its log-probability."""
        if not 0 <= draft < logits.numel():
            raise ValueError(f"draft token {draft} is not in the vocabulary of {logits.numel()}")
        token, logprob = self.sample(logits, position, constraint)
        return None if token == draft else (token, logprob)

    def _check(self, logits: torch.Tensor, draft: int, position: int, constraint=None) -> tuple[int, float] | None:
        """None where the draft stands; else the token drawn in its place and its log-probability."""
        if not 0 <= draft < logits.numel():
            raise ValueError(f"draft token {draft} is not in the vocabulary of {logits.numel()}")
        if self.params.temperature == 0:
            logprobs = self.logprobs(logits)
            token = self._greedy(logprobs, constraint)
            return None if token == draft else (token, float(logprobs[token]))
        logprobs = self.logprobs(logits if constraint is None else constraint.mask(logits))
        probs = logprobs.exp()
        self.generator.manual_seed(_seed(self.params.seed, position, ":accept"))
        if float(torch.rand((), generator=self.generator, dtype=torch.float64)) < float(probs[draft]):
            return None
        rest = probs.clone()
        rest[draft] = 0.0
        if not float(rest.sum()) > 0:  # p(draft) rounds to 1: nothing else can be drawn
            return None
        self.generator.manual_seed(_seed(self.params.seed, position))
        token = int(torch.multinomial(rest, 1, generator=self.generator))  # multinomial renormalises
        return token, float(logprobs[token])
