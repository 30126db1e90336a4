"""The wire codec: round-trips, byte-split invariance, bounds, and clean errors on bad input."""

import math
import random
import struct
import subprocess
import sys
import zlib

from dataclasses import replace

import msgpack
import numpy as np
import trio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshd.wire as w
from meshd.wire.codec import PREAMBLE

SID = bytes(range(16))


def forward(*tensors, **kw):
    args = dict(session_id=SID, epoch=3, step=7, phase=w.Phase.PREFILL, position=128, chunk_index=1,
                chunk_total=4)
    args.update(kw)
    return w.Forward(tensors=tuple(tensors), **args)


def all_messages():
    t = w.Tensor.from_numpy("hidden", np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    return [
        w.Hello(agent="meshd/0.1", peer_id="12D3Koo", model_fingerprint="m" * 64, recipe_fingerprint="r" * 64),
        w.OpenSession(request_id=1, session_id=SID, epoch=0, start=10, end=20, model_fingerprint="m",
                      recipe_fingerprint="r", max_length=512, temperature=0.7, top_k=40, top_p=0.9, seed=5,
                      next_peer="12D3KooNext", next_addrs="/ip4/127.0.0.1/tcp/1 /ip4/10.0.0.1/tcp/2"),
        w.OpenSession(request_id=2, session_id=SID, epoch=1, start=0, end=6, model_fingerprint="m",
                      recipe_fingerprint="r", rope_table=1),
        w.Opened(request_id=1, session_id=SID, epoch=0, forwarding=True),
        forward(t),
        w.ForwardBatch.of([forward(t), forward(t, session_id=bytes(16), step=8, phase=w.Phase.DECODE)]),
        w.Token(session_id=SID, epoch=0, step=2, token_id=42, logprob=-0.5),
        w.Token(session_id=SID, epoch=0, step=2, token_id=42),
        w.Token(session_id=SID, epoch=0, step=2, token_id=42,
                tensors=(w.Tensor.from_torch("sketch:10:20", torch.arange(8, dtype=torch.float32)),)),
        w.Close(session_id=SID, epoch=0),
        w.Cancel(session_id=SID, epoch=0, reason="client went away"),
        w.Heartbeat(seq=9, sent_at=1.5),
        w.Error(code=w.ErrorCode.BUSY, message="full", retriable=True, request_id=4, session_id=SID, retry_after_s=0.5),
        w.GenerateRequest(request_id=4, prompt="héllo", max_tokens=8, temperature=0.0, chat=True),
        w.GenerateRequest(request_id=4, prompt="x", verify=True, speculate=False),
        w.StreamEvent(request_id=4, kind="done", stats={"tokens": 8, "route": [["a", 0, 30]]}),
        w.StatusRequest(request_id=5),
        w.DrainRequest(request_id=6, exit=True),
        w.LedgerRequest(request_id=7, since=1.8e9, peer="12D3KooPeer"),
        w.Leaving(session_id=SID, epoch=2),
        w.HandOver(session_id=SID, epoch=2, peer="12D3KooR", addrs="/ip4/127.0.0.1/tcp/1", ticket=bytes(16),
                   positions=64),
        w.AcceptKV(ticket=bytes(16), sender="12D3KooD", start=10, end=20, rope_table=0, positions=32,
                   chain=bytes(32), model_fingerprint="m", recipe_fingerprint="r"),
        w.KVChunk(ticket=bytes(16), position=16, tensors=(
            w.Tensor.from_torch("k", torch.zeros(2, 1, 3, 16, 8, dtype=torch.bfloat16)),
            w.Tensor.from_torch("v", torch.ones(2, 1, 3, 16, 8, dtype=torch.bfloat16)))),
        w.HandedOver(session_id=SID, epoch=2, ticket=bytes(16), positions=0, reason="receiver died"),
    ]


def decode_all(data: bytes, splits=None):
    d = w.Decoder()
    out = []
    if splits is None:
        out += d.feed(data)
    else:
        prev = 0
        for cut in sorted(splits) + [len(data)]:
            out += d.feed(data[prev:cut])
            prev = cut
    d.close()
    return out


@pytest.mark.parametrize("msg", all_messages(), ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("encoding", ["raw", "zstd", "auto"])
def test_every_message_round_trips(msg, encoding):
    assert decode_all(w.encode(msg, encoding)) == [msg]


def test_every_type_is_covered():
    assert {type(m) for m in all_messages()} == set(w.MESSAGE_TYPES.values())


def test_forward_batch_gives_back_its_frames():
    t = w.Tensor.from_numpy("hidden", np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    frames = [forward(t), forward(session_id=bytes(16)), forward(t, t, step=9, phase=w.Phase.DECODE)]
    batch = decode_all(w.encode(w.ForwardBatch.of(frames)))[0]
    assert batch.frames() == frames


@pytest.mark.parametrize("items, tensors, match", [
    ([], 0, "ForwardBatch of 0"),
    ([[SID, 0, 0, 1, 0, 0, 1, 0]] * (w.MAX_BATCH_FRAMES + 1), 0, "ForwardBatch of 65"),
    ([[SID, 0, 0, 1, 0, 0, 1]], 0, "list of 8"),
    ([[SID, "0", 0, 1, 0, 0, 1, 0]], 0, "epoch"),
    ([[SID, 0, 0, 99, 0, 0, 1, 0]], 0, "Phase"),
    ([[SID, 0, 0, 1, 0, 0, 1, -1]], 0, "tensor count"),
    ([[SID, 0, 0, 1, 0, 0, 1, 2]], 1, "claim 2 tensors"),
    (["item"], 0, "list of 8"),
])
def test_bad_forward_batches_are_malformed(items, tensors, match):
    t = w.Tensor.from_numpy("hidden", np.zeros((1, 1, 4), dtype=np.float32))
    descs = [[t.name, list(t.shape), t.dtype, "<", "raw", t.nbytes, t.nbytes]] * tensors
    header = {"v": w.PROTOCOL_VERSION, "t": int(w.MsgType.FORWARD_BATCH), "f": [items], "x": descs}
    with pytest.raises(w.MalformedFrame, match=match):
        decode_all(raw_frame(header, t.data * tensors))


def test_one_byte_at_a_time_gives_the_same_frames():
    msgs = all_messages()
    stream = b"".join(w.encode(m) for m in msgs)
    assert decode_all(stream, splits=list(range(1, len(stream)))) == msgs


dtypes = st.sampled_from(sorted(w.DTYPES))
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw):
    dtype = draw(dtypes)
    shape = draw(shapes)
    n = math.prod(shape) * w.DTYPES[dtype][0]
    mode = draw(st.sampled_from(["random", "zeros"]))
    data = draw(st.binary(min_size=n, max_size=n)) if mode == "random" else bytes(n)
    return w.Tensor(draw(st.text(max_size=8)), shape, dtype, data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tensors(), max_size=4), st.sampled_from(["raw", "zstd", "auto"]), st.data())
def test_hypothesis_round_trip_any_split(ts, encoding, data):
    msgs = [forward(*ts), w.Heartbeat(seq=1), forward(*ts[:1], phase=w.Phase.DECODE)]
    stream = b"".join(w.encode(m, encoding) for m in msgs)
    splits = data.draw(st.lists(st.integers(0, len(stream)), max_size=8, unique=True))
    assert decode_all(stream, splits) == msgs


def test_bfloat16_round_trips_through_torch_bit_exact():
    x = torch.randn(2, 5, 7).to(torch.bfloat16)
    t = w.Tensor.from_torch("h", x)
    assert t.dtype == "bfloat16" and t.nbytes == x.numel() * 2
    y = decode_all(w.encode(forward(t)))[0].tensors[0].to_torch()
    assert y.dtype == torch.bfloat16 and torch.equal(x, y)
    # numpy widens bfloat16 exactly
    assert np.array_equal(t.to_numpy(), x.float().numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int64])
def test_torch_dtypes_round_trip(dtype):
    x = (torch.randn(3, 4) * 100).to(dtype)
    assert torch.equal(w.Tensor.from_torch("x", x).to_torch(), x)


def test_tensor_rejects_inconsistent_data():
    with pytest.raises(ValueError, match="expected 8"):
        w.Tensor("x", (2,), "float32", b"\0" * 7)
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        w.Tensor("x", (1,), "float64", b"\0" * 8)


def raw_frame(header: dict, payload: bytes = b"", crc=None) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    body = h + payload
    return PREAMBLE.pack(len(body), len(h), zlib.crc32(body) if crc is None else crc) + body


GOOD_HB = {"v": w.PROTOCOL_VERSION, "t": int(w.MsgType.HEARTBEAT), "f": [1, 0.0], "x": []}


def test_raw_frame_helper_matches_encoder():
    assert decode_all(raw_frame(GOOD_HB)) == [w.Heartbeat(seq=1, sent_at=0.0)]


def test_a_late_field_may_be_left_off_and_is_at_its_default():
    """OpenSession's late fields (rope_table, prefix) may be left off a frame, which then opens a short
    session asking for no prefix; such a session's frame leaves them off, and a long one carries what it sets."""
    short = w.OpenSession(request_id=1, session_id=SID, epoch=0, start=0, end=6, model_fingerprint="m",
                          recipe_fingerprint="r")
    fields = msgpack.unpackb(w.encode(short)[PREAMBLE.size:], raw=False)["f"]
    assert len(fields) == len(w.OpenSession.FIELD_CHECKS) - 4
    assert decode_all(raw_frame({"v": w.PROTOCOL_VERSION, "t": int(w.MsgType.OPEN), "f": fields, "x": []})) == [short]
    long = w.OpenSession(**{**{n: getattr(short, n) for n, _ in short.FIELD_CHECKS}, "rope_table": 1})
    assert msgpack.unpackb(w.encode(long)[PREAMBLE.size:], raw=False)["f"] == [*fields, 1]
    asking = replace(short, prefix=b"\x01" * 16)
    assert msgpack.unpackb(w.encode(asking)[PREAMBLE.size:], raw=False)["f"] == [*fields, 0, b"\x01" * 16]
    assert decode_all(w.encode(asking)) == [asking]
    with pytest.raises(w.MalformedFrame, match="expected 19 fields \\(or 15"):
        decode_all(raw_frame({"v": w.PROTOCOL_VERSION, "t": int(w.MsgType.OPEN), "f": fields[:-1], "x": []}))
    with pytest.raises(w.MalformedFrame, match="'rope_table'"):
        decode_all(raw_frame({"v": w.PROTOCOL_VERSION, "t": int(w.MsgType.OPEN), "f": [*fields, "long"], "x": []}))


@pytest.mark.parametrize("header,payload,error,match", [
    ({**GOOD_HB, "v": 99}, b"", w.UnsupportedVersion, "version 99"),
    ({**GOOD_HB, "t": 250}, b"", w.MalformedFrame, "unknown message type"),
    ({**GOOD_HB, "f": [1]}, b"", w.MalformedFrame, "expected 2 fields"),
    ({**GOOD_HB, "f": ["one", 0.0]}, b"", w.MalformedFrame, "'seq'"),
    ({**GOOD_HB, "x": [["a", [2], "float32", "<", "raw", 8, 8]]}, b"\0" * 8, w.MalformedFrame, "carries no tensors"),
    ({**GOOD_HB, "x": [["a", [2], "float64", "<", "raw", 16, 16]]}, b"\0" * 16, w.MalformedFrame, "unknown dtype"),
    ({**GOOD_HB, "x": [["a", [2], "float32", ">", "raw", 8, 8]]}, b"\0" * 8, w.MalformedFrame, "byte order"),
    ({**GOOD_HB, "x": [["a", [2], "float32", "<", "lz4", 8, 8]]}, b"\0" * 8, w.MalformedFrame, "encoding"),
    ({**GOOD_HB, "x": [["a", [2], "float32", "<", "auto", 8, 8]]}, b"\0" * 8, w.MalformedFrame, "encoding 'auto'"),
    ({**GOOD_HB, "x": [["a", [3], "float32", "<", "raw", 8, 8]]}, b"\0" * 8, w.MalformedFrame, "raw length"),
    ({**GOOD_HB, "x": [["a", [2], "float32", "<", "raw", 8, 8]]}, b"\0" * 4, w.MalformedFrame, "payload bytes"),
    ({**GOOD_HB, "x": [["a", [1 << 20, 1 << 20], "float32", "<", "raw", 1 << 42, 0]]}, b"", w.FrameTooLarge, "elements"),
    ({**GOOD_HB, "x": [["a", [1] * 9, "float32", "<", "raw", 4, 4]]}, b"\0" * 4, w.FrameTooLarge, "dims"),
    ({**GOOD_HB, "x": [["a", [4], "float32", "<", "zstd", 16, 5]]}, b"\x28\xb5\x2f\xfd\x00", w.MalformedFrame, "zstd"),
])
def test_bad_frames_raise_their_own_error(header, payload, error, match):
    with pytest.raises(error, match=match):
        decode_all(raw_frame(header, payload))


def test_zstd_bomb_is_refused_before_decompressing():
    big = bytes(1 << 20)
    import zstandard
    packed = zstandard.ZstdCompressor().compress(big)
    lie = {**GOOD_HB, "t": int(w.MsgType.FORWARD), "f": [SID, 0, 0, 1, 0, 0, 1],
           "x": [["a", [16], "float32", "<", "zstd", 64, len(packed)]]}
    with pytest.raises(w.MalformedFrame, match="content size"):
        decode_all(raw_frame(lie, packed))


def test_checksum_mismatch():
    data = bytearray(w.encode(forward(w.Tensor.from_numpy("h", np.ones(8, np.float32))), "raw"))
    data[-1] ^= 1
    with pytest.raises(w.ChecksumMismatch):
        decode_all(bytes(data))


def test_oversized_frame_refused_from_its_prefix_alone():
    d = w.Decoder(w.Limits(max_payload=1024))
    with pytest.raises(w.FrameTooLarge, match="exceeds the limit"):
        d.feed(PREAMBLE.pack(10 * 1024 * 1024, 10, 0))
    # the decoder stays failed: the stream can no longer be trusted
    with pytest.raises(w.FrameTooLarge, match="already failed"):
        d.feed(b"")


def test_payload_limit_counts_decompressed_bytes():
    t = w.Tensor.from_numpy("z", np.zeros(4096, np.float32))
    data = w.encode(forward(t), "zstd")
    assert len(data) < 1024
    with pytest.raises(w.FrameTooLarge, match="tensors of 16384 bytes"):
        w.Decoder(w.Limits(max_payload=8192)).feed(data)


def test_truncated_stream_reported_on_close():
    data = w.encode(w.Heartbeat(seq=1))
    d = w.Decoder()
    assert d.feed(data[:-3]) == []
    with pytest.raises(w.TruncatedFrame, match="unfinished frame"):
        d.close()


def test_fuzz_random_and_mutated_frames_only_raise_wire_errors():
    rng = random.Random(1234)
    seeds = [w.encode(m, enc) for m in all_messages() for enc in ("raw", "zstd")]
    limits = w.Limits(max_payload=1 << 20, max_elements=1 << 18)
    outcomes = {"ok": 0, "wire": 0, "more": 0}
    for i in range(12000):
        base = bytearray(rng.choice(seeds))
        kind = i % 4
        if kind == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        else:
            for _ in range(rng.randint(1, 6)):
                pos = rng.randrange(len(base))
                base[pos] = rng.getrandbits(8)
            if kind == 2:  # fix the checksum so the mutation reaches the parser
                body = bytes(base[PREAMBLE.size:])
                struct.pack_into("<I", base, 8, zlib.crc32(body))
            if kind == 3:
                del base[rng.randrange(len(base)):]
            data = bytes(base)
        d = w.Decoder(limits)
        try:
            for m in d.feed(data):
                for t in m.tensors:
                    assert t.nbytes <= limits.max_payload
            d.close()
            outcomes["ok"] += 1
        except w.WireError:
            outcomes["wire"] += 1
        if d.buffered:
            outcomes["more"] += 1
    assert outcomes["wire"] > 5000, outcomes


def test_chunk_spans_cover_prompt():
    assert w.chunk_spans(300, 128) == [(0, 128), (128, 256), (256, 300)]
    assert w.chunk_spans(0, 128) == []


def test_chunk_size_and_encoding_come_from_the_daemon_s_settings(monkeypatch):
    """MESHD_CHUNK_TOKENS and MESHD_WIRE_ENCODING are read by the settings, once, and travel as values: the
    wire keeps no process-wide size or encoding, a channel packs as it was built to, a chunk is as long as
    its caller says."""
    from meshd.core.settings import load_settings
    from meshd.node.wiring import chunk_size, intake, wire_encoding
    from meshd.p2p.channel import Channel

    monkeypatch.setenv("MESHD_CHUNK_TOKENS", "16")
    monkeypatch.setenv("MESHD_WIRE_ENCODING", "zstd")
    s = load_settings({}, config_file="/dev/null")
    assert (chunk_size(s), wire_encoding(s)) == (16, "zstd")
    assert len(w.chunk_spans(40, chunk_size(s))) == 3 and (intake(s).chunk_tokens, intake(s).encoding) == (16, "zstd")
    assert not hasattr(w, "set_chunk_tokens") and not hasattr(w, "set_default_encoding")
    t = w.Tensor.from_numpy("hidden", np.zeros((1, 64), dtype=np.float32))
    frame = w.Forward(session_id=b"s" * 16, epoch=0, step=0, phase=w.Phase.DECODE, position=0, tensors=(t,))
    sent = []

    async def write(data):
        sent.append(data)

    zstd = Channel(None, write, None, encoding=wire_encoding(s))
    trio.run(zstd.send, frame)
    assert len(sent[0]) < len(w.encode(frame, "raw")) - 128 == len(w.encode(frame)) - 128  # zeros compress
    with pytest.raises(ValueError):
        w.encode(frame, "gzip")
    with pytest.raises(ValueError):
        w.chunk_spans(40, 0)
    monkeypatch.setenv("MESHD_CHUNK_TOKENS", "0")
    with pytest.raises(ValueError, match="--chunk-tokens"):
        chunk_size(load_settings({}, config_file="/dev/null"))


def test_prefill_assembler_checks_order_and_total():
    a = w.PrefillAssembler()
    a.add(forward(chunk_index=0, chunk_total=3, position=0), 128)
    a.add(forward(chunk_index=1, chunk_total=3, position=128), 128)
    with pytest.raises(w.ChunkOrderError, match="total changed"):
        a.add(forward(chunk_index=2, chunk_total=4, position=256), 10)
    with pytest.raises(w.ChunkOrderError, match="expected chunk 2"):
        a.add(forward(chunk_index=1, chunk_total=3, position=256), 10)
    with pytest.raises(w.ChunkOrderError, match="position"):
        a.add(forward(chunk_index=2, chunk_total=3, position=200), 10)
    a.add(forward(chunk_index=2, chunk_total=3, position=256), 10)
    assert a.done
    with pytest.raises(w.ChunkOrderError, match="after all 3"):
        a.add(forward(chunk_index=3, chunk_total=3, position=266), 1)


def test_import_wire_pulls_in_no_io_stack():
    code = "import sys, meshd.wire; bad = {'trio', 'libp2p', 'torch'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
