"""A shard: the layers [start, end) of one model, loaded once, run for many sessions.

Rules: a shard holds only its own tensors (the head adds the embedding, the tail the final norm
and LM head); the head takes token ids, other shards take hidden states; a non-tail returns the
unnormalized residual stream, the tail returns logits of the last position. Each session's KV lives
in the shard's `KVStore` under (session id, epoch). A session is opened (`open_session`) and ended (`release`,
`keep`) by whoever runs it (a hop's session table, `meshd/hop/sessions.py`); one the store evicts is
forgotten here too, and its opener told (`on_evict`), so nothing keeps rows of a session the store dropped.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from meshd.core.settings import default
from meshd.core.log import get_logger
from meshd.shard import llama, rope
from meshd.shard.families import FAMILIES
from meshd.shard.artifact import Artifact
from meshd.shard.footprint import trim_heap
from meshd.shard.batch import PASS, run_jobs
from meshd.shard.kv import KVStore
from meshd.shard.recipe import EXACT, Recipe

@dataclass(frozen=True, slots=True)
class Owns:
    """Which of the model's parts outside its layers a shard holds."""

    embedding: bool  # the head: takes token ids
    final_norm: bool  # the tail: applies the final norm...
    lm_head: bool  # ...and the LM head, and returns logits


@dataclass(frozen=True, slots=True)
class OpenedSession:
    """What a session was opened with here: its layers [start, end) and its RoPE table."""

    start: int
    end: int
    table: int = rope.SHORT


DEFAULT_KV_BUDGET = default("kv_budget")
log = get_logger(__name__)


class Shard:
    def __init__(self, artifact: Artifact, start: int, end: int, recipe: Recipe = EXACT,
                 kv_budget_bytes: int = DEFAULT_KV_BUDGET, kv_ttl_s: float = default("session_idle"),
                 prefix_ttl_s: float = default("prefix_ttl"),
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
            # every hop that runs attention holds the tensors its rotary tables come from (Llama 3's factors,
            # longrope's short and long ones)
            factors = {name: torch.from_numpy(artifact.read(name)).float()
                       for name in rope.tensor_names(cfg.rope_scaling)}
            self.rope_tensors = list(factors.values())
            self.rotaries = self._rotaries(factors)
            self.rotary = self.rotaries[rope.SHORT]
        trim_heap()
        self.load_seconds = time.perf_counter() - t0
        # bytes of the weights held; fixed once loaded (status and metrics read it often)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.distinct_tensors())
        self._sessions: dict[Hashable, OpenedSession] = {}
        self.kv = KVStore(end - start, cfg.n_kv_heads, cfg.head_dim, getattr(torch, recipe.kv_dtype),
                          kv_budget_bytes, kv_ttl_s, prefix_ttl_s=prefix_ttl_s)
        self.kv.on_evict = self._evicted
        self.on_evict: list[Callable[[Hashable], None]] = []  # told each session the KV store evicted
        log.info("shard loaded", model=artifact.name, start=start, end=end, recipe=recipe.name,
                 params=self.n_params, weight_mb=round(self.weight_bytes / 1e6, 1), seconds=round(self.load_seconds, 2))

    def _rotaries(self, factors: dict[str, torch.Tensor]) -> dict:
        """The rotary tables by the RoPE table a session opens with: one for most models, a longrope
        model's short and long ones (rope.py), each reaching the positions it rotates."""
        cfg = self.config
        make_rotary = getattr(self.family, "rotary", None)
        if make_rotary is not None:  # a family with tables of its own (Gemma 3: one per kind of layer)
            return {rope.SHORT: make_rotary(cfg, *factors.values())}
        if cfg.family == "gpt2":  # learned positions
            return {rope.SHORT: None}
        return {table: llama.Rotary(cfg, self.table_positions(table),
                                    factors.get(rope.factors_tensor(cfg.rope_scaling, table)), table=table)
                for table in rope.tables(cfg.rope_scaling)}

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
                     end: int | None = None, table: int = rope.SHORT) -> None:
        """Open a session over layers [start, end) of this shard (default: all of them), rotated with
        RoPE table `table` (a longrope model's long one for a sequence past its switch: `rope.py`).

        A route may enter a shard mid-range or leave it early; layer 0 needs the head's embedding,
        so a session starts at 0 only on a head, and ends at the last layer only on a tail.
        """
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start < end <= self.end:
            raise ValueError(f"this shard serves layers [{self.start}, {self.end}), not [{start}, {end})")
        if table not in self.rotaries:
            raise ValueError(f"RoPE table {table} is not one of this model's ({sorted(self.rotaries)}: 0 short,"
                             " 1 long, which only a longrope model has)")
        self.kv.open(key, min(max_length or self.max_positions, self.max_positions), end - start,
                     self.windows(start, end))
        self._sessions[key] = OpenedSession(start, end, table)

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
        self._sessions.pop(key, None)
        return self.kv.release(key)

    def keep(self, key: Hashable, owner: str, hashes: list[bytes]) -> int:
        """End a session, keeping its KV of the tokens `hashes` names (`meshd/shard/prefix.py`) for sessions
        `owner` opens later on the same layers and RoPE table; the positions kept. Kept only where a pass
        of many positions computes each as its one-position step does (`passes_equal_steps`): a later
        session that starts from it then computes the bits a fresh one would."""
        opened = self._sessions.pop(key, None)
        if opened is None or not hashes or not self.passes_equal_steps:
            self.kv.release(key)
            return 0
        return self.kv.keep(key, (owner, opened.start, opened.end, opened.table), hashes)

    def reuse(self, key: Hashable, owner: str, hashes: list[bytes]) -> int:
        """Start an open, empty session from the longest prefix of `hashes` kept for `owner` on its
        layers and table; the positions it starts with (the next pass starts there, or earlier)."""
        opened = self._sessions.get(key)
        if opened is None or not hashes or not self.passes_equal_steps:
            return 0
        return self.kv.reuse(key, (owner, opened.start, opened.end, opened.table), hashes)

    def evict_expired(self) -> list[Hashable]:
        """Release sessions idle past the KV TTL (their entry vanished without closing); `on_evict` hears of each."""
        return self.kv.evict_expired()

    def _evicted(self, keys: list[Hashable]) -> None:
        """The KV store evicted these sessions (idle past the TTL, here or while another grew): forget them, and
        tell who opened them."""
        for key in keys:
            self._sessions.pop(key, None)
            for listener in list(self.on_evict):
                listener(key)

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
        kind), at most one job a session; each result is bit for bit what the session gets alone, and a
        job that cannot run gets its exception in its place (see `meshd/shard/batch.py`)."""
        return run_jobs(self, jobs)

    def session_range(self, key: Hashable) -> tuple[int, int]:
        """The layers [first, last) a session runs here (all of the shard's unless it opened fewer)."""
        opened = self._sessions.get(key)
        return (self.start, self.end) if opened is None else (opened.start, opened.end)

    def session_table(self, key: Hashable) -> int:
        """The RoPE table a session rotates with (`rope.SHORT` unless it opened on another)."""
        opened = self._sessions.get(key)
        return rope.SHORT if opened is None else opened.table

    def table_positions(self, table: int) -> int:
        """The positions a session on `table` may reach here (a longrope model's short table: its switch)."""
        return rope.table_positions(self.config.rope_scaling, table, self.max_positions)
