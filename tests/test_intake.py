"""What other daemons' frames may take: the byte budget, the decoder's steps, a channel's flow
control and frame timeout, refused work that holds no memory, wrong dtypes (pure or in-memory)."""

import gc
import os
import platform
import weakref
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from meshd import wire as w
from meshd.p2p.budget import ByteBudget, Held, OverBudget
from meshd.p2p.channel import Channel, FrameStalled
from meshd.testing.hostile import half_frame, zeros_frame

SID = b"s" * 16


def glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def test_a_peer_past_its_share_waits_while_others_keep_their_floor():
    b = ByteBudget(total=100, per_peer=60)
    assert b.take_nowait("a", 50) and not b.take_nowait("a", 20)  # a's share is 60
    assert b.take_nowait("b", 50) and not b.take_nowait("c", 1)  # the total is 100
    assert b.refusal("a", 61) is not None and b.refusal("a", 60) is None
    b.give("a", 50)
    assert b.take_nowait("c", 10) and b.used == {"b": 50, "c": 10} and b.in_use == 60
    with pytest.raises(ValueError):
        ByteBudget(total=10, per_peer=20)


def test_the_budget_says_once_when_a_burst_is_over():
    b = ByteBudget(total=100, per_peer=100)
    b.take_nowait("a", 80)
    assert not b.trimmed(50)  # still held
    b.give("a", 80)
    assert b.trimmed(50) and not b.trimmed(50)
    b.take_nowait("a", 10)
    b.give("a", 10)
    assert not b.trimmed(50)  # a small burst is not worth a trim


async def test_take_waits_for_room_and_refuses_what_never_fits():
    b = ByteBudget(total=100, per_peer=60)
    held = Held(b, "a")
    await held.grow(50)
    with pytest.raises(OverBudget, match="exceeds a peer's frame budget"):
        await Held(b, "a").grow(61)
    got = []

    async def second():
        await Held(b, "a").grow(30)
        got.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(1)
        assert got == []  # a's share is taken: it waits
        held.release()
    assert got and b.used["a"] == 30


def test_the_decoder_knows_a_frame_s_cost_from_its_header_before_its_body():
    frame = zeros_frame(SID, 1 << 20, 576)  # 1 MiB of zeros in a few hundred bytes
    assert len(frame) < 4096
    d = w.Decoder()
    d.push(frame[:8])
    assert d.head() is None  # not even the preamble yet
    d.push(frame[8:12])
    head = d.head()
    assert head.body_len == len(frame) - 12 and head.raw_len is None
    d.push(frame[12:40])  # the header is in: its tensors' raw size is known, nothing inflated yet
    assert d.head().raw_len in (None, (1 << 20) // (576 * 4) * 576 * 4)
    d.push(frame[40:])
    assert d.head().raw_len == (1 << 20) // (576 * 4) * 576 * 4
    raw = d.take()
    assert raw is not None and d.take() is None and d.buffered == 0
    msg = d.decode(raw)
    assert msg.tensors[0].nbytes == raw.head.raw_len


def test_stepwise_decoding_byte_by_byte_gives_the_frames_feed_gives():
    msgs = [w.Heartbeat(seq=1), w.Forward(session_id=SID, epoch=0, step=1, phase=w.Phase.DECODE, position=3,
                                          tensors=(w.Tensor("hidden", (1, 1, 4), "float32", bytes(16)),))]
    data = b"".join(w.encode(m, "zstd") for m in msgs)
    d, out = w.Decoder(), []
    for i in range(len(data)):
        d.push(data[i:i + 1])
        d.head()
        while (raw := d.take()) is not None:
            out.append(d.decode(raw))
    assert out == msgs == w.Decoder().feed(data)


def _pair(budget=None, frame_timeout=30.0):
    a, b = trio.testing.memory_stream_pair()
    sender = Channel.over_trio(a)
    receiver = Channel.over_trio(b)
    receiver.peer, receiver.budget, receiver.frame_timeout = "attacker", budget, frame_timeout
    return sender, receiver


async def test_a_zstd_bomb_past_the_share_is_refused_before_it_is_inflated():
    budget = ByteBudget(total=8 << 20, per_peer=4 << 20)
    sender, receiver = _pair(budget)
    await sender.send_bytes(zeros_frame(SID, 16 << 20, 576))
    with pytest.raises(w.FrameTooLarge, match="frame budget"):
        await receiver.receive(5)
    assert budget.in_use == 0 and budget.high_water == 0  # nothing was ever taken, nothing inflated


async def test_frames_past_the_share_wait_unread_until_the_first_is_released(autojump_clock):
    budget = ByteBudget(total=8 << 20, per_peer=3 << 20)
    sender, receiver = _pair(budget)
    for step in range(2):  # 2 MiB each once inflated: one fits the share at a time
        await sender.send_bytes(zeros_frame(SID, 2 << 20, 576, step=step))
    first, held = await receiver.receive_held(5)
    assert budget.used["attacker"] == first.tensors[0].nbytes
    with trio.move_on_after(3) as waited:
        await receiver.receive(10)
    assert waited.cancelled_caught  # flow control: the second frame waits, its bytes not read
    held.release()
    second = await receiver.receive(10)
    assert second.step == 1 and budget.in_use == 0


async def test_a_half_sent_frame_is_dropped_after_the_frame_timeout(autojump_clock):
    budget = ByteBudget(total=64 << 20, per_peer=32 << 20)
    sender, receiver = _pair(budget, frame_timeout=5.0)
    await sender.send_bytes(half_frame(1 << 20, 4096))
    t0 = trio.current_time()
    with pytest.raises(FrameStalled, match="not whole within 5 s"):
        await receiver.receive(300)
    assert trio.current_time() - t0 == pytest.approx(5.0)
    assert budget.in_use == 0


async def test_an_idle_stream_still_gets_its_whole_idle_timeout(autojump_clock):
    sender, receiver = _pair(ByteBudget(total=1 << 20, per_peer=1 << 20), frame_timeout=5.0)
    with pytest.raises(trio.TooSlowError) as info:
        await receiver.receive(60)
    assert not isinstance(info.value, FrameStalled)


def _tiny_shard(tmp_path, start, end):
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import NATIVE
    from meshd.shard.runtime import Shard
    from tests import tiny_models

    model = tiny_models.tiny_llama(seed=3)
    return Shard(open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf")), start, end, NATIVE)


def test_a_refused_job_holds_its_input_no_longer_than_its_caller(tmp_path):
    shard = _tiny_shard(tmp_path, 1, 2)
    shard.open_session("a")
    x = torch.zeros(1, 1 << 16, shard.config.hidden)  # far past the positions a session may hold
    ref = weakref.ref(x)
    gc.disable()
    try:
        (out,) = shard.forward_batch([("a", x, 0)])
        assert isinstance(out, Exception) and out.__traceback__ is None
        del x
        assert ref() is None  # freed at once, not when the cyclic collector runs
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.bfloat16])
def test_hidden_states_of_a_wrong_dtype_are_refused_like_a_wrong_width(tmp_path, dtype):
    shard = _tiny_shard(tmp_path, 1, 2)
    shard.open_session("a")
    (out,) = shard.forward_batch([("a", torch.zeros(1, 2, shard.config.hidden, dtype=dtype), 0)])
    assert isinstance(out, ValueError) and "float32" in str(out) and str(dtype).split(".")[1] in str(out)
    (wide,) = shard.forward_batch([("a", torch.zeros(1, 2, shard.config.hidden + 1), 0)])
    assert isinstance(wide, ValueError)


def test_one_peer_gets_its_share_of_sessions_and_kv_and_the_rest_stays_for_others():
    from meshd.hop.admission import Capacity

    cap = Capacity(sessions=6, max_sessions=8, promised=600, budget=1000)
    assert cap.peer_refusal(5, 500, 100, share=0.75) is None
    assert "its share" in cap.peer_refusal(6, 500, 100, share=0.75)  # 6 of 8 sessions
    assert "KV budget" in cap.peer_refusal(1, 700, 100, share=0.75)  # 800 of 1000 bytes
    assert cap.peer_refusal(0, 0, 100, share=0.75) is None  # another peer still gets in
    full = Capacity(sessions=8, max_sessions=8, promised=600, budget=1000)
    assert "its limit" in full.peer_refusal(0, 0, 100)  # and the shard's own limits still hold


def test_sessions_held_by_a_peer_are_counted_from_their_home_streams():
    from types import SimpleNamespace

    from meshd.hop.links import Links
    from meshd.hop.sessions import HopSession, SessionTable

    table = SessionTable()
    for i, peer in enumerate(["A", "A", "B"]):
        table[(bytes([i]), 0)] = HopSession((bytes([i]), 0), None, promised=10 * (i + 1),
                                            links=Links(SimpleNamespace(peer=peer)))
    table[(b"x", 0)] = HopSession((b"x", 0), None, promised=99)  # the entry's own: no home stream
    assert table.held_by("A") == (2, 30) and table.held_by("B") == (1, 30) and table.held_by("C") == (0, 0)


def test_a_mesh_full_of_live_daemons_is_reported_full_not_gone():
    from meshd.entry.errors import GenerationError, HopFailed
    from meshd.entry.policy import Retries

    r = Retries(deadline=30.0, busy_wait_s=30.0)
    r.after_failure(HopFailed("A", "full", busy_s=0.5))
    with pytest.raises(GenerationError) as busy:
        r.after_refusal(GenerationError(w.ErrorCode.NO_ROUTE, "no route: layers [(10, 20)] are served by no live"
                                                              " peer"), now=31.0)
    assert busy.value.code == w.ErrorCode.BUSY and "alive and full" in str(busy.value)
    assert "no live peer" not in str(busy.value)


async def test_large_frames_are_decoded_off_the_event_loop_and_small_ones_on_it(monkeypatch):
    import threading

    threads = []
    real = w.Decoder.decode

    def decode(self, frame):
        threads.append(threading.current_thread())
        return real(self, frame)

    monkeypatch.setattr(w.Decoder, "decode", decode)
    sender, receiver = _pair(ByteBudget(total=64 << 20, per_peer=32 << 20))
    await sender.send_bytes(zeros_frame(SID, 8 << 20, 576))
    await sender.send(w.Heartbeat(seq=1))
    big, small = await receiver.receive(10), await receiver.receive(10)
    assert big.tensors[0].nbytes > 4 << 20 and small == w.Heartbeat(seq=1)
    assert threads[0] is not threading.current_thread() and threads[1] is threading.current_thread()


def test_one_peer_s_waiting_frames_get_their_share_of_the_queue():
    from types import SimpleNamespace

    from meshd.hop.scheduler import Scheduler
    from meshd.hop.intake import Intake

    intake, service = Intake(peer_share=0.75), SimpleNamespace(scheduler=Scheduler(max_queued=8))
    assert all(intake.enqueue(service, "A") is None for _ in range(6))
    refusal = intake.enqueue(service, "A")
    assert refusal.code == w.ErrorCode.BUSY and "its share of 8" in refusal.message and refusal.retriable
    assert intake.enqueue(service, "B") is None  # others still get in
    intake.dequeue("A")
    assert intake.enqueue(service, "A") is None and intake.queued == {"A": 6, "B": 1}


def test_sessions_admitted_but_not_yet_open_count_against_their_peer():
    from types import SimpleNamespace

    from meshd.hop.admission import Capacity
    from meshd.hop.intake import Intake
    from meshd.hop.sessions import SessionTable

    endpoint = SimpleNamespace(model_fp="m", recipe_fp="r", sessions=SessionTable(), refused=0,
                               kv_need=lambda msg: 10, capacity=lambda reclaiming: Capacity(0, 8, 0, 1000))
    service, intake = SimpleNamespace(endpoint=endpoint), Intake(peer_share=0.5)

    def open_msg(i, fp="m"):
        return w.OpenSession(request_id=i, session_id=bytes([i]) * 16, epoch=0, start=0, end=1,
                             model_fingerprint=fp, recipe_fingerprint="r")

    assert [intake.admission(service, "A", open_msg(i)) for i in range(4)] == [None] * 4
    busy = intake.admission(service, "A", open_msg(4))  # 4 of 8 pending: A's share, though none is open yet
    assert busy.code == w.ErrorCode.BUSY and "daemon is full" in busy.message and endpoint.refused == 1
    assert intake.admission(service, "B", open_msg(5)) is None  # the floor for others
    assert intake.admission(service, "A", open_msg(6, fp="x")) is None  # the endpoint will say what is wrong
    intake.opened(service, "A", open_msg(6, fp="x"))  # never counted: takes nothing back
    intake.opened(service, "A", open_msg(0))
    # what is pending is reserved in the session table, the one owner of a hop's sessions (meshd/hop/sessions.py)
    assert endpoint.sessions.pending("A") == (3, 30) and endpoint.sessions.pending("B") == (1, 10)


async def test_the_heap_is_trimmed_after_a_burst_and_again_while_buffers_are_freed(monkeypatch):
    from meshd.hop import intake as intake_module

    trims = []
    monkeypatch.setattr(intake_module, "trim_heap", lambda: trims.append(1))
    intake = intake_module.Intake(ByteBudget(64 << 20, 32 << 20))
    held = Held(intake.budget, "A")
    await held.grow(20 << 20)
    await intake.release(held)  # the burst is over: one trim now, more on the loop's ticks
    assert len(trims) == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(intake.trim_loop, 0.001)
        with trio.fail_after(60):
            while intake.trims_due:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert len(trims) == 1 + intake_module.TRIMS_AFTER_BURST and intake.trims_due == 0


ARENA_BURST = """
import sys, threading
from meshd.shard.footprint import pin_heap_thresholds, trim_heap
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
if sys.argv[1] == "pinned":
    assert pin_heap_thresholds()
def burst():  # as a decode worker or the event loop's thread meets a burst of large frames
    big = bytearray(16 << 20)  # one large block freed: glibc's default raises its thresholds
    del big
    pieces = [bytearray(200 << 10) for _ in range(120)]  # 24 MB of frame-sized buffers, then freed
    del pieces
before = rss()
thread = threading.Thread(target=burst)
thread.start()
thread.join()
trim_heap()
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists() or not glibc(), reason="glibc on Linux only")
def test_a_burst_freed_in_another_thread_s_arena_goes_back_to_the_system():
    """What a thread other than the main one frees after a burst is handed back: with glibc's
    default thresholds the 24 MB stayed at the top of that thread's arena, which `malloc_trim`
    does not trim (measured here: +23 MB kept without `pin_heap_thresholds`)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ARENA_BURST, "pinned"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 4 << 20, f"{int(out.stdout) >> 20} MB kept"


async def test_a_stream_cut_in_the_middle_of_a_frame_is_reset_and_its_unread_bytes_go_at_once():
    """py-libp2p (0.8.1) keeps a closed stream's unread bytes for 60-90 s: a channel closed in the
    middle of a frame resets its stream and drops them, and the peer still reads what was sent before
    (two real hosts on loopback)."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol

    from meshd.p2p.host import connect, open_host

    proto, seen, done = TProtocol("/meshd/test-cut/1"), {}, trio.Event()
    budget = ByteBudget(total=8 << 20, per_peer=8 << 20)
    budget.take_nowait("another peer", 8 << 20)  # no room: the frame's body is left unread (flow control)

    async def handler(stream):
        channel = Channel.over_libp2p(stream, "test")
        channel.peer, channel.budget, channel.frame_timeout = "cutter", budget, 1.0
        try:
            with pytest.raises(FrameStalled):
                await channel.receive(30)
            buffers, sid = stream.muxed_stream.conn.stream_buffers, stream.muxed_stream.stream_id
            seen["unread"] = len(buffers.get(sid, b""))
            await channel.send(w.Error(code=w.ErrorCode.TIMEOUT, message="cut"))
            await channel.aclose()
            seen["left"] = len(buffers.get(sid, b""))
        finally:
            done.set()

    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(create_new_key_pair(), []) as client:
        server.set_stream_handler(proto, handler)
        addr = f"{server.get_addrs()[0]}"
        pid = await connect(client, addr if "/p2p/" in addr else f"{addr}/p2p/{server.get_id()}")
        stream = await client.new_stream(pid, [proto])
        async with trio.open_nursery() as nursery:
            async def cut():  # 1 MiB of a 4 MiB frame; the write stalls on the window and fails on the reset
                with trio.move_on_after(20):
                    try:
                        await stream.write(half_frame(4 << 20, 1 << 20))
                    except Exception:
                        pass

            nursery.start_soon(cut)
            with trio.fail_after(20):
                reply = await Channel.over_libp2p(stream).receive(20)
                await done.wait()
            nursery.cancel_scope.cancel()
    assert seen["unread"] > 0 and seen["left"] == 0, seen
    assert reply.message == "cut"
