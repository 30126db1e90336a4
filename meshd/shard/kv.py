"""Per-session KV caches for the layers one shard owns, inside a memory budget.

Rules: a cache is keyed by (session id, epoch) and holds only this shard's layers; it grows as
positions arrive (never reserved at max length up front); every byte is charged to the store's
budget, and growth past it evicts expired sessions first, then fails with `KVBudgetExceeded`.
A lookup of an unknown or evicted session raises `CacheMiss`, never returns something empty.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable

import torch

GROW_STEP = 64


class CacheMiss(KeyError):
    """No KV cache for this (session, epoch): unknown, released or evicted."""


class KVBudgetExceeded(RuntimeError):
    """Holding this session's KV would exceed the shard's memory budget."""


class SessionKV:
    """K and V for one session: [layers, 1, kv heads, capacity, head dim] each, filled to `length`."""

    def __init__(self, store: "KVStore", key: Hashable, max_length: int, n_layers: int) -> None:
        self.store, self.key, self.max_length, self.n_layers = store, key, max_length, n_layers
        self.length = 0
        self.k = self.v = store.empty(0, n_layers)
        self.last_used = store.clock()

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reserve(self, pos: int, n: int) -> None:
        """Make room for positions [pos, pos + n); a pos before `length` truncates (a replay)."""
        self.last_used = self.store.clock()  # before charging, so growth never evicts this session
        if pos > self.length:
            raise ValueError(f"position {pos} skips ahead of the cached length {self.length}")
        if pos + n > self.max_length:
            raise ValueError(f"positions up to {pos + n} exceed the session's max length {self.max_length}")
        self.length = pos
        if pos + n > self.capacity:
            cap = min(self.max_length, max(pos + n, 2 * self.capacity))
            cap = min(self.max_length, -(-cap // GROW_STEP) * GROW_STEP)
            self.store.charge(self, self.store.bytes_for(cap, self.n_layers) - self.nbytes)
            k, v = self.store.empty(cap, self.n_layers), self.store.empty(cap, self.n_layers)
            k[:, :, :, :self.length] = self.k[:, :, :, :self.length]
            v[:, :, :, :self.length] = self.v[:, :, :, :self.length]
            self.k, self.v = k, v

    def append(self, li: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer li's new keys/values at pos; return all keys/values up to pos + n."""
        end = pos + k.shape[2]
        self.k[li, :, :, pos:end] = k
        self.v[li, :, :, pos:end] = v
        return self.k[li, :, :, :end], self.v[li, :, :, :end]

    def layer(self, li: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li's whole caches [1, kv heads, capacity, hd], for a kernel that writes positions
        up to `end` in place (`reserve` made the room)."""
        if end > self.capacity:
            raise ValueError(f"positions up to {end} exceed the reserved {self.capacity}")
        return self.k[li], self.v[li]

    def commit(self, end: int) -> None:
        self.length = end


class KVStore:
    """All sessions' caches of one shard; thread-safe; `used_bytes` never exceeds `budget_bytes`."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 budget_bytes: int, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim, self.dtype = n_layers, n_kv_heads, head_dim, dtype
        self.budget_bytes, self.ttl_s, self.clock = budget_bytes, ttl_s, clock
        self.used_bytes = 0
        self._sessions: dict[Hashable, SessionKV] = {}
        self._lock = threading.RLock()

    def empty(self, cap: int, n_layers: int | None = None) -> torch.Tensor:
        n_layers = self.n_layers if n_layers is None else n_layers
        return torch.empty(n_layers, 1, self.n_kv_heads, cap, self.head_dim, dtype=self.dtype)

    def bytes_for(self, positions: int, n_layers: int | None = None) -> int:
        n_layers = self.n_layers if n_layers is None else n_layers
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * n_layers * self.n_kv_heads * positions * self.head_dim * itemsize

    def open(self, key: Hashable, max_length: int, n_layers: int | None = None) -> SessionKV:
        """A new empty cache for key over n_layers layers (default: all of the shard's), replacing
        and freeing any earlier one."""
        with self._lock:
            self.release(key)
            kv = self._sessions[key] = SessionKV(self, key, max_length,
                                                 self.n_layers if n_layers is None else n_layers)
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
            self.used_bytes -= kv.nbytes
            kv.k = kv.v = self.empty(0, kv.n_layers)
            return True

    def evict_expired(self) -> list[Hashable]:
        with self._lock:
            now = self.clock()
            expired = [k for k, kv in self._sessions.items() if now - kv.last_used > self.ttl_s]
            for key in expired:
                self.release(key)
            return expired

    def charge(self, kv: SessionKV, delta: int) -> None:
        with self._lock:
            if self.used_bytes + delta > self.budget_bytes:
                self.evict_expired()
            if self.used_bytes + delta > self.budget_bytes:
                raise KVBudgetExceeded(f"KV budget of {self.budget_bytes} bytes is full"
                                       f" ({self.used_bytes} used, {delta} more asked)")
            if kv.key not in self._sessions:
                raise CacheMiss(f"session {kv.key!r} was released while growing")
            self.used_bytes += delta

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Hashable]:
        with self._lock:
            return list(self._sessions)
