"""A shard's service under concurrent sessions: their frames share passes, each gets its solo answer,
and past its bounds it answers `busy` at once."""

import threading
import time
from functools import partial

import pytest
import trio

from meshd.core.compute import ComputeExecutor
from meshd.hop import service as service_module
from meshd.hop.service import RUN_AHEAD, ShardService
from meshd.shard.artifact import open_artifact
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
from meshd.hop.scheduler import Scheduler
from meshd.wire import Close, Error, ErrorCode, OpenSession, Opened, Phase, Token
from tests import tiny_models

QT = tiny_models.gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 201], [9], [40, 41, 42], [7, 7, 7, 7, 7], [3, 1], [100]]
STEPS = 8


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model = tiny_models.tiny_llama(seed=5)
    tiny_models.quantize_linear_weights(model, QT.Q4_0)
    return open_artifact(tiny_models.write_llama_gguf(model, tmp_path_factory.mktemp("m") / "m.gguf", qtype=QT.Q4_0))


@pytest.fixture
def compute():
    executor = ComputeExecutor().start_thread()
    yield executor
    executor.stop()


def service_for(artifact, compute, kv_budget=1 << 26, max_sessions=64, max_queued=1024):
    shard = Shard(artifact, 0, artifact.config.n_layers, NATIVE, kv_budget_bytes=kv_budget)
    endpoint = ShardEndpoint(shard, "m", "r", max_sessions=max_sessions)
    return ShardService(endpoint, compute, Scheduler(max_queued=max_queued))


def open_msg(sid: bytes, temperature=0.0, max_length=64, microbatch=0) -> OpenSession:
    return OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=6, model_fingerprint="m",
                       recipe_fingerprint="r", max_length=max_length, temperature=temperature, top_k=20, seed=11,
                       microbatch=microbatch)


async def session(service, sid: bytes, prompt: list[int], temperature=0.0, microbatch=0) -> list[int]:
    """Greedy (or seeded) tokens of one session: open, prefill, STEPS decode steps, close."""
    (opened,) = await service.handle(open_msg(sid, temperature, microbatch=microbatch))
    assert isinstance(opened, Opened), opened
    (tok,) = await service.handle(token_frame(sid, 0, 0, Phase.PREFILL, 0, prompt))
    tokens = [tok.token_id]
    for i in range(STEPS):
        (tok,) = await service.handle(token_frame(sid, 0, i + 1, Phase.DECODE, len(prompt) + i, [tokens[-1]]))
        assert isinstance(tok, Token), tok
        tokens.append(tok.token_id)
    await service.handle(Close(session_id=sid, epoch=0))
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_concurrent_sessions_share_passes_and_get_their_solo_tokens(artifact, compute, temperature):
    service = service_for(artifact, compute)

    async def main():
        solo = [await session(service, bytes([k]) * 16, p, temperature) for k, p in enumerate(PROMPTS)]
        solo_passes = service.stats.steps
        together = [None] * len(PROMPTS)

        async def one(k):
            together[k] = await session(service, bytes([100 + k]) * 16, PROMPTS[k], temperature)

        async with trio.open_nursery() as nursery:
            for k in range(len(PROMPTS)):
                nursery.start_soon(one, k)
        return solo, together, service.stats.steps - solo_passes

    solo, together, passes = trio.run(main)
    assert together == solo
    # 8 sessions x 9 frames alone took 72 passes; together they shared them
    assert passes < len(PROMPTS) * (STEPS + 1) / 2, passes
    assert service.scheduler.stats.largest >= 4
    assert len(service.endpoint.shard.kv) == 0 and service.scheduler.queued == 0


def test_sessions_in_different_microbatches_never_share_a_pass(artifact, compute):
    service = service_for(artifact, compute)
    microbatches_of_passes = []
    schedule = service.scheduler.schedule

    def recording():
        batch = schedule()
        if batch:
            microbatches_of_passes.append({w.microbatch for w in batch})
        return batch

    service.scheduler.schedule = recording

    async def main():
        solo = [await session(service, bytes([k]) * 16, p) for k, p in enumerate(PROMPTS)]
        microbatches_of_passes.clear()
        together = [None] * len(PROMPTS)

        async def one(k):
            together[k] = await session(service, bytes([100 + k]) * 16, PROMPTS[k], microbatch=k % 3)

        async with trio.open_nursery() as nursery:
            for k in range(len(PROMPTS)):
                nursery.start_soon(one, k)
        return solo, together

    solo, together = trio.run(main)
    assert together == solo
    assert all(len(microbatches) == 1 for microbatches in microbatches_of_passes)
    assert set().union(*microbatches_of_passes) == {0, 1, 2}
    assert service.scheduler.stats.largest >= 2  # sessions of one microbatch still share passes


def test_a_full_queue_answers_busy_at_once(artifact, compute):
    service = service_for(artifact, compute, max_queued=2)

    async def main():
        sids = [bytes([k]) * 16 for k in range(4)]
        for sid in sids:
            await service.handle(open_msg(sid))
        replies = [None] * 4

        async def one(k):
            replies[k] = await service.handle(token_frame(sids[k], 0, 0, Phase.PREFILL, 0, [1, 2, 3]))

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(one, k)
        return replies

    replies = trio.run(main)
    busy = [r[0] for r in replies if isinstance(r[0], Error)]
    # the first frame runs at once, two wait, the fourth is refused
    assert len(busy) == 1 and busy[0].code == ErrorCode.BUSY and busy[0].retriable and busy[0].retry_after_s > 0
    assert sum(isinstance(r[0], Token) for r in replies) == 3
    assert service.scheduler.stats.refused == 1


def test_sessions_past_the_bounds_are_refused_as_busy(artifact, compute):
    service = service_for(artifact, compute, max_sessions=2)
    shard = service.endpoint.shard
    per_session = shard.kv.bytes_for(64, 6)

    async def main():
        out = [await service.handle(open_msg(bytes([k]) * 16)) for k in range(3)]
        await service.release((bytes([0]) * 16, 0))
        out.append(await service.handle(open_msg(b"\x09" * 16)))
        return out

    a, b, c, d = (r[0] for r in trio.run(main))
    assert isinstance(a, Opened) and isinstance(b, Opened) and isinstance(d, Opened)
    assert c.code == ErrorCode.BUSY and c.retriable and c.retry_after_s > 0 and "limit" in c.message

    # the KV budget is promised at open, at the length each session asks for
    service = service_for(artifact, compute, kv_budget=per_session * 2 + per_session // 2)
    replies = trio.run(lambda: _open_all(service, 3))
    assert [type(r).__name__ for r in replies] == ["Opened", "Opened", "Error"]
    assert "KV budget" in replies[2].message and service.endpoint.refused == 1


async def _open_all(service, n):
    return [(await service.handle(open_msg(bytes([k]) * 16)))[0] for k in range(n)]


def test_a_caller_that_gives_up_leaves_nothing_queued(artifact, compute):
    service = service_for(artifact, compute)

    async def main():
        a, b = b"a" * 16, b"b" * 16
        for sid in (a, b):
            await service.handle(open_msg(sid))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.handle, token_frame(a, 0, 0, Phase.PREFILL, 0, list(range(1, 60))))
            await trio.sleep(0)  # a's prefill is running; b's frame waits for the next pass
            with trio.move_on_after(0):
                await service.handle(token_frame(b, 0, 0, Phase.PREFILL, 0, [1, 2]))
        assert service.scheduler.queued == 0
        return await service.handle(token_frame(b, 0, 0, Phase.PREFILL, 0, [1, 2]))

    (tok,) = trio.run(main)
    assert isinstance(tok, Token)


def test_a_pass_can_wait_for_frames_due_from_other_sessions(artifact, compute):
    """With a gather window, a frame arriving a moment after another (the same upstream pass, other
    streams) joins its pass instead of waiting for the next one."""
    results = {}
    for gather in (0.0, 0.2):
        service = service_for(artifact, compute)
        service.gather_s = gather

        async def main():
            a, b = b"a" * 16, b"b" * 16
            for sid in (a, b):
                await service.handle(open_msg(sid))
            before = service.stats.steps
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.handle, token_frame(a, 0, 0, Phase.PREFILL, 0, [1, 2, 3]))
                await trio.sleep(0.02)
                nursery.start_soon(service.handle, token_frame(b, 0, 0, Phase.PREFILL, 0, [4, 5]))
            return service.stats.steps - before

        results[gather] = trio.run(main)
    assert results == {0.0: 2, 0.2: 1}


async def run_tokens(service, sid: bytes, prompt: list[int], first: int, steps: int, stop=frozenset()) -> list[int]:
    """The tokens of a decode run of `sid` after `first` (the prefill's token), as they arrive."""
    def frame_of(i, fed):
        return token_frame(sid, 0, i + 1, Phase.DECODE, len(prompt) + i, [fed])

    out = []
    async with service.decode_run(frame_of, first, steps, frozenset(stop)) as replies:
        async for replies_of_step, took in replies:
            assert isinstance(replies_of_step[0], Token) and took > 0
            out.append(replies_of_step[0].token_id)
    return out


@pytest.fixture
def unhurried(monkeypatch):
    """Runs that never stop for a caller behind them (a tiny model's steps outrun any reader)."""
    monkeypatch.setattr(service_module, "RUN_AHEAD", 1 << 30)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_a_decode_run_gives_the_tokens_of_ordinary_steps_and_stops_at_a_stop_token(artifact, compute, temperature,
                                                                                  unhurried):
    service = service_for(artifact, compute)
    prompt = PROMPTS[1]

    async def main():
        steps = await session(service, b"s" * 16, prompt, temperature)
        await service.handle(open_msg(b"r" * 16, temperature))
        (first,) = await service.handle(token_frame(b"r" * 16, 0, 0, Phase.PREFILL, 0, prompt))
        before = (service.stats.steps, service.scheduler.stats.passes)
        run = await run_tokens(service, b"r" * 16, prompt, first.token_id, STEPS)
        counted = (service.stats.steps - before[0], service.scheduler.stats.passes - before[1])
        await service.handle(Close(session_id=b"r" * 16, epoch=0))
        # a stop token ends the run after it: the third token of the run stops it
        await service.handle(open_msg(b"t" * 16, temperature))
        await service.handle(token_frame(b"t" * 16, 0, 0, Phase.PREFILL, 0, prompt))
        stopped = await run_tokens(service, b"t" * 16, prompt, first.token_id, STEPS, stop={steps[3]})
        return steps, [first.token_id, *run], counted, stopped

    steps, run, counted, stopped = trio.run(main)
    assert run == steps  # bit for bit the tokens of one step a frame
    assert counted == (STEPS, STEPS)  # every step of the run counts as a pass
    assert stopped == steps[1:steps.index(steps[3]) + 1]


def test_a_decode_run_gives_way_to_other_work_and_to_a_caller_that_leaves(artifact, compute, unhurried):
    service = service_for(artifact, compute)
    prompt = PROMPTS[0]
    a, b = b"a" * 16, b"b" * 16

    def frame_of(i, fed, offset=0, hold=None):
        hold and hold(offset + i)
        return token_frame(a, 0, offset + i + 1, Phase.DECODE, len(prompt) + offset + i, [fed])

    def until_other_work_waits(i):  # on the compute thread: step 1 begins once b's frame waits for it
        deadline = time.monotonic() + 10
        while i == 1 and not service.compute.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)

    async def main():
        solo = await session(service, b"s" * 16, prompt)
        for sid in (a, b):
            await service.handle(open_msg(sid))
        (first,) = await service.handle(token_frame(a, 0, 0, Phase.PREFILL, 0, prompt))
        ran, other = [], []

        async def b_frame():
            other.extend(await service.handle(token_frame(b, 0, 0, Phase.PREFILL, 0, [4, 5])))

        async with trio.open_nursery() as nursery:
            async with service.decode_run(partial(frame_of, hold=until_other_work_waits), first.token_id, 1000,
                                          frozenset()) as replies:
                async for out, _ in replies:
                    ran.append(out[0].token_id)
                    if len(ran) == 1:
                        nursery.start_soon(b_frame)
        # b's frame came after step 0 (before step 1 began, or while it ran): its pass came next
        assert len(ran) in (1, 2) and isinstance(other[0], Token)
        # a caller that leaves ends the run within a step (50 ms steps here); the session goes on from
        # the token it took (a frame at an earlier position truncates the KV)
        before, taken = service.stats.steps, []
        slow = partial(frame_of, offset=len(ran), hold=lambda i: time.sleep(0.05))
        async with service.decode_run(slow, ran[-1], 1000, frozenset()) as replies:
            async for out, _ in replies:
                taken.append(out[0].token_id)
                break
        assert service.stats.steps - before < 10  # not the 1000 it was given
        fed = len(ran) + 1
        (nxt,) = await service.handle(token_frame(a, 0, fed + 1, Phase.DECODE, len(prompt) + fed, [taken[0]]))
        return solo, [first.token_id, *ran, *taken, nxt.token_id]

    solo, tokens = trio.run(main)
    assert tokens == solo[:len(tokens)]


async def run_replies(service, sid: bytes, prompt: list[int], steps: int, max_length=64, read_s=0.0) -> list:
    """Open `sid`, prefill, then a decode run of up to `steps`: each step's first reply, read every `read_s`."""
    await service.handle(open_msg(sid, max_length=max_length))
    (first,) = await service.handle(token_frame(sid, 0, 0, Phase.PREFILL, 0, prompt))
    got = []
    frame_of = lambda i, fed: token_frame(sid, 0, i + 1, Phase.DECODE, len(prompt) + i, [fed])  # noqa: E731
    async with service.decode_run(frame_of, first.token_id, steps, frozenset()) as replies:
        async for out, _ in replies:
            got.append(out[0])
            await trio.sleep(read_s)
    return got


def test_a_decode_run_ends_on_an_error_its_step_answers(artifact, compute, unhurried):
    """Past the length the session was opened for, a step answers an Error: the run's last reply."""
    service = service_for(artifact, compute)
    got = trio.run(partial(run_replies, service, b"e" * 16, PROMPTS[1], 1000, max_length=16))
    assert all(isinstance(t, Token) for t in got[:-1]) and len(got) == 16 - len(PROMPTS[1]) + 1
    assert isinstance(got[-1], Error) and "max length" in got[-1].message


def test_a_decode_run_stops_a_few_steps_ahead_of_a_slow_caller(artifact, compute):
    """As between ordinary steps, a caller slow to read (its client's text) slows the generation: the
    run stops once RUN_AHEAD steps wait unread, and the caller goes on with ordinary steps or a new run."""
    service = service_for(artifact, compute)
    got = trio.run(partial(run_replies, service, b"w" * 16, PROMPTS[1], 40, read_s=0.2))
    assert RUN_AHEAD <= len(got) <= RUN_AHEAD + 1 and all(isinstance(t, Token) for t in got)


def test_compute_busy_time_grows_while_a_long_job_runs():
    """A decode run is one job of many steps: status's compute_busy_s counts it as it goes."""
    executor = ComputeExecutor().start_thread()
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        release.wait(10)

    try:
        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.run, job)
                await trio.to_thread.run_sync(started.wait, 10)
                early = executor.busy_s  # the job still runs: it waits for `release`
                await trio.sleep(0.2)
                during = executor.busy_s
                release.set()
            return early, during, executor.busy_s

        early, during, after = trio.run(main)
        print(f"compute busy {early:.3f} s, then {during:.3f} s while the job ran, {after:.3f} s after")
        assert 0 < early < during <= after  # counted while the job runs, not only once it ended
    finally:
        executor.stop()


async def test_only_the_peer_that_opened_a_session_may_end_it_or_say_what_its_kv_holds(artifact, compute):
    """A Close names a session by id: another peer that learnt the id (a hop of the same route) must neither
    end it nor have its KV kept under tokens of its choosing (prefix reuse would apply them to the owner's
    later prompts)."""
    from meshd.shard import prefix

    service = service_for(artifact, compute)
    sid, key = b"o" * 16, (b"o" * 16, 0)
    (opened,) = await compute.run(service.endpoint.handle, open_msg(sid, max_length=64), "owner")
    assert isinstance(opened, Opened)
    await service.handle(token_frame(sid, 0, 0, Phase.PREFILL, 0, list(range(40))))
    forged = prefix.pack(prefix.chain(list(range(1000, 1032)), prefix.root("m", "r")))
    assert await service.handle(Close(session_id=sid, epoch=0, keep=forged), "intruder") == []
    assert key in service.endpoint.sessions and len(service.endpoint.shard.kv.kept) == 0
    await service.handle(Close(session_id=sid, epoch=0, keep=forged), "owner")
    assert key not in service.endpoint.sessions and len(service.endpoint.shard.kv.kept) == 1
