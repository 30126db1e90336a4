"""Frames as bytes, without I/O: `encode(message)` and `Decoder.feed(data)`.

A frame is:

    u32 LE  body length (header + payload)
    u32 LE  header length
    u32 LE  CRC-32 of header + payload
    header  msgpack map {"v": version, "t": type, "f": [fields...], "x": [tensor descriptors...]}
    payload the tensors' wire bytes, in descriptor order

A tensor descriptor is [name, shape, dtype, byte order, encoding, raw length, wire length].

Rules: every length, count and size is checked against `Limits` before anything is allocated for
it; a decoder that raised once is poisoned (the stream is no longer trustworthy); any split of a
byte stream into `feed` calls yields the same frames.
"""

from __future__ import annotations

import math
import struct
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import msgpack
import zstandard

from meshd.core import settings
from meshd.core.settings import default
from meshd.wire.errors import (ChecksumMismatch, FrameTooLarge, MalformedFrame, TruncatedFrame,
                               UnsupportedVersion, WireError)
from meshd.wire.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message
from meshd.wire.tensors import BYTE_ORDER, DTYPES, Tensor

PREAMBLE = struct.Struct("<III")
Encoding = Literal["raw", "zstd", "auto"]
ENCODINGS = tuple(settings.ENCODINGS)  # how `encode` may pack a frame's tensors (auto: zstd where it pays)
TENSOR_ENCODINGS = ("raw", "zstd")  # what a tensor descriptor may say it is in
DEFAULT_ENCODING: Encoding = default("wire_encoding")
# zstd must save at least this fraction of the bytes to be used in "auto" mode
AUTO_MIN_SAVING = 0.05
ZSTD_LEVEL = 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a decoder enforces before allocating anything."""

    max_header: int = 64 * 1024
    max_tensors: int = 64
    max_dims: int = 8
    max_elements: int = 1 << 28
    max_payload: int = 64 * 1024 * 1024  # total raw (decompressed) tensor bytes per frame

    @property
    def max_body(self) -> int:
        return self.max_header + self.max_payload


_compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)


def _wire_bytes(tensor: Tensor, encoding: Encoding) -> tuple[str, bytes]:
    if encoding == "raw" or not tensor.data:
        return "raw", tensor.data
    packed = _compressor.compress(tensor.data)
    if encoding == "zstd" or len(packed) <= len(tensor.data) * (1 - AUTO_MIN_SAVING):
        return "zstd", packed
    return "raw", tensor.data


def encode(msg: Message, encoding: Encoding = DEFAULT_ENCODING) -> bytes:
    """The bytes of one frame carrying `msg`; tensors go raw, zstd, or zstd only where it pays (`encoding`:
    the sender's --wire-encoding, which its channel carries)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"the wire encoding must be raw, zstd or auto, not {encoding!r}")
    values = _header_values(msg)
    descriptors, chunks = [], []
    for tensor in msg.tensors:
        enc, data = _wire_bytes(tensor, encoding)
        descriptors.append([tensor.name, list(tensor.shape), tensor.dtype, BYTE_ORDER, enc,
                            len(tensor.data), len(data)])
        chunks.append(data)
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": int(msg.TYPE), "f": values, "x": descriptors},
                           use_bin_type=True)
    crc = zlib.crc32(header)
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    body_len = len(header) + sum(len(c) for c in chunks)
    return b"".join([PREAMBLE.pack(body_len, len(header), crc), header, *chunks])


@dataclass(frozen=True, slots=True)
class FrameHead:
    """The frame being received, as far as its prefix tells: `body_len` from the checked preamble,
    `raw_len` (the tensors' declared raw bytes) once the header is in, None before (or when the
    header will not parse: then the frame fails at `decode` without inflating anything)."""

    body_len: int
    raw_len: int | None = None

    @property
    def cost(self) -> int:
        """The most bytes the frame occupies while it is decoded: its body and its raw tensors."""
        return self.body_len + (self.raw_len or 0)


@dataclass(frozen=True, slots=True)
class RawFrame:
    """A complete frame's bytes, not yet checked or decoded (`Decoder.decode` does both)."""

    body: memoryview
    header_len: int
    crc: int
    head: FrameHead


class Decoder:
    """Turns a byte stream into messages: `feed(bytes)` returns the messages completed so far.

    The same work in steps, for a caller that must admit a frame's memory before it is read and
    decode it elsewhere (a thread): `push(bytes)`, `head()` (what the frame in progress will
    cost), `take()` (a complete frame's bytes) and `decode(frame)` (checksum, header, tensors)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._buffer = bytearray()
        self._failed: WireError | None = None
        self._head: FrameHead | None = None
        self._dctx: zstandard.ZstdDecompressor | None = None  # made on first zstd tensor

    def feed(self, data: bytes) -> list[Message]:
        self.push(data)
        out: list[Message] = []
        while (frame := self.take()) is not None:
            out.append(self.decode(frame))
        return out

    def push(self, data: bytes) -> None:
        """Buffer stream bytes (checking nothing yet)."""
        self._check_not_failed()
        self._buffer += data

    def head(self) -> FrameHead | None:
        """The frame in progress (its preamble checked against `Limits`), or None before one began."""
        self._check_not_failed()
        if self._head is None or self._head.raw_len is None:
            with self._poisoning():
                self._head = self._read_head()
        return self._head

    def take(self) -> RawFrame | None:
        """A complete frame's bytes, removed from the buffer, or None while it is incomplete."""
        head = self.head()
        if head is None or len(self._buffer) < PREAMBLE.size + head.body_len:
            return None
        buf, end = self._buffer, PREAMBLE.size + head.body_len
        _, header_len, crc = PREAMBLE.unpack_from(buf)
        if len(buf) == end:  # the common case: take the buffer over instead of copying it
            frame, self._buffer = buf, bytearray()
        else:
            frame = bytes(buf[:end])
            del buf[:end]
        self._head = None
        return RawFrame(memoryview(frame)[PREAMBLE.size:end], header_len, crc, head)

    def decode(self, frame: RawFrame) -> Message:
        """The message a complete frame carries; zstd output never exceeds the declared raw size.
        Touches no buffer of the decoder's, so it may run on another thread while bytes arrive
        (one `decode` at a time per decoder)."""
        self._check_not_failed()
        with self._poisoning():
            if zlib.crc32(frame.body) != frame.crc:
                raise ChecksumMismatch(f"frame checksum mismatch ({len(frame.body)} byte body)")
            return decode_body(frame.body, frame.header_len, self.limits, self._decompressor)

    def close(self) -> None:
        """Declare end of stream; raises `TruncatedFrame` if a partial frame is buffered."""
        if self._buffer:
            raise TruncatedFrame(f"stream ended with {len(self._buffer)} bytes of an unfinished frame")

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _check_not_failed(self) -> None:
        if self._failed is not None:
            raise type(self._failed)(f"decoder already failed: {self._failed}")

    @contextmanager
    def _poisoning(self):
        try:
            yield
        except WireError as exc:
            self._failed = exc
            self._buffer.clear()
            raise

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        if self._dctx is None:
            self._dctx = zstandard.ZstdDecompressor()
        return self._dctx

    def _read_head(self) -> FrameHead | None:
        buf = self._buffer
        if len(buf) < PREAMBLE.size:
            return None
        body_len, header_len, _ = PREAMBLE.unpack_from(buf)
        if body_len > self.limits.max_body:
            raise FrameTooLarge(f"frame body of {body_len} bytes exceeds the limit of {self.limits.max_body}")
        if header_len > self.limits.max_header:
            raise FrameTooLarge(f"header of {header_len} bytes exceeds the limit of {self.limits.max_header}")
        if header_len > body_len:
            raise MalformedFrame(f"header length {header_len} exceeds body length {body_len}")
        if len(buf) < PREAMBLE.size + header_len:
            return FrameHead(body_len)
        header = memoryview(buf)[PREAMBLE.size:PREAMBLE.size + header_len]
        try:
            return FrameHead(body_len, declared_raw(header, self.limits))
        finally:
            header.release()


def declared_raw(header: memoryview, limits: Limits) -> int:
    """The raw bytes a frame's tensors declare, from its header alone (before its checksum is
    checked: a header that does not parse gives 0, and the frame fails when it is decoded)."""
    try:
        descs = _unpack_header(header).get("x")
        if not isinstance(descs, list) or len(descs) > limits.max_tensors:
            return 0
        return sum(_check_descriptor(d, limits)[5] for d in descs)
    except WireError:
        return 0


def decode_frame(data: bytes, limits: Limits | None = None) -> Message:
    """Decode exactly one complete frame."""
    decoder = Decoder(limits)
    msgs = decoder.feed(data)
    decoder.close()
    if len(msgs) != 1:
        raise MalformedFrame(f"expected one frame, got {len(msgs)}")
    return msgs[0]


def _header_values(msg: Message) -> list:
    """The fields' values in wire order, without the late fields at their defaults (see messages.py)."""
    values = [getattr(msg, name) for name, _ in msg.FIELD_CHECKS]
    defaults = msg.__dataclass_fields__
    for name, _ in msg.FIELD_CHECKS[len(values) - msg.LATE_FIELDS:][::-1]:
        if values[-1] != defaults[name].default:
            break
        values.pop()
    return values


def decode_body(body: memoryview, header_len: int, limits: Limits, dctx) -> Message:
    """Decode a checksummed frame body; `dctx()` returns a zstd decompressor when one is needed."""
    header = _unpack_header(body[:header_len])
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version!r} is not supported (this build speaks {PROTOCOL_VERSION})")
    kind = header.get("t")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is int else None
    if cls is None:
        raise MalformedFrame(f"unknown message type {header.get('t')!r}")
    values, most = header.get("f"), len(cls.FIELD_CHECKS)
    if not isinstance(values, list) or not most - cls.LATE_FIELDS <= len(values) <= most:
        raise MalformedFrame(f"{cls.__name__}: expected {most} fields"
                             + (f" (or {most - cls.LATE_FIELDS} without the late ones)" if cls.LATE_FIELDS else ""))
    try:
        kwargs = {name: check(v) for (name, check), v in zip(cls.FIELD_CHECKS, values)}
    except TypeError as exc:
        raise MalformedFrame(f"{cls.__name__}: {exc}") from None
    tensors = _decode_tensors(header.get("x"), body[header_len:], limits, dctx)
    if tensors:
        if "tensors" not in cls.__dataclass_fields__:
            raise MalformedFrame(f"{cls.__name__} carries no tensors")
        kwargs["tensors"] = tensors
    return cls(**kwargs)


def _unpack_header(raw: memoryview) -> dict:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedFrame("header is not a map")
    return header


def _decode_tensors(descs, payload: memoryview, limits: Limits, dctx) -> tuple[Tensor, ...]:
    if not isinstance(descs, list):
        raise MalformedFrame("tensor descriptor list missing")
    if len(descs) > limits.max_tensors:
        raise FrameTooLarge(f"{len(descs)} tensors exceed the limit of {limits.max_tensors}")
    specs, total_raw, total_wire = [], 0, 0
    for d in descs:
        spec = _check_descriptor(d, limits)
        total_raw += spec[5]
        total_wire += spec[6]
        specs.append(spec)
    if total_raw > limits.max_payload:
        raise FrameTooLarge(f"tensors of {total_raw} bytes exceed the limit of {limits.max_payload}")
    if total_wire != len(payload):
        raise MalformedFrame(f"descriptors claim {total_wire} payload bytes, frame has {len(payload)}")
    out, offset = [], 0
    for name, shape, dtype, _, enc, raw_len, wire_len in specs:
        chunk = payload[offset:offset + wire_len]
        offset += wire_len
        data = bytes(chunk) if enc == "raw" else _unzstd(name, chunk, raw_len, dctx())
        out.append(Tensor(name, shape, dtype, data))
    return tuple(out)


def _check_descriptor(d, limits: Limits) -> tuple:
    if not isinstance(d, list) or len(d) != 7:
        raise MalformedFrame("tensor descriptor must be a 7-item list")
    name, shape, dtype, order, enc, raw_len, wire_len = d
    if not isinstance(name, str):
        raise MalformedFrame("tensor name must be a string")
    if dtype not in DTYPES:
        raise MalformedFrame(f"tensor {name!r}: unknown dtype {dtype!r}")
    if order != BYTE_ORDER:
        raise MalformedFrame(f"tensor {name!r}: byte order {order!r} (only little-endian '<' is spoken)")
    if enc not in TENSOR_ENCODINGS:
        raise MalformedFrame(f"tensor {name!r}: unknown encoding {enc!r}")
    if not isinstance(shape, list) or len(shape) > limits.max_dims:
        raise FrameTooLarge(f"tensor {name!r}: shape must be a list of at most {limits.max_dims} dims")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        raise MalformedFrame(f"tensor {name!r}: dims must be non-negative integers")
    elements = math.prod(shape)
    if elements > limits.max_elements:
        raise FrameTooLarge(f"tensor {name!r}: {elements} elements exceed the limit of {limits.max_elements}")
    for label, value in (("raw", raw_len), ("wire", wire_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MalformedFrame(f"tensor {name!r}: bad {label} length {value!r}")
    if raw_len != elements * DTYPES[dtype][0]:
        raise MalformedFrame(f"tensor {name!r}: raw length {raw_len} does not match shape {shape} {dtype}")
    if enc == "raw" and wire_len != raw_len:
        raise MalformedFrame(f"tensor {name!r}: raw encoding with wire length {wire_len} != {raw_len}")
    return name, tuple(shape), dtype, order, enc, raw_len, wire_len


def _unzstd(name: str, chunk: memoryview, raw_len: int, dctx) -> bytes:
    try:
        declared = zstandard.frame_content_size(chunk)
    except zstandard.ZstdError as exc:
        raise MalformedFrame(f"tensor {name!r}: bad zstd frame: {exc}") from None
    if declared not in (-1, raw_len):
        raise MalformedFrame(f"tensor {name!r}: zstd content size {declared} != declared {raw_len}")
    try:
        data = dctx.decompress(chunk, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise MalformedFrame(f"tensor {name!r}: zstd decompression failed: {exc}") from None
    if len(data) != raw_len:
        raise MalformedFrame(f"tensor {name!r}: zstd gave {len(data)} bytes, expected {raw_len}")
    return data
