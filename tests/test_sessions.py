"""KV sessions, sampling and the wire endpoint of a shard, on a tiny model."""

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.shard.kv import CacheMiss, KVBudgetExceeded, KVStore
from meshd.shard.runtime import Shard
from meshd.shard.sampler import Sampler, SamplingParams
from meshd import wire as w
from tests import tiny_models
from tests.test_shard_tiny import PROMPT, split_run, three_way


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return open_artifact(tiny_models.write_llama_gguf(tiny_models.tiny_llama(seed=5), d / "t.gguf"))


def test_interleaved_sessions_equal_solo_runs(artifact):
    shards = three_way(artifact)
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7], PROMPT[::-1]]
    solo = [split_run(shards, p, 12, key=f"solo{i}")[0] for i, p in enumerate(prompts)]
    state = []
    for i, p in enumerate(prompts):
        for s in shards:
            s.open_session(("mix", i))
        state.append({"x": torch.tensor([p]), "pos": 0, "tokens": []})
    for _ in range(12):
        for i, st in enumerate(state):  # one step of each session in turn
            x = st["x"]
            for s in shards:
                x = s.forward(("mix", i), x, st["pos"])
            st["pos"] += st["x"].shape[1]
            st["tokens"].append(int(x.argmax()))
            st["x"] = torch.tensor([[st["tokens"][-1]]])
    assert [st["tokens"] for st in state] == solo
    held = [s.kv.used_bytes for s in shards]
    assert all(h > 0 for h in held)
    for i in range(4):
        for s in shards:
            assert s.release(("mix", i))
    assert [s.kv.used_bytes for s in shards] == [0, 0, 0]


def test_kv_budget_ttl_and_cache_miss():
    now = [0.0]
    store = KVStore(2, 2, 8, torch.float32, budget_bytes=2 * 2 * 2 * 64 * 8 * 4, ttl_s=10, clock=lambda: now[0])
    a = store.open("a", max_length=256)
    a.reserve(0, 64)  # exactly the budget
    assert store.used_bytes == store.budget_bytes
    b = store.open("b", max_length=256)
    with pytest.raises(KVBudgetExceeded, match="budget"):
        b.reserve(0, 1)
    now[0] = 11.0  # "a" idles past its TTL and is evicted to make room
    b.reserve(0, 1)
    with pytest.raises(CacheMiss):
        store.get("a")
    assert store.sessions() == ["b"]
    assert store.release("b") and store.used_bytes == 0
    with pytest.raises(CacheMiss):
        store.get("b")


def test_endpoint_evicts_idle_sessions(artifact):
    now = [0.0]
    shard = Shard(artifact, 0, 3, kv_ttl_s=10)
    shard.kv.clock = lambda: now[0]
    ep = ShardEndpoint(shard, "m", "r")
    ep.handle(w.OpenSession(request_id=1, session_id=b"e" * 16, epoch=0, start=0, end=3, model_fingerprint="m",
                            recipe_fingerprint="r"))
    ep.handle(token_frame(b"e" * 16, 0, 0, w.Phase.PREFILL, 0, [1, 2]))
    assert shard.kv.used_bytes > 0 and ep.evict_expired() == []
    now[0] = 11.0
    assert ep.evict_expired() == [(b"e" * 16, 0)]
    assert shard.kv.used_bytes == 0 and not ep.sessions
    (err,) = ep.handle(token_frame(b"e" * 16, 0, 1, w.Phase.DECODE, 2, [3]))
    assert err.code == w.ErrorCode.UNKNOWN_SESSION


def test_a_trickled_session_gives_its_kv_to_a_new_one_once_the_shard_is_full(artifact):
    """One tiny Forward every 50 s keeps a session within its 600 s TTL forever; once it has been
    unused for `idle_when_full` and the shard is full, a new session (from any peer) takes its room,
    at the event loop's admission and at the endpoint's."""
    from types import SimpleNamespace

    from meshd.hop.intake import Intake

    now = [0.0]
    shard = Shard(artifact, 0, 3, kv_ttl_s=600)
    shard.kv.clock = lambda: now[0]
    ep = ShardEndpoint(shard, "m", "r", max_sessions=1, idle_when_full=60)
    intake, service = Intake(), SimpleNamespace(endpoint=ep)

    def open_msg(sid):
        return w.OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=3, model_fingerprint="m",
                             recipe_fingerprint="r")

    trickled = b"t" * 16
    assert isinstance(ep.handle(open_msg(trickled))[0], w.Opened)
    for step in range(20):  # 1000 s: past the TTL, yet it was never idle for the TTL
        now[0] += 50
        assert not isinstance(ep.handle(token_frame(trickled, 0, step, w.Phase.DECODE, step, [1]))[0], w.Error)
        assert ep.evict_expired() == []
    now[0] += 59  # still in use: a newcomer finds the shard full
    assert intake.admission(service, "B", open_msg(b"n" * 16)).code == w.ErrorCode.BUSY
    assert ep.handle(open_msg(b"n" * 16))[0].code == w.ErrorCode.BUSY and ep.free_sessions() == 0
    now[0] += 2  # unused for 61 s: its room is free for whoever needs it
    assert ep.free_sessions() == 1 and list(ep.sessions) == [(trickled, 0)]
    assert intake.admission(service, "B", open_msg(b"n" * 16)) is None
    assert isinstance(ep.handle(open_msg(b"n" * 16))[0], w.Opened)
    assert list(ep.sessions) == [(b"n" * 16, 0)] and shard.kv.sessions() == [(b"n" * 16, 0)]
    (err,) = ep.handle(token_frame(trickled, 0, 20, w.Phase.DECODE, 20, [1]))
    assert err.code == w.ErrorCode.UNKNOWN_SESSION


def test_kv_replay_truncates_and_max_length_is_enforced():
    store = KVStore(1, 1, 4, torch.float32, budget_bytes=1 << 20)
    kv = store.open("s", max_length=100)
    kv.reserve(0, 10)
    kv.commit(10)
    kv.reserve(4, 2)  # a replay from position 4
    assert kv.length == 4
    with pytest.raises(ValueError, match="max length"):
        kv.reserve(4, 97)


def test_sampler_is_seeded_and_respects_filters():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    draw = lambda p, positions: [Sampler(p).sample(logits, i)[0] for i in positions]  # noqa: E731
    p = SamplingParams(temperature=1.0, top_k=50, seed=7)
    assert draw(p, range(20)) == draw(p, range(20))
    # a draw depends on (seed, position) only: not on what the sampler drew before
    s = Sampler(p)
    assert [s.sample(logits, i)[0] for i in (5, 3, 5, 3)] == draw(p, [5, 3, 5, 3]) == draw(p, [5, 3]) * 2
    assert len(set(draw(p, range(20)))) > 1 and draw(p, range(20)) != draw(SamplingParams(1.0, 50, 1.0, 8), range(20))
    s = Sampler(SamplingParams(temperature=0.8, top_k=5, seed=1))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert {s.sample(logits, i)[0] for i in range(200)} <= top5
    s = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))
    assert {s.sample(logits, i)[0] for i in range(20)} == {int(logits.argmax())}
    assert Sampler(SamplingParams()).sample(logits)[0] == int(logits.argmax())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_endpoint_checks_fingerprints_and_range(artifact):
    ep = ShardEndpoint(Shard(artifact, 0, 3), "model-fp", "recipe-fp")
    base = dict(request_id=1, session_id=b"s" * 16, epoch=0, start=0, end=3, model_fingerprint="model-fp",
                recipe_fingerprint="recipe-fp")
    assert isinstance(ep.handle(w.OpenSession(**base))[0], w.Opened)
    for change, code in [({"model_fingerprint": "other"}, w.ErrorCode.MODEL_MISMATCH),
                         ({"recipe_fingerprint": "other"}, w.ErrorCode.RECIPE_MISMATCH),
                         ({"end": 4}, w.ErrorCode.BAD_FRAME)]:
        (err,) = ep.handle(w.OpenSession(**(base | change)))
        assert isinstance(err, w.Error) and err.code == code, err
    # a forward for a session that was never opened is a clean, retriable error
    (err,) = ep.handle(token_frame(b"x" * 16, 0, 0, w.Phase.PREFILL, 0, [1, 2]))
    assert err.code == w.ErrorCode.UNKNOWN_SESSION and err.retriable
    # bad token ids do not hurt the open session
    (err,) = ep.handle(token_frame(b"s" * 16, 0, 0, w.Phase.PREFILL, 0, [9999]))
    assert err.code == w.ErrorCode.BAD_FRAME
    (fwd,) = ep.handle(token_frame(b"s" * 16, 0, 0, w.Phase.PREFILL, 0, [1, 2, 3]))
    assert isinstance(fwd, w.Forward) and fwd.tensors[0].shape == (1, 3, 64)
    ep.handle(w.Close(session_id=b"s" * 16, epoch=0))
    assert ep.shard.kv.used_bytes == 0 and not ep.sessions


def test_sessions_can_enter_mid_range_and_leave_early(artifact):
    whole = Shard(artifact, 0, 6)
    ref, _ = split_run([whole], PROMPT, 8, key="ref")
    a, b = Shard(artifact, 0, 4), Shard(artifact, 2, 6)
    # route: a serves [0, 3), b is entered at layer 3 of its [2, 6)
    a.open_session("m", start=0, end=3)
    b.open_session("m", start=3, end=6)
    assert b.kv.get("m").n_layers == 3
    tokens, x, pos = [], torch.tensor([PROMPT]), 0
    for _ in range(8):
        x = b.forward("m", a.forward("m", x, pos), pos)
        pos += 1 if tokens else len(PROMPT)
        tokens.append(int(x.argmax()))
        x = torch.tensor([[tokens[-1]]])
    assert tokens == ref
    with pytest.raises(ValueError, match="serves layers"):
        b.open_session("bad", start=1, end=6)
    ep = ShardEndpoint(b, "m", "r")
    (opened,) = ep.handle(w.OpenSession(request_id=1, session_id=b"q" * 16, epoch=0, start=4, end=6,
                                        model_fingerprint="m", recipe_fingerprint="r"))
    assert isinstance(opened, w.Opened) and ep.sessions[(b"q" * 16, 0)].sampler is not None
