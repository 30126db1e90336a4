"""A draft model at the entry (`--draft MODEL`): a small model run whole here that proposes the
tokens a step carries after the last accepted one.

Why: prompt lookup drafts only where the text repeats its context; a model of the same family
drafts wherever its guesses agree with the mesh model's, so a trip returns several tokens in
free text too. Its proposals are its argmax, so the tail's accept/reject rule (a point-mass draft)
keeps sampled text on the mesh model's distribution, and greedy text is the mesh model's own.

Rules: the draft model shares the mesh model's tokenizer, token for token (`vocabulary_difference`
refuses any other up front: a draft id must mean the same text to both); it runs on the recipe
its own file calls for, on the daemon's compute thread, one KV session per generation that follows
the context (what a step's tail rejected is trimmed away before the next proposal, so the draft
never recomputes the accepted past). A draft model that fails (its KV full, a context past its
positions) proposes nothing: the generation decodes plainly, never fails for it.
"""

from __future__ import annotations

import os
import time

import torch

from meshd.core.log import get_logger
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.sampler import first_max

log = get_logger(__name__)
DRAFT_KV_BUDGET = 256 << 20  # bytes of KV for all of an entry's draft sessions together
FEED_CHUNK = 128  # positions a draft pass takes at most (a long prompt goes in chunks)


class DraftRefused(ValueError):
    """A draft model that cannot serve this mesh model (a different vocabulary)."""


def vocabulary_difference(model_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str | None:
    """Why a draft model's vocabulary (token -> id) cannot stand for the mesh model's; None when
    they are the same, token for token."""
    if model_vocab == draft_vocab:
        return None
    if len(model_vocab) != len(draft_vocab):
        return f"it has {len(draft_vocab)} tokens, the model {len(model_vocab)}"
    model_by_id = {i: t for t, i in model_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    first = min(i for i in model_by_id.keys() | draft_by_id.keys() if model_by_id.get(i) != draft_by_id.get(i))
    return f"token {first} is {draft_by_id.get(first)!r} in the draft and {model_by_id.get(first)!r} in the model"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel:
    """The whole draft model, loaded once per daemon; `session()` gives a generation its drafts."""

    def __init__(self, spec: str, model_tokenizer, kv_budget_bytes: int = DRAFT_KV_BUDGET, cache=None) -> None:
        """`cache`: the daemon's cache directory (--cache-dir; None: the default)."""
        from meshd.shard.tokenizer import load_tokenizer

        artifact = open_artifact(spec, cache)
        why = vocabulary_difference(model_tokenizer.get_vocab(), load_tokenizer(artifact).get_vocab())
        if why is not None:
            raise DraftRefused(f"--draft {spec}: its tokenizer's vocabulary differs from the mesh model's ({why});"
                               " a draft model must share the model's tokenizer")
        self.name = artifact.name
        self.vocab = len(model_tokenizer)  # ids a draft may carry: the head embeds them
        recipe = get_recipe("auto", artifact)
        self.recipe = recipe.name
        self.shard = Shard(artifact, 0, artifact.config.n_layers, recipe, kv_budget_bytes=kv_budget_bytes)
        artifact.forget_tokenizer()

    def session(self) -> "DraftSession":
        return DraftSession(self)

    def describe(self) -> dict:
        return {"model": self.name, "recipe": self.recipe, "layers": self.shard.end}


class DraftSession:
    """One generation's drafts from the model: `propose(context, k)` is the model's greedy
    continuation of the context, k tokens long. Runs on the compute thread, like `close`."""

    def __init__(self, model: DraftModel) -> None:
        self.model, self.shard = model, model.shard
        self.key = ("draft", os.urandom(8))
        self.fed: list[int] = []  # the tokens whose KV the session holds, in order
        self.opened = self.broken = False
        self.catch_up_s = 0.0  # of the last proposal, the seconds spent feeding context it had not seen

    def propose(self, context: list[int], k: int) -> list[int]:
        self.catch_up_s = 0.0
        k = min(k, self.shard.max_positions - len(context))
        if k <= 0 or self.broken or not context:
            return []
        try:
            return self._propose(context, k)
        except Exception as exc:  # noqa: BLE001 -- a draft is an optimisation: never fail the generation
            log.warning("the draft model failed: this generation decodes without it", error=str(exc))
            self.broken = True
            return []

    def _propose(self, context: list[int], k: int) -> list[int]:
        if not self.opened:
            self.shard.open_session(self.key)
            self.opened = True
        keep = min(common_prefix(self.fed, context), len(context) - 1)  # the last token is fed for its logits
        self.shard.trim(self.key, keep)
        with torch.inference_mode():
            t0 = time.perf_counter()
            for a in range(keep, len(context), FEED_CHUNK):
                logits = self.shard.forward(self.key, torch.tensor([context[a:a + FEED_CHUNK]]), a)
            if len(context) - keep > 2:  # more than a step's new token and last draft: the prompt, or the
                self.catch_up_s = time.perf_counter() - t0  # tokens of plain steps (a one-off, not a draft's cost)
            out: list[int] = []
            while True:
                token = first_max(logits)
                if token >= self.model.vocab:  # padding rows of the draft's LM head: no token of the model
                    break
                out.append(token)
                if len(out) == k:
                    break
                logits = self.shard.forward(self.key, torch.tensor([[token]]), len(context) + len(out) - 1)
        self.fed = context + out[:-1]  # a prefix of what the KV holds (a padding id's position is trimmed next)
        return out

    def close(self) -> None:
        if self.opened:
            self.shard.release(self.key)
            self.opened = False
