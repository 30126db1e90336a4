"""Constrained decoding where tokens are sampled: a grammar masks every position a session samples.

Why llguidance (PyPI `llguidance`), not xgrammar: it needs no torch of its own (xgrammar pins one),
compiles a grammar lazily (a JSON schema is usable at once, not after a compile of its whole automaton),
fills a position's bitmask in 3-80 us over SmolLM2's 49,152 tokens here, and takes JSON schema, Lark and
regex. The bitmask is applied to the logits by llguidance's numpy kernel in place (~60 us a position; unpacking
it into a bool tensor for torch's masked_fill took ~120 us; bench/grammar_bench.py measures it against a step).
A request's grammar is llguidance's JSON text (`LLMatcher.grammar_from_json_schema` / `grammar_from_lark`);
the entry checks it once (`check`) and sends it with the session to the hop that samples.

Rule: a grammar's input is the ids fed to the session from `start` on (the generated tokens), never what
the hop sampled: for each frame the sampling hop first takes the frame's fed ids (`feed`, which rolls back
whatever a rejected draft or an earlier route left past the frame's position), then masks the row it
samples (`mask`); while it checks drafts it takes each accepted one (`take`). A replay after a reroute
therefore brings a new tail's grammar to where the old one was, and rejected drafts leave nothing behind.
Once the grammar is complete only the end-of-sequence token is allowed, so a generation ends there.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

MAX_GRAMMAR_BYTES = 40 << 10  # a grammar travels in a frame's header (64 KiB in all, 16 KiB of it a prefix chain's)


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a token it does not allow."""


_lock = threading.Lock()
_tokenizers: dict[int, object] = {}


def ll_tokenizer(hf_tokenizer):
    """llguidance's view of a transformers tokenizer, built once per tokenizer (~0.35 s for SmolLM2's)."""
    import llguidance.hf

    with _lock:
        lt = _tokenizers.get(id(hf_tokenizer))
        if lt is None:
            lt = _tokenizers[id(hf_tokenizer)] = llguidance.hf.from_tokenizer(hf_tokenizer)
        return lt


def check(grammar: str, lltok) -> None:
    """GrammarError naming what is wrong with a grammar, or None."""
    import llguidance

    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {len(grammar.encode())} bytes; at most {MAX_GRAMMAR_BYTES} travel")
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    except Exception as exc:  # malformed JSON and the like
        raise GrammarError(f"bad grammar: {exc}") from None
    if failed:
        raise GrammarError("bad grammar: " + "; ".join(messages))


class Constraint:
    """One session's grammar state: the generated ids it has taken, and the mask of what may come next."""

    def __init__(self, grammar: str, lltok, start: int) -> None:
        import llguidance
        import llguidance.numpy as lln

        self.matcher = llguidance.LLMatcher(lltok, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"bad grammar: {self.matcher.get_error()}")
        self.start, self.vocab = start, lltok.vocab_size
        self.taken = 0  # generated ids taken
        self._fill, self._apply = lln.fill_next_token_bitmask, lln.apply_token_bitmask_inplace
        self._bits = lln.allocate_token_bitmask(1, self.vocab)

    def feed(self, position: int, ids: list[int]) -> None:
        """Take the generated ones of `ids`, fed at `position` on, after rolling back past `position`."""
        before = max(0, position - self.start)
        if self.taken > before:
            self.matcher.rollback(self.taken - before)
            self.taken = before
        elif self.taken < before:
            raise GrammarError(f"the grammar has taken {self.taken} generated tokens; a frame at position {position}"
                               f" needs {before}")
        for token in ids[max(0, self.start - position):]:
            self.take(token)

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar does not allow token {token} here: {self.matcher.get_error()}")
        self.taken += 1

    def allowed(self, n: int) -> torch.Tensor:
        """Which of `n` token ids may come next (bool [n]); ids past the tokenizer's vocabulary never."""
        return torch.isfinite(self.mask(torch.zeros(n)))

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (one bit of the position's bitmask: no logits touched)."""
        self._fill(self.matcher, self._bits, 0)
        return 0 <= token < self._bits.shape[1] * 32 and bool((int(self._bits[0, token >> 5]) >> (token & 31)) & 1)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of one position (a copy) with every token the grammar forbids at -inf, ids past the
        tokenizer's vocabulary too."""
        self._fill(self.matcher, self._bits, 0)
        if not self._bits.any():
            raise GrammarError(f"the grammar allows no token here: {self.matcher.get_error() or 'stopped'}")
        out = logits.reshape(-1).to(torch.float32, copy=True).contiguous()
        view = out.numpy()
        cut = min(view.shape[0], self._bits.shape[1] * 32)
        view[cut:] = -np.inf
        self._apply(view[None, :cut], self._bits)
        return out

    def forced(self) -> list[int]:
        """The tokens the grammar's forced bytes tokenize to from here (jump-forward drafts: where the grammar
        allows only them they cannot fail; where it also allows another split of the same bytes, the tail
        checks them as any draft)."""
        return list(self.matcher.compute_ff_tokens())
