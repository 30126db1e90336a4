"""Kept KV of ended sessions, found again by the tokens it covers (prefix reuse).

A token sequence is named by a hash chain over blocks of BLOCK tokens, as vLLM's automatic prefix
caching names its KV blocks: block i's hash is blake2b(block i-1's hash + block i's token ids), and
the chain starts from a root that binds the model and recipe fingerprints and the RoPE table. Equal
hashes at block i therefore mean equal tokens in blocks 0..i under the same model, so a request's
longest kept prefix is the last of its block hashes the index holds. Only whole blocks count: a
prefix that ends mid-block is reused up to the block before (at most BLOCK - 1 positions computed again).
Hops past the head never see token ids: the entry computes the chain and sends it, to ask for a
prefix (`OpenSession.prefix`) and to keep one (`Close.keep`).

Rules (the index is pure: `meshd/shard/kv.py` owns the bytes and calls it under its lock):
- An entry belongs to a scope (the peer whose session computed it, and the layers and table it ran)
  and is matched only in that scope: kept KV goes back only to the entry daemon that computed it, so an
  entry that misnamed the tokens its KV covers misleads itself alone, never another peer's generation.
- An entry whose chain is a prefix of one kept after it is superseded (dropped); one that is a prefix
  of an entry held already is not kept. A chat therefore holds one entry, its latest turn.
- Eviction: the least recently used first, under pressure; every entry idle past `ttl_s` at expiry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

BLOCK = 16  # tokens a hash covers
HASH_BYTES = 16
MAX_BLOCKS = 1024  # a chain sent on the wire covers at most this many blocks (16,384 tokens; 16 KiB of a frame's
# 64 KiB header, which a grammar shares: meshd/shard/grammar.py)


def root(model_fp: str, recipe_fp: str, table: int = 0) -> bytes:
    """Where a chain starts: the same tokens under another model, recipe or RoPE table hash apart."""
    return hashlib.blake2b(f"meshd-prefix\0{model_fp}\0{recipe_fp}\0{table}".encode(),
                           digest_size=HASH_BYTES).digest()


def chain(ids: Sequence[int], start: bytes, block: int = BLOCK, limit: int = MAX_BLOCKS) -> list[bytes]:
    """The hashes of the whole blocks of `ids` (at most `limit`), each over its tokens and the one before."""
    out, h = [], start
    data = np.asarray(ids, dtype="<u4").tobytes()
    width = 4 * block
    for b in range(min(len(ids) // block, limit)):
        h = hashlib.blake2b(h + data[b * width:(b + 1) * width], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out


def pack(hashes: Sequence[bytes]) -> bytes:
    return b"".join(hashes)


def unpack(data: bytes) -> list[bytes]:
    """A chain as it travels; ValueError for bytes that are not whole hashes or too many of them."""
    if len(data) % HASH_BYTES or len(data) // HASH_BYTES > MAX_BLOCKS:
        raise ValueError(f"a prefix chain of {len(data)} bytes is not at most {MAX_BLOCKS} hashes of {HASH_BYTES}")
    return [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def unpack_or_none(data: bytes) -> list[bytes]:
    """`unpack`, with a malformed chain read as none (a Close still closes: it keeps nothing)."""
    try:
        return unpack(data)
    except ValueError:
        return []


@dataclass(eq=False)
class Kept:
    """One ended session's KV, kept: `value` is whatever holds it (a `SessionKV`)."""

    scope: Hashable
    hashes: tuple[bytes, ...]
    value: object
    nbytes: int
    last_used: float

    @property
    def tokens(self) -> int:
        return len(self.hashes) * BLOCK


@dataclass
class PrefixStats:
    hits: int = 0  # sessions opened from kept KV
    misses: int = 0  # sessions that asked and found nothing
    tokens_reused: int = 0  # positions those hits did not compute
    evictions: int = 0  # entries dropped for room or idle past the TTL (superseded ones not counted)


@dataclass
class PrefixIndex:
    """Kept entries by scope and block hash, least recently used first."""

    ttl_s: float
    clock: Callable[[], float]
    stats: PrefixStats = field(default_factory=PrefixStats)
    _lru: OrderedDict = field(default_factory=OrderedDict)  # id(Kept) -> Kept, oldest first
    _by_hash: dict = field(default_factory=dict)  # (scope, hash) -> {Kept: its block index}, newest last

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def held_bytes(self) -> int:
        return sum(k.nbytes for k in self._lru.values())

    def entries(self) -> list[Kept]:
        return list(self._lru.values())

    def insert(self, scope: Hashable, hashes: Sequence[bytes], value: object, nbytes: int) -> list[Kept]:
        """Keep `value` under its chain; what it makes redundant comes back, out of the index, for the
        caller to free: the entries it supersedes, or itself when one held already covers it."""
        hashes = tuple(hashes)
        new = Kept(scope, hashes, value, nbytes, self.clock())
        if not hashes:
            return [new]
        for old in self._in_scope(scope):
            if len(old.hashes) >= len(hashes) and old.hashes[len(hashes) - 1] == hashes[-1]:
                self.touch(old)
                return [new]
        dropped = [old for old in self._in_scope(scope)
                   if len(old.hashes) < len(hashes) and old.hashes[-1] == hashes[len(old.hashes) - 1]]
        for old in dropped:
            self.remove(old)
        self._lru[id(new)] = new
        for i, h in enumerate(hashes):
            self._by_hash.setdefault((scope, h), {})[new] = i
        return dropped

    def _in_scope(self, scope: Hashable) -> list[Kept]:
        return [k for k in self._lru.values() if k.scope == scope]

    def match(self, scope: Hashable, hashes: Sequence[bytes]) -> tuple[Kept | None, int]:
        """The most recently used entry holding the longest prefix of `hashes`, and how many blocks."""
        for j in range(len(hashes) - 1, -1, -1):
            holders = self._by_hash.get((scope, hashes[j]))
            if holders:
                best = max(holders, key=lambda k: k.last_used)
                return best, j + 1
        return None, 0

    def touch(self, kept: Kept) -> None:
        kept.last_used = self.clock()
        self._lru.move_to_end(id(kept))

    def remove(self, kept: Kept) -> None:
        if self._lru.pop(id(kept), None) is None:
            return
        for h in kept.hashes:
            holders = self._by_hash.get((kept.scope, h))
            if holders is not None:
                holders.pop(kept, None)
                if not holders:
                    del self._by_hash[(kept.scope, h)]

    def oldest(self) -> Kept | None:
        return next(iter(self._lru.values()), None)

    def expired(self) -> list[Kept]:
        """Entries idle past the TTL, out of the index (counted as evictions), for the caller to free."""
        now = self.clock()
        out = [k for k in self._lru.values() if now - k.last_used > self.ttl_s]
        for k in out:
            self.remove(k)
        self.stats.evictions += len(out)
        return out

    def summary(self) -> dict:
        """What status, the dashboard and /metrics show."""
        s = self.stats
        return {"entries": len(self), "held_bytes": self.held_bytes,
                "held_tokens": sum(k.tokens for k in self._lru.values()), "hits": s.hits, "misses": s.misses,
                "tokens_reused": s.tokens_reused, "evictions": s.evictions, "ttl_s": self.ttl_s}
