"""meshd's wire format: frames of a msgpack header and named raw tensors, as pure code (no I/O).

`encode(message) -> bytes` and `Decoder().feed(bytes) -> [message, ...]` are the whole interface;
a thin adapter elsewhere moves the bytes over a stream.
"""

from meshd.wire.chunks import DEFAULT_CHUNK_TOKENS, PrefillAssembler, chunk_spans
from meshd.wire.codec import DEFAULT_ENCODING, ENCODINGS, Decoder, Limits, decode_frame, encode
from meshd.wire.errors import (ChecksumMismatch, ChunkOrderError, FrameTooLarge, MalformedFrame,
                               TruncatedFrame, UnsupportedVersion, WireError)
from meshd.wire.messages import (MAX_BATCH_FRAMES, MESSAGE_TYPES, PROTOCOL_VERSION, AcceptKV, Cancel, Close,
                                 DrainRequest, Error, ErrorCode, Forward, ForwardBatch, GenerateRequest, HandedOver,
                                 HandOver, Heartbeat, Hello, KVChunk, LedgerRequest, Leaving, Message, MsgType,
                                 OpenSession, Opened, Phase, StatusRequest, StreamEvent, Token)
from meshd.wire.tensors import DTYPES, Tensor

__all__ = [
    "DEFAULT_CHUNK_TOKENS", "DEFAULT_ENCODING", "DTYPES", "ENCODINGS", "MAX_BATCH_FRAMES", "MESSAGE_TYPES",
    "PROTOCOL_VERSION", "AcceptKV", "Cancel", "ChecksumMismatch", "ChunkOrderError", "Close", "Decoder",
    "DrainRequest", "Error", "ErrorCode", "Forward", "ForwardBatch", "FrameTooLarge", "HandOver", "HandedOver",
    "KVChunk", "Leaving", "GenerateRequest", "Heartbeat", "Hello", "LedgerRequest", "Limits", "MalformedFrame",
    "Message", "MsgType", "OpenSession", "Opened", "Phase", "PrefillAssembler", "StatusRequest", "StreamEvent",
    "Tensor", "Token", "TruncatedFrame", "UnsupportedVersion", "WireError", "chunk_spans",
    "decode_frame", "encode",
]
