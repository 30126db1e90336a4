"""Prefix reuse: the index of kept KV (pure), the KV store that keeps and copies it, and a real shard whose
session started from kept KV computing the bits a fresh one computes."""

from dataclasses import replace

import pytest
import torch
from trio.testing import MockClock

from meshd import wire as w
from meshd.entry.affinity import Affinity
from meshd.entry.route import route_along
from meshd.dht.coverage import CoverageMap
from meshd.dht.record import CoverageRecord
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.shard import prefix
from meshd.shard.kv import KVBudgetExceeded, KVStore
from meshd.shard.prefix import BLOCK, PrefixIndex, chain, root

R = root("model", "recipe")
A = list(range(100, 100 + 5 * BLOCK))  # five blocks
B = A[:2 * BLOCK] + [7] * (3 * BLOCK)  # shares two blocks with A


def test_a_chain_names_the_tokens_of_whole_blocks_under_one_model():
    a = chain(A, R)
    assert len(a) == 5 and len(chain(A[:-1], R)) == 4 and chain(A[:BLOCK - 1], R) == []
    assert chain(A, R) == a  # the same tokens, the same names
    b = chain(B, R)
    assert b[:2] == a[:2] and not set(b[2:]) & set(a)  # from the first differing block on, nothing matches
    assert not set(chain(A, root("model", "other recipe"))) & set(a)
    assert not set(chain(A, root("model", "recipe", 1))) & set(a)  # the long RoPE table
    one = A.copy()
    one[0] += 1  # one token differs in the first block: every block's name differs
    assert not set(chain(one, R)) & set(a)
    assert prefix.unpack(prefix.pack(a)) == a
    with pytest.raises(ValueError, match="not at most"):
        prefix.unpack(b"x" * 17)
    assert prefix.unpack_or_none(b"x" * 17) == []


def test_the_index_finds_the_longest_kept_prefix_in_its_scope_only():
    clock = MockClock()
    index = PrefixIndex(ttl_s=60, clock=clock.current_time)
    a, b = chain(A, R), chain(B, R)
    assert index.insert("peer1", a[:3], "a3", 30) == []
    assert index.match("peer1", a) == (index.entries()[0], 3)
    kept, blocks = index.match("peer1", b)
    assert (kept.value, blocks) == ("a3", 2)  # a different conversation sharing two blocks: exactly those
    assert index.match("peer2", a) == (None, 0)  # another entry's request finds nothing
    assert index.match("peer1", chain([1] * 64, R)) == (None, 0)
    # a later turn that extends the kept tokens supersedes them; a prefix of what is kept is not kept again
    superseded = index.insert("peer1", a, "a5", 50)
    assert [k.value for k in superseded] == ["a3"] and len(index) == 1 and index.held_bytes == 50
    assert [k.value for k in index.insert("peer1", a[:4], "a4", 40)] == ["a4"] and len(index) == 1
    # a branch is kept beside it; both answer for their shared blocks, each alone for its own
    assert index.insert("peer1", b, "b5", 50) == []
    assert index.match("peer1", b)[0].value == "b5" and index.match("peer1", a)[0].value == "a5"
    index.remove(index.match("peer1", b)[0])
    assert index.match("peer1", b)[0].value == "a5" and index.match("peer1", b)[1] == 2


def test_the_index_evicts_the_least_recently_used_and_the_idle_past_its_ttl():
    clock = MockClock()
    index = PrefixIndex(ttl_s=10, clock=clock.current_time)
    index.insert("p", chain(A, R), "a", 1)
    clock.jump(4)
    index.insert("p", chain(B[:3 * BLOCK] + [9] * BLOCK, R)[2:], "c", 1)  # another conversation (made-up chain)
    clock.jump(4)
    index.touch(index.match("p", chain(A, R))[0])  # "a" used again: now "c" is the oldest
    assert index.oldest().value == "c"
    clock.jump(7)  # "c" idle 11 s, "a" 7 s
    assert [k.value for k in index.expired()] == ["c"] and index.stats.evictions == 1
    clock.jump(4)
    assert [k.value for k in index.expired()] == ["a"] and len(index) == 0


def store(budget_positions: int, clock=None, prefix_ttl_s: float = 60.0) -> KVStore:
    return KVStore(2, 2, 4, torch.float32, budget_bytes=2 * 2 * 2 * 4 * 4 * budget_positions,
                   clock=clock or MockClock().current_time, prefix_ttl_s=prefix_ttl_s)


def fill(kv_store: KVStore, key, n: int, seed: int):
    kv = kv_store.open(key, max_length=512)
    kv.reserve(0, n)
    g = torch.Generator().manual_seed(seed)
    kv.k[:, :, :, :n] = torch.randn(kv.k[:, :, :, :n].shape, generator=g)
    kv.v[:, :, :, :n] = torch.randn(kv.v[:, :, :, :n].shape, generator=g)
    kv.commit(n)
    return kv.k[:, :, :, :n].clone(), kv.v[:, :, :, :n].clone()


def test_kept_kv_is_copied_into_a_new_session_that_extends_its_tokens():
    s = store(1024)
    k, v = fill(s, "turn1", 70, seed=1)  # 70 positions: four whole blocks are kept
    assert s.keep("turn1", "entry", chain(A, R)) == 4 * BLOCK
    assert s.sessions() == [] and s.used_bytes > 0 and len(s.kept) == 1
    s.open("turn2", max_length=512)
    assert s.reuse("turn2", "entry", chain(A, R)) == 4 * BLOCK
    kv = s.get("turn2")
    assert kv.length == 4 * BLOCK
    assert torch.equal(kv.k[:, :, :, :4 * BLOCK], k[:, :, :, :4 * BLOCK])
    assert torch.equal(kv.v[:, :, :, :4 * BLOCK], v[:, :, :, :4 * BLOCK])
    s.open("other", max_length=512)
    assert s.reuse("other", "another entry", chain(A, R)) == 0  # never across requesters
    s.open("branch", max_length=512)
    assert s.reuse("branch", "entry", chain(B, R)) == 2 * BLOCK  # only the shared blocks
    assert s.kept.summary() | {"held_bytes": 0} == {"entries": 1, "held_bytes": 0, "held_tokens": 64, "hits": 2,
                                                     "misses": 1, "tokens_reused": 96, "evictions": 0, "ttl_s": 60.0}
    s.get("turn2").reserve(4 * BLOCK, 1)  # a session started from kept KV goes on as any
    for key in ("turn2", "other", "branch"):
        s.release(key)
    s.drop_kept()
    assert s.used_bytes == 0


def test_kept_kv_gives_way_to_live_sessions_first_and_is_never_the_room_for_its_own_copy():
    s = store(256)
    fill(s, "old", 128, seed=2)
    assert s.keep("old", "e", chain(A + A, R)) == 128
    # a live session growing to the whole budget frees the kept KV rather than failing
    fill(s, "live", 256, seed=3)
    assert len(s.kept) == 0 and s.kept.stats.evictions == 1 and s.used_bytes == s.budget_bytes
    s.release("live")
    fill(s, "old", 128, seed=2)
    s.keep("old", "e", chain(A + A, R))
    s.open("copy", max_length=512)
    fill(s, "filler", 64, seed=4)  # the copy of 128 positions fits only if the kept KV were its room
    assert s.reuse("copy", "e", chain(A + A, R)) == 0  # so nothing is copied, and the kept KV stays
    assert len(s.kept) == 1 and s.get("copy").length == 0
    with pytest.raises(KVBudgetExceeded):
        s.get("copy").reserve(0, 200)  # more than the budget holds at all: kept KV freed, still refused
    assert len(s.kept) == 0


def test_kept_kv_expires_after_its_own_ttl_and_keeping_can_be_off():
    clock = MockClock()
    s = store(1024, clock=clock.current_time, prefix_ttl_s=5)
    fill(s, "a", 64, seed=5)
    s.keep("a", "e", chain(A, R))
    clock.jump(6)
    assert s.evict_expired() == [] and len(s.kept) == 0 and s.used_bytes == 0
    off = store(1024, prefix_ttl_s=0)
    fill(off, "a", 64, seed=5)
    assert off.keep("a", "e", chain(A, R)) == 0 and off.used_bytes == 0


def test_affinity_names_the_route_of_the_longest_prefix_and_the_planner_checks_it_still_serves():
    aff = Affinity(ttl_s=60, clock=MockClock().current_time)
    aff.remember(chain(A, R), [["p1", 10, 20], ["p2", 20, 30]])
    assert aff.route_for(chain(B, R)) == ([["p1", 10, 20], ["p2", 20, 30]], 2 * BLOCK)
    assert aff.route_for(chain([5] * 64, R)) == ([], 0)
    rec = lambda peer, a, b: CoverageRecord(peer, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), "m", "r", a, b, 30,  # noqa: E731
                                            serving=True, expires_at=1e12)
    cov = CoverageMap(30, (rec("p1", 5, 20), rec("p2", 20, 30), rec("p3", 10, 30)))
    spans = [["p1", 10, 20], ["p2", 20, 30]]
    route = route_along(cov, 10, spans, lambda peer: 0.001)
    assert route is not None and route.describe() == spans
    assert route_along(cov, 10, spans, lambda peer: 0.001, exclude={"p2"}) is None  # failed, full or excluded
    assert route_along(cov.without("p1"), 10, spans, lambda peer: 0.001) is None  # gone
    assert route_along(cov, 0, spans, lambda peer: 0.001) is None  # another entry range


@pytest.fixture(scope="module")
def smollm2_native():
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    art = open_artifact("smollm2")
    return Shard(art, 0, 30, get_recipe("native", art))


def open_msg(sid: bytes, asked: list[bytes] = ()) -> w.OpenSession:
    return w.OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=30, model_fingerprint="m",
                         recipe_fingerprint="r", max_length=256, prefix=prefix.pack(asked))


def prefill(ep: ShardEndpoint, sid: bytes, ids: list[int], start: int = 0) -> w.Token:
    replies = []
    spans = [(a + start, b + start) for a, b in w.chunk_spans(len(ids) - start, 32)]
    for i, (a, b) in enumerate(spans):
        replies = ep.handle(token_frame(sid, 0, 0, w.Phase.PREFILL, a, ids[a:b], i, len(spans)))
    return replies[0]


@pytest.mark.slow
def test_a_session_started_from_kept_kv_computes_the_bits_of_a_fresh_one(smollm2_native):
    ep = ShardEndpoint(smollm2_native, "m", "r")
    turn1 = list(range(1000, 1090))  # 90 tokens
    turn2 = turn1 + [5, 6, 7] + list(range(2000, 2040))
    (opened,) = ep.handle(open_msg(b"1" * 16, chain(turn1[:-1], R)), "entry")
    assert opened.reused == 0
    first = prefill(ep, b"1" * 16, turn1)
    ep.handle(w.Close(session_id=b"1" * 16, epoch=0, keep=prefix.pack(chain(turn1, R))), "entry")
    assert ep.sessions == {} and len(ep.shard.kv.kept) == 1
    (opened,) = ep.handle(open_msg(b"2" * 16, chain(turn2[:-1], R)), "entry")
    assert opened.reused == 80  # five whole blocks of the 90 tokens kept
    reused = prefill(ep, b"2" * 16, turn2, start=opened.reused)
    (opened,) = ep.handle(open_msg(b"3" * 16), "entry")  # asks for nothing: a fresh prefill
    assert opened.reused == 0
    fresh = prefill(ep, b"3" * 16, turn2)
    assert (reused.token_id, reused.logprob) == (fresh.token_id, fresh.logprob)
    # and the decode steps after it: the same tokens, the same log-probabilities
    pos = len(turn2)
    for _ in range(4):
        a = ep.handle(token_frame(b"2" * 16, 0, 1, w.Phase.DECODE, pos, [reused.token_id]))[0]
        b = ep.handle(token_frame(b"3" * 16, 0, 1, w.Phase.DECODE, pos, [fresh.token_id]))[0]
        assert (a.token_id, a.logprob) == (b.token_id, b.logprob)
        reused, fresh, pos = a, b, pos + 1
    # another requester, or the same tokens under another root, find nothing
    (opened,) = ep.handle(open_msg(b"4" * 16, chain(turn2[:-1], R)), "someone else")
    assert opened.reused == 0
    (opened,) = ep.handle(open_msg(b"5" * 16, chain(turn2[:-1], root("m", "r", 1))), "entry")
    assert opened.reused == 0
    assert first.token_id >= 0
    # a malformed chain is refused before anything is held; a Close with one still closes
    (err,) = ep.handle(replace(open_msg(b"6" * 16), prefix=b"x" * 5), "entry")
    assert err.code == w.ErrorCode.BAD_FRAME and (b"6" * 16, 0) not in ep.sessions
    ep.handle(w.Close(session_id=b"2" * 16, epoch=0, keep=b"x" * 5))
    assert (b"2" * 16, 0) not in ep.sessions
    for sid in (b"3", b"4", b"5"):
        ep.handle(w.Close(session_id=sid * 16, epoch=0))
    ep.shard.kv.drop_kept()
    assert ep.shard.kv.used_bytes == 0
