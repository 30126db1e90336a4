"""Per-session KV caches for the layers one shard owns, inside a memory budget.

Rules: a cache is keyed by (session id, epoch) and holds only this shard's layers; it grows as
positions arrive (never reserved at max length up front); every byte is charged to the store's
budget, and growth past it evicts expired sessions first, then fails with `KVBudgetExceeded`.
A lookup of an unknown or evicted session raises `CacheMiss`, never returns something empty. Whoever
opened a session hears of its eviction (`on_evict`), whichever call evicted it, after the store's lock is let go.
Layers that attend over a sliding window (Gemma 3) keep only what their window and a window of rollback
need: their KV stays bounded by about three windows plus the pass in flight, however long the session.
An ended session's KV may be kept (`keep`) and copied into a new session that extends the same tokens
(`reuse`; `meshd/shard/prefix.py` indexes it): kept bytes count against the budget like any, and are
the first freed when a live session needs room (least recently used first), or once idle past their TTL.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable

import torch

from meshd.core.settings import default
from meshd.shard.prefix import BLOCK, Kept, PrefixIndex

GROW_STEP = 64
WINDOW_ROWS = 128  # positions a pass feeds a session at most, as admission assumes (a prefill chunk)


def window_positions(window: int, length: int, rows: int = WINDOW_ROWS) -> int:
    """Positions a layer's cache may hold for a session of `length` positions fed at most `rows` at a
    time: all of them without a window; with one, its window, a window of rollback and the growth
    room `_reserve_window` leaves, rounded to the grow step, never more than `length`."""
    if not window:
        return length
    return min(length, -(-(4 * window + 2 * rows) // GROW_STEP) * GROW_STEP)


class CacheMiss(KeyError):
    """No KV cache for this (session, epoch): unknown, released or evicted."""


class KVBudgetExceeded(RuntimeError):
    """Holding this session's KV would exceed the shard's memory budget."""


class SessionKV:
    """K and V for one session: [layers, 1, kv heads, capacity, head dim] each, filled to `length`.

    Layers with a window (`windows[li]` > 0, one width for all) keep their own pair, `sk` and `sv`, which
    hold positions from `base` on: when they run out of room, positions more than two windows back are
    dropped (one window for attention, one for rollbacks), so a rollback of up to a window always finds
    its keys, and a further one must replay from position 0.
    """

    def __init__(self, store: "KVStore", key: Hashable, max_length: int, n_layers: int,
                 windows: tuple[int, ...] = ()) -> None:
        self.store, self.key, self.max_length, self.n_layers = store, key, max_length, n_layers
        windows = tuple(windows) or (0,) * n_layers
        if len(windows) != n_layers or len({w for w in windows if w}) > 1:
            raise ValueError(f"windows {windows} for {n_layers} layers: one width (or 0) a layer expected")
        self.window = max(windows, default=0)
        full, sliding = [li for li, w in enumerate(windows) if not w], [li for li, w in enumerate(windows) if w]
        self._slot = {li: (False, j) for j, li in enumerate(full)} | {li: (True, j) for j, li in enumerate(sliding)}
        self.n_full, self.n_sliding = len(full), len(sliding)
        self.length = 0
        self.base = 0  # the first position the windowed layers hold
        self.k = self.v = store.empty(0, self.n_full)
        self.sk = self.sv = store.empty(0, self.n_sliding)
        self.last_used = store.clock()

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.sk.numel()) * self.k.element_size() * 2

    def reserve(self, pos: int, n: int) -> None:
        """Make room for positions [pos, pos + n); a pos before `length` truncates (a replay)."""
        self.last_used = self.store.clock()  # before charging, so growth never evicts this session
        if pos > self.length:
            raise ValueError(f"position {pos} skips ahead of the cached length {self.length}")
        if pos + n > self.max_length:
            raise ValueError(f"positions up to {pos + n} exceed the session's max length {self.max_length}")
        if self.n_sliding and 0 < pos and max(0, pos - self.window + 1) < self.base:
            raise ValueError(f"position {pos} needs keys from {pos - self.window + 1}, but the windowed layers"
                             f" hold positions from {self.base} on; replay from position 0")
        self.length = pos
        if self.n_full and pos + n > self.capacity:
            cap = min(self.max_length, -(-max(pos + n, 2 * self.capacity) // GROW_STEP) * GROW_STEP)
            self.k, self.v = self._regrow(self.k, self.v, cap, 0)
        if self.n_sliding:
            self._reserve_window(pos, n)

    def _reserve_window(self, pos: int, n: int) -> None:
        if pos == 0:
            self.base = 0
        have = self.sk.shape[3]
        if pos + n - self.base <= have:
            return
        base = max(self.base, pos - 2 * self.window + 1)  # the window, and a window of rollback
        need = pos + n - base
        cap = need + self.window if base > self.base else max(need, 2 * have)  # dropping: room for a window more
        cap = min(self.max_length - base, -(-cap // GROW_STEP) * GROW_STEP)
        self.sk, self.sv = self._regrow(self.sk, self.sv, cap, base - self.base, pos - base)
        self.base = base

    def _regrow(self, k: torch.Tensor, v: torch.Tensor, cap: int, skip: int, keep: int | None = None):
        """New caches of `cap` positions holding the old ones' `keep` positions (default: the cached
        length) from slot `skip` on, the difference in bytes charged to the budget."""
        keep = self.length if keep is None else keep
        self.store.charge(self, self.store.bytes_for(cap, k.shape[0]) - k.numel() * k.element_size() * 2)
        new_k, new_v = self.store.empty(cap, k.shape[0]), self.store.empty(cap, k.shape[0])
        new_k[:, :, :, :keep] = k[:, :, :, skip:skip + keep]
        new_v[:, :, :, :keep] = v[:, :, :, skip:skip + keep]
        return new_k, new_v

    def first(self, li: int) -> int:
        """The position of the first key and value `append` returns for layer li."""
        return self.base if self._slot[li][0] else 0

    def append(self, li: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer li's new keys/values at pos; return its keys/values from `first(li)` up to pos + n."""
        sliding, j = self._slot[li]
        keys, values, off = (self.sk, self.sv, self.base) if sliding else (self.k, self.v, 0)
        end = pos + k.shape[2]
        keys[j, :, :, pos - off:end - off] = k
        values[j, :, :, pos - off:end - off] = v
        return keys[j, :, :, :end - off], values[j, :, :, :end - off]

    def layer(self, li: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li's whole caches [1, kv heads, capacity, hd], for a kernel that writes positions
        up to `end` in place (`reserve` made the room); layers without a window only."""
        sliding, j = self._slot[li]
        if sliding or end > self.capacity:
            raise ValueError(f"positions up to {end} exceed the reserved {self.capacity}" if not sliding
                             else f"layer {li} keeps a window; its caches do not start at position 0")
        return self.k[j], self.v[j]

    def commit(self, end: int) -> None:
        self.length = end


class KVStore:
    """All sessions' caches of one shard; thread-safe; `used_bytes` never exceeds `budget_bytes`."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 budget_bytes: int, ttl_s: float = default("session_idle"), clock: Callable[[], float] = time.monotonic,
                 prefix_ttl_s: float = default("prefix_ttl")) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim, self.dtype = n_layers, n_kv_heads, head_dim, dtype
        self.budget_bytes, self.ttl_s, self.clock = budget_bytes, ttl_s, clock
        self.used_bytes = 0  # live sessions' bytes and kept ones'
        self._sessions: dict[Hashable, SessionKV] = {}
        self.kept = PrefixIndex(prefix_ttl_s, clock)  # ended sessions' KV (0 TTL: none kept)
        self._lock = threading.RLock()
        self.on_evict: Callable[[list[Hashable]], None] | None = None  # told the keys of sessions it evicted

    def empty(self, cap: int, n_layers: int | None = None) -> torch.Tensor:
        n_layers = self.n_layers if n_layers is None else n_layers
        return torch.empty(n_layers, 1, self.n_kv_heads, cap, self.head_dim, dtype=self.dtype)

    def bytes_for(self, positions: int, n_layers: int | None = None) -> int:
        n_layers = self.n_layers if n_layers is None else n_layers
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * n_layers * self.n_kv_heads * positions * self.head_dim * itemsize

    def bytes_for_session(self, length: int, windows: tuple[int, ...], rows: int = WINDOW_ROWS) -> int:
        """The most bytes a session of `length` positions over layers with these windows (0: full
        attention) may hold, fed at most `rows` positions a pass: a full layer holds every position,
        a windowed one at most `window_positions` of them."""
        return sum(self.bytes_for(window_positions(w, length, rows), 1) for w in windows)

    def open(self, key: Hashable, max_length: int, n_layers: int | None = None,
             windows: tuple[int, ...] = ()) -> SessionKV:
        """A new empty cache for key over n_layers layers (default: all of the shard's), each with its
        sliding window (0 or absent: none), replacing and freeing any earlier one."""
        with self._lock:
            self.release(key)
            kv = self._sessions[key] = SessionKV(self, key, max_length,
                                                 self.n_layers if n_layers is None else n_layers, windows)
            return kv

    def get(self, key: Hashable) -> SessionKV:
        with self._lock:
            kv = self._sessions.get(key)
            if kv is None:
                raise CacheMiss(f"no KV cache for session {key!r} (unknown, released or evicted)")
            kv.last_used = self.clock()
            return kv

    def release(self, key: Hashable) -> bool:
        with self._lock:
            kv = self._sessions.pop(key, None)
            if kv is None:
                return False
            self._free(kv)
            return True

    def _free(self, kv: SessionKV) -> None:
        self.used_bytes -= kv.nbytes
        kv.k = kv.v = self.empty(0, kv.n_full)
        kv.sk = kv.sv = self.empty(0, kv.n_sliding)

    def keep(self, key: Hashable, scope: Hashable, hashes: list[bytes]) -> int:
        """End a session, keeping its KV of the tokens `hashes` names (whole blocks of the positions it
        holds, from 0) for `reuse` in `scope`; the positions kept (0: released, nothing to keep)."""
        with self._lock:
            kv = self._sessions.pop(key, None)
            if kv is None:
                return 0
            blocks = min(len(hashes), kv.length // BLOCK)
            if self.kept.ttl_s <= 0 or (kv.n_sliding and kv.base > 0):
                blocks = 0  # keeping is off; or the windowed layers dropped early positions a reuse needs
            kv.commit(blocks * BLOCK)
            for dropped in self.kept.insert(scope, hashes[:blocks], kv, kv.nbytes):
                self._free(dropped.value)
            return blocks * BLOCK

    def reuse(self, key: Hashable, scope: Hashable, hashes: list[bytes]) -> int:
        """Fill a new session's cache with the longest kept prefix of `hashes` in `scope` (whole blocks);
        the positions filled (0: none kept, or no room for them)."""
        with self._lock:
            dest = self._sessions.get(key)
            kept, blocks = self.kept.match(scope, hashes)
            if dest is None or kept is None or dest.length:
                self.kept.stats.misses += dest is not None
                return 0
            n = min(blocks * BLOCK, dest.max_length)
            self.kept.remove(kept)  # held aside while the copy makes room: room is never made of it
            try:
                dest.reserve(0, n)
            except KVBudgetExceeded:
                n = 0
        try:  # the copy outside the lock, which the event loop takes (admission, status): only this (compute)
            src: SessionKV = kept.value  # thread writes caches, and the source is out of the index meanwhile
            for a, b in ((dest.k, src.k), (dest.v, src.v), (dest.sk, src.sk), (dest.sv, src.sv)):
                if n and b.numel():
                    a[:, :, :, :n] = b[:, :, :, :n]
        finally:
            with self._lock:
                dest.commit(n)
                for dropped in self.kept.insert(kept.scope, kept.hashes, kept.value, kept.nbytes):
                    self._free(dropped.value)
                stats = self.kept.stats
                stats.hits += bool(n)
                stats.misses += not n
                stats.tokens_reused += n
        return n

    def _make_room(self, delta: int) -> None:
        """Free kept KV, the least recently used first, until `delta` more bytes fit (or none is left)."""
        while self.used_bytes + delta > self.budget_bytes:
            oldest = self.kept.oldest()
            if oldest is None:
                return
            self._drop_kept(oldest)

    def _drop_kept(self, kept: Kept) -> None:
        self.kept.remove(kept)
        self.kept.stats.evictions += 1
        self._free(kept.value)

    def evict_expired(self) -> list[Hashable]:
        """Release sessions idle past the TTL (their keys, told to `on_evict`) and kept KV idle past its own."""
        expired = self._expire()
        self._told(expired)
        return expired

    def _expire(self) -> list[Hashable]:
        with self._lock:
            now = self.clock()
            expired = [k for k, kv in self._sessions.items() if now - kv.last_used > self.ttl_s]
            for key in expired:
                self.release(key)
            for kept in self.kept.expired():
                self._free(kept.value)
            return expired

    def _told(self, evicted: list[Hashable]) -> None:
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    @property
    def live_bytes(self) -> int:
        """Bytes held for open sessions (`used_bytes` less the kept KV)."""
        with self._lock:
            return self.used_bytes - self.kept.held_bytes

    def kept_summary(self) -> dict:
        """The prefix index's figures (`PrefixIndex.summary`), read under the lock the compute thread
        keeps and reuses under (status asks from the event loop)."""
        with self._lock:
            return self.kept.summary()

    def drop_kept(self) -> int:
        """Free all kept KV (an operator's or a move's choice); the entries freed."""
        with self._lock:
            entries = self.kept.entries()
            for kept in entries:
                self._drop_kept(kept)
            return len(entries)

    def idle(self, idle_s: float) -> list[Hashable]:
        """Sessions unused for more than `idle_s` seconds, the longest unused first."""
        with self._lock:
            now = self.clock()
            quiet = [(kv.last_used, k) for k, kv in self._sessions.items() if now - kv.last_used > idle_s]
        return [k for _, k in sorted(quiet, key=lambda item: item[0])]

    def charge(self, kv: SessionKV, delta: int) -> None:
        """Count `delta` more bytes of `kv`'s; past the budget, kept KV goes first, then sessions idle past
        the TTL (evicted, and told to `on_evict`), else KVBudgetExceeded."""
        evicted: list[Hashable] = []
        try:
            with self._lock:
                self._make_room(delta)
                if self.used_bytes + delta > self.budget_bytes:
                    evicted = self._expire()
                if self.used_bytes + delta > self.budget_bytes:
                    raise KVBudgetExceeded(f"KV budget of {self.budget_bytes} bytes is full"
                                           f" ({self.used_bytes} used, {delta} more asked)")
                if kv.key not in self._sessions:
                    raise CacheMiss(f"session {kv.key!r} was released while growing")
                self.used_bytes += delta
        finally:
            self._told(evicted)

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Hashable]:
        with self._lock:
            return list(self._sessions)
