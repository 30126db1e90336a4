"""A shard: the layers [start, end) of one model, loaded once, run for many sessions.

Rules: a shard holds only its own tensors (the head adds the embedding, the tail the final norm
and LM head); the head takes token ids, other shards take hidden states; a non-tail returns the
unnormalized residual stream, the tail returns logits of the last position. Each session's KV lives
in the shard's `KVStore` under (session id, epoch).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Hashable

import torch

from meshd.node.log import get_logger
from meshd.shard import gemma3, gpt2, llama, mixtral, qwen3, rope
from meshd.shard.artifact import Artifact
from meshd.shard.footprint import trim_heap
from meshd.shard.kv import CacheMiss, KVBudgetExceeded, KVStore
from meshd.shard.recipe import EXACT, Recipe
from meshd.shard.rows import Rows

@dataclass(frozen=True, slots=True)
class Owns:
    """Which of the model's parts outside its layers a shard holds."""

    embedding: bool  # the head: takes token ids
    final_norm: bool  # the tail: applies the final norm...
    lm_head: bool  # ...and the LM head, and returns logits


def plain_error(exc: Exception) -> Exception:
    """The same error without its traceback: a raised exception's traceback holds the frames it
    passed, here the batch's, with every job's input tensors, in a cycle (results -> exception ->
    traceback -> frame -> results) that only the cyclic collector frees; a frame of 62 MB stayed
    until it ran."""
    return type(exc)(*exc.args)


FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen3": qwen3, "mixtral": mixtral, "gemma3": gemma3}
DEFAULT_KV_BUDGET = 1 << 30
PASS, STEPS, SCORE = "pass", "steps", "score"  # kinds of job of `Shard.forward_batch`
KINDS = (PASS, STEPS, SCORE)
log = get_logger(__name__)


class Shard:
    def __init__(self, artifact: Artifact, start: int, end: int, recipe: Recipe = EXACT,
                 kv_budget_bytes: int = DEFAULT_KV_BUDGET, kv_ttl_s: float = 600.0,
                 progress: bool | None = None) -> None:
        cfg = artifact.config
        if not 0 <= start < end <= cfg.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is not within the model's {cfg.n_layers} layers")
        self.artifact, self.config, self.recipe = artifact, cfg, recipe
        self.start, self.end = start, end
        self.family = FAMILIES[cfg.family]
        self.max_positions = cfg.max_positions
        t0 = time.perf_counter()
        show = sys.stderr.isatty() if progress is None else progress
        with torch.inference_mode():
            self.head = self.family.load_head(artifact, recipe) if self.is_head else None
            self.layers = []
            for n, i in enumerate(range(start, end), 1):
                self.layers.append(self.family.load_layer(artifact, i, recipe))
                if show:
                    print(f"\rloading {artifact.name} layers {start}:{end}  {n}/{end - start}",
                          end="", file=sys.stderr, flush=True)
            if show:
                print(file=sys.stderr)
            self.tail = self.family.load_tail(artifact, recipe, self.head) if self.is_tail else None
            # every hop that runs attention holds the tensors its rotary tables come from (Llama 3's factors)
            self.rope_tensors = [torch.from_numpy(artifact.read(name)).float()
                                 for name in rope.tensor_names(cfg.rope_scaling)]
            # a family with rotary tables of its own (Gemma 3: one per kind of layer) builds them
            make_rotary = getattr(self.family, "rotary", None)
            self.rotary = (make_rotary(cfg, *self.rope_tensors) if make_rotary is not None
                           else llama.Rotary(cfg, cfg.max_positions, *self.rope_tensors) if cfg.family != "gpt2"
                           else None)
        trim_heap()
        self.load_seconds = time.perf_counter() - t0
        # bytes of the weights held; fixed once loaded (status and metrics read it often)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.distinct_tensors())
        self._ranges: dict[Hashable, tuple[int, int]] = {}
        self.kv = KVStore(end - start, cfg.n_kv_heads, cfg.head_dim, getattr(torch, recipe.kv_dtype),
                          kv_budget_bytes, kv_ttl_s)
        log.info("shard loaded", model=artifact.name, start=start, end=end, recipe=recipe.name,
                 params=self.n_params, weight_mb=round(self.weight_bytes / 1e6, 1), seconds=round(self.load_seconds, 2))

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.config.n_layers

    @property
    def passes_equal_steps(self) -> bool:
        """Whether a pass of many positions gives each one the bits its one-position step gives (every
        layer runs in the block kernel, per row), so a replay may go in prefill-sized chunks."""
        in_kernel = getattr(self.family, "in_kernel", None)
        return bool(self.layers) and in_kernel is not None and all(in_kernel(layer) for layer in self.layers)

    @property
    def owns(self) -> Owns:
        return Owns(embedding=self.is_head, final_norm=self.is_tail, lm_head=self.is_tail)

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.rope_tensors)
        for part in [self.head or {}, self.tail or {}, *[vars(layer) for layer in self.layers]]:
            for t in part.values():
                if isinstance(t, torch.Tensor):
                    out.append(t)
                elif hasattr(t, "tensors"):
                    out.extend(t.tensors())
        return out

    def distinct_tensors(self) -> list[torch.Tensor]:
        """The tensors this shard holds, each once (a tied table may serve as head and tail)."""
        seen: dict[int, torch.Tensor] = {}
        for t in self.tensors():
            seen.setdefault(t.data_ptr(), t)
        return list(seen.values())

    @property
    def n_params(self) -> int:
        return sum(t.numel() for t in self.distinct_tensors())

    def open_session(self, key: Hashable, max_length: int | None = None, start: int | None = None,
                     end: int | None = None) -> None:
        """Open a session over layers [start, end) of this shard (default: all of them).

        A route may enter a shard mid-range or leave it early; layer 0 needs the head's embedding,
        so a session starts at 0 only on a head, and ends at the last layer only on a tail.
        """
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start < end <= self.end:
            raise ValueError(f"this shard serves layers [{self.start}, {self.end}), not [{start}, {end})")
        self.kv.open(key, min(max_length or self.max_positions, self.max_positions), end - start,
                     self.windows(start, end))
        self._ranges[key] = (start, end)

    def windows(self, start: int, end: int) -> tuple[int, ...]:
        """Each layer's attention window over [start, end) (0: full): a layer that attends over a
        window keeps KV for that window only (kv.py)."""
        cfg = self.config
        return tuple(cfg.sliding_window if i in cfg.sliding_layers else 0 for i in range(start, end))

    def session_kv_bytes(self, length: int, start: int | None = None, end: int | None = None) -> int:
        """The most KV bytes a session of `length` positions over [start, end) may hold here."""
        return self.kv.bytes_for_session(length, self.windows(self.start if start is None else start,
                                                              self.end if end is None else end))

    def session_length(self, key: Hashable) -> int:
        """Positions cached for this session (CacheMiss if it has no KV here)."""
        return self.kv.get(key).length

    def trim(self, key: Hashable, length: int) -> None:
        """Forget this session's positions from `length` on (a rollback: rejected draft tokens, a
        replay); the next forward must then start at `length`."""
        kv = self.kv.get(key)
        if not 0 <= length <= kv.length:
            raise ValueError(f"cannot trim to {length}: the session holds {kv.length} positions")
        kv.commit(length)

    def release(self, key: Hashable) -> bool:
        self._ranges.pop(key, None)
        return self.kv.release(key)

    def evict_expired(self) -> list[Hashable]:
        """Release sessions idle past the KV TTL (their entry vanished without closing)."""
        evicted = self.kv.evict_expired()
        for key in evicted:
            self._ranges.pop(key, None)
        return evicted

    def forward(self, key: Hashable, x: torch.Tensor, position: int, kind: str = PASS) -> torch.Tensor:
        """Run this shard's layers for one session on positions [position, position + n).

        x: token ids [1, n] for the head, hidden states [1, n, hidden] otherwise. Returns hidden
        states [1, n, hidden], or for the tail the logits of the last position [vocab] (float32);
        `kind` as `forward_batch` takes it.
        """
        out = self.forward_batch([(key, x, position, kind)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    prefill = forward

    def decode_step(self, key: Hashable, x: torch.Tensor, position: int) -> torch.Tensor:
        """`forward` for exactly one position."""
        if x.shape[1] != 1:
            raise ValueError(f"a decode step carries one position, got {x.shape[1]}")
        return self.forward(key, x, position)

    def forward_batch(self, jobs: list[tuple]) -> list[torch.Tensor | Exception]:
        """`forward` for several sessions in one pass: (key, x, position) each, or (key, x, position,
        kind), at most one job a session. `kind` PASS (a prompt chunk), STEPS (positions computed as
        one-position decode steps would compute them, bit for bit) or SCORE (as STEPS, and the tail
        returns the logits of every position, [n, vocab]). Their rows go through the layers stacked
        (see `rows.Rows`), so each result is bit for bit what the session gets alone. A job that
        cannot run (unknown session, bad input, KV budget full) gets its exception in its place (a
        `plain_error`: refused work holds no memory once its reply is out); the others run."""
        results: list[torch.Tensor | Exception | None] = [None] * len(jobs)
        groups: dict[tuple[int, int], list[tuple]] = {}
        with torch.inference_mode():
            seen = set()
            for i, (key, x, position, *rest) in enumerate(jobs):
                try:
                    kind = rest[0] if rest else PASS
                    if kind not in KINDS:
                        raise ValueError(f"unknown kind of pass {kind!r}")
                    if key in seen:
                        raise ValueError(f"session {key!r} appears twice in one batch")
                    seen.add(key)
                    first, last = self._ranges.get(key, (self.start, self.end))
                    h = self._input(x, first, position)  # checked first: refused input keeps no session alive
                    kv = self.kv.get(key)
                    kv.reserve(position, h.shape[1])
                    groups.setdefault((first, last), []).append((i, kv, h, position, kind))
                except (CacheMiss, KVBudgetExceeded, ValueError, TypeError) as exc:
                    results[i] = plain_error(exc)
            for (first, last), members in groups.items():  # sessions entering or leaving mid-range apart
                self._run(first, last, members, results)
        return results  # type: ignore[return-value]

    def _input(self, x: torch.Tensor, first: int, position: int) -> torch.Tensor:
        """A job's input as the first layer takes it: embedded token ids, or hidden states."""
        if first == 0:
            if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"the head takes token ids [1, n], got {x.dtype} {tuple(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.config.vocab):
                raise ValueError(f"token ids must be in [0, {self.config.vocab})")
            h = self.family.embed(self.head, x.long(), position, self.recipe.torch_compute)
        else:
            if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != self.config.hidden:
                raise ValueError(f"expected hidden states [1, n, {self.config.hidden}], got {tuple(x.shape)}")
            if x.dtype not in (self.recipe.torch_wire, self.recipe.torch_compute):  # never converted: refused
                raise ValueError(f"expected hidden states in {self.recipe.wire_dtype} (recipe {self.recipe.name}),"
                                 f" got {str(x.dtype).removeprefix('torch.')}")
            h = x.to(self.recipe.torch_compute)
        if h.shape[1] == 0:
            raise ValueError("nothing to run: zero positions")
        return h

    def _segments(self, members: list) -> list[tuple[object, int, int]]:
        """(kv, position, n) per segment of the pass. Where a pass of many positions rounds
        differently from one-position steps (torch's float matmuls pick their kernel by row count,
        its attention by query count), a STEPS or SCORE job goes as one segment a position, which
        every layer computes as the decode step of that position (`rows.Rows`)."""
        parts = []
        for _, kv, h, position, kind in members:
            n = h.shape[1]
            if kind != PASS and n > 1 and not self.passes_equal_steps:
                parts.extend((kv, position + j, 1) for j in range(n))
            else:
                parts.append((kv, position, n))
        return parts

    def _run(self, first: int, last: int, members: list, results: list) -> None:
        rows = Rows.stack(self._segments(members))
        h = torch.cat([m[2] for m in members], dim=1) if len(members) > 1 else members[0][2]
        for li, layer in enumerate(self.layers[first - self.start:last - self.start]):
            h = self.family.layer_forward(layer, h, self.config, self.rotary, rows, li)
        spans, row = [], 0  # each member's rows [row, row + n)
        for _, kv, mh, position, _ in members:
            kv.commit(position + mh.shape[1])
            spans.append((row, mh.shape[1]))
            row += mh.shape[1]
        if last != self.config.n_layers:
            for (i, *_), (r, n) in zip(members, spans):
                results[i] = h if len(members) == 1 else h[:, r:r + n]
            return
        picked = [range(r, r + n) if m[4] == SCORE else range(r + n - 1, r + n) for m, (r, n) in zip(members, spans)]
        flat = [r for rs in picked for r in rs]
        x = h[:, -1:] if flat == [h.shape[1] - 1] else h[:, flat]
        logits = self.family.final(self.tail, x, self.config, Rows.stack([(None, 0, 1)] * len(flat))).float()
        at = 0
        for m, rs in zip(members, picked):
            results[m[0]] = logits[0, at:at + len(rs)] if m[4] == SCORE else logits[0, at]
            at += len(rs)
