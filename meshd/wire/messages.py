"""The messages meshd peers exchange, as frozen, typed values.

Rule: a message's fields travel positionally in the frame header, in declaration order; that order
is part of `PROTOCOL_VERSION`. Adding, removing or reordering a field means a new version, but for a
field appended with a default and counted in its class's `LATE_FIELDS`: a frame may end before it (an
earlier build of the same version sent it so, and it takes its default), and the codec leaves it off
at its default, so such a build reads the frame. Every message carries its type code; the codec looks
the class up by code and checks every field's type.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from meshd.wire.errors import MalformedFrame
from meshd.wire.tensors import Tensor

PROTOCOL_VERSION = 8  # 2: Error carries retry_after_s; 3: ForwardBatch, Token.pass_id/pass_size;
# 4: OpenSession.microbatch; 5: Phase.VERIFY, Token.accepted, GenerateRequest.speculate, decode frames of
# several positions; 6: GenerateRequest.verify (check this generation on a second route), Token.tensors
# (the hops' sketches of a step, meshd/hop/sketch.py); 7: prefix reuse (OpenSession.prefix, Opened.reused,
# Close.keep), constrained decoding (GenerateRequest.grammar/tools, OpenSession.grammar/grammar_from): a build
# of 6 would refuse them as bad frames; 8: hand-over (Leaving, HandOver, AcceptKV, KVChunk, HandedOver)


class MsgType(enum.IntEnum):
    HELLO = 1
    OPEN = 2
    FORWARD = 3
    TOKEN = 4
    CLOSE = 5
    CANCEL = 6
    HEARTBEAT = 7
    ERROR = 8
    OPENED = 9
    FORWARD_BATCH = 10
    LEAVING = 11
    HAND_OVER = 12
    ACCEPT_KV = 13
    KV_CHUNK = 14
    HANDED_OVER = 15
    GENERATE = 16
    STREAM_EVENT = 17
    STATUS = 18
    DRAIN = 19
    LEDGER = 20


class Phase(enum.IntEnum):
    """What a Forward frame's positions are. PREFILL: prompt chunks (the tail samples after the last
    chunk). DECODE: tokens already chosen (one a step, or a replay's many), every row computed as a
    one-position step would compute it; the tail samples after the last. VERIFY: the last accepted
    token and k drafts (the `drafts` tensor travels with the hidden states), computed as DECODE; the
    tail scores every row and answers how many drafts it accepts and the token after them."""

    NONE = 0
    PREFILL = 1
    DECODE = 2
    VERIFY = 3


class ErrorCode(enum.StrEnum):
    """Codes of `Error` messages; a peer may send codes this build does not know."""

    BAD_FRAME = "bad_frame"
    VERSION = "version"
    MODEL_MISMATCH = "model_mismatch"
    RECIPE_MISMATCH = "recipe_mismatch"
    BUSY = "busy"
    NO_ROUTE = "no_route"
    UNKNOWN_SESSION = "unknown_session"
    HOP_FAILED = "hop_failed"
    NEXT_HOP_FAILED = "next_hop_failed"  # the hop could not pass its output on to the next hop
    TIMEOUT = "timeout"
    INTERNAL = "internal"


def field_checker(name: str, hint: Any):
    """A function that returns a header value converted to the field's type, or raises TypeError."""

    def fail(value: Any):
        raise TypeError(f"field {name!r}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = field_checker(name, next(a for a in typing.get_args(hint) if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        def check_enum(v):
            try:
                return hint(v)
            except (ValueError, TypeError):
                raise TypeError(f"field {name!r}: {v!r} is not a valid {hint.__name__}") from None
        return check_enum
    if hint is bool:
        return lambda v: v if v is True or v is False else fail(v)
    if hint is int:
        return lambda v: v if type(v) is int else fail(v)
    if hint is float:
        return lambda v: float(v) if type(v) in (int, float) else fail(v)
    if hint is tuple:  # msgpack arrays arrive as lists
        return lambda v: tuple(v) if type(v) in (list, tuple) else fail(v)
    if hint in (str, bytes, dict):
        return lambda v: v if type(v) is hint else fail(v)
    raise TypeError(f"field {name!r}: type {hint!r} cannot travel in a header")


MESSAGE_TYPES: dict[int, type["Message"]] = {}


class Message:
    """Base of every message; subclasses are registered with `@message(MsgType.X)`."""

    TYPE: ClassVar[MsgType]
    # (field name, checker) in wire order; a checker returns the value converted or raises TypeError
    FIELD_CHECKS: ClassVar[tuple[tuple[str, Any], ...]]
    LATE_FIELDS: ClassVar[int] = 0  # the last fields, appended within this version: a frame may leave them off
    tensors: tuple[Tensor, ...] = ()


def message(code: MsgType):
    """Class decorator: make a frozen slotted dataclass and register it under `code`."""

    def wrap(cls):
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.TYPE = code
        hints = typing.get_type_hints(cls)
        cls.FIELD_CHECKS = tuple((f.name, field_checker(f.name, hints[f.name]))
                                 for f in fields(cls) if f.name != "tensors")
        if code in MESSAGE_TYPES:
            raise TypeError(f"message type {code!r} registered twice")
        MESSAGE_TYPES[int(code)] = cls
        return cls

    return wrap


@message(MsgType.HELLO)
class Hello(Message):
    """First frame on every stream: who speaks, and for which model and recipe."""

    agent: str = "meshd"
    peer_id: str = ""
    model_fingerprint: str = ""
    recipe_fingerprint: str = ""


@message(MsgType.OPEN)
class OpenSession(Message):
    """Open a session on a hop for layers [start, end); the tail also gets the sampling parameters."""

    request_id: int
    session_id: bytes
    epoch: int
    start: int
    end: int
    model_fingerprint: str
    recipe_fingerprint: str
    max_length: int = 2048
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # where this hop sends its hidden states: the next hop's peer id and multiaddrs (space-separated);
    # empty: back to the sender (the entry relays them)
    next_peer: str = ""
    next_addrs: str = ""
    # only frames of sessions in the same microbatch share a forward pass (see meshd/hop/scheduler.py)
    microbatch: int = 0
    # the RoPE table the session rotates with (meshd/shard/rope.py): 0 short, every model's; 1 long, a
    # longrope model's (Phi-3) for a sequence past its pretraining context. Appended within protocol 6:
    # a frame without it (an earlier build) opens a short session
    rope_table: int = 0
    # prefix reuse (meshd/shard/prefix.py): the hash chain of the whole blocks of tokens the session will be fed
    # first, so the hop may start it from KV it kept of the same tokens (empty: none asked)
    prefix: bytes = b""
    # constrained decoding (meshd/shard/grammar.py): the grammar every sampled token of the session must keep to
    # (an llguidance grammar, JSON text; sent to the hop that samples), and the position of the first generated
    # token (the ids fed from there on are the grammar's input). Empty: free text
    grammar: str = ""
    grammar_from: int = 0

    LATE_FIELDS: ClassVar[int] = 4


@message(MsgType.OPENED)
class Opened(Message):
    """A hop accepted `OpenSession`."""

    request_id: int
    session_id: bytes
    epoch: int
    forwarding: bool = False  # its outputs go straight to the next hop asked for (else back to the sender)
    reused: int = 0  # positions of the asked prefix it holds already: the session starts with them

    LATE_FIELDS: ClassVar[int] = 1


@message(MsgType.FORWARD)
class Forward(Message):
    """Activations (or token ids, for a head) for positions [position, position + n) of a session."""

    session_id: bytes
    epoch: int
    step: int
    phase: Phase
    position: int
    chunk_index: int = 0
    chunk_total: int = 1
    tensors: tuple[Tensor, ...] = field(default=())


MAX_BATCH_FRAMES = 64  # Forward frames in one ForwardBatch (each has at least one tensor: Limits.max_tensors)


@message(MsgType.FORWARD_BATCH)
class ForwardBatch(Message):
    """The Forward frames of several sessions in one frame: what one pass of a hop sends to the
    same next hop, so the next hop gets them together and runs them in one pass. `items` holds
    each frame's Forward fields followed by its tensor count; `tensors` all their tensors in order.
    Decoding checks every item as a Forward frame's header would be checked."""

    items: tuple
    tensors: tuple[Tensor, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 < len(self.items) <= MAX_BATCH_FRAMES:
            raise MalformedFrame(f"ForwardBatch of {len(self.items)} frames (1 to {MAX_BATCH_FRAMES})")
        width = len(Forward.FIELD_CHECKS) + 1
        items, total = [], 0
        for item in self.items:
            if type(item) not in (list, tuple) or len(item) != width:
                raise MalformedFrame(f"ForwardBatch item must be a list of {width} values")
            try:
                values = tuple(check(v) for (_, check), v in zip(Forward.FIELD_CHECKS, item))
            except TypeError as exc:
                raise MalformedFrame(f"ForwardBatch item: {exc}") from None
            count = item[-1]
            if type(count) is not int or count < 0:
                raise MalformedFrame(f"ForwardBatch item: bad tensor count {count!r}")
            total += count
            items.append((*values, count))
        if total != len(self.tensors):
            raise MalformedFrame(f"ForwardBatch items claim {total} tensors, frame has {len(self.tensors)}")
        object.__setattr__(self, "items", tuple(items))

    @classmethod
    def of(cls, frames: "list[Forward]") -> "ForwardBatch":
        items = [(*(getattr(f, name) for name, _ in Forward.FIELD_CHECKS), len(f.tensors)) for f in frames]
        return cls(items=tuple(items), tensors=tuple(t for f in frames for t in f.tensors))

    def frames(self) -> "list[Forward]":
        out, at = [], 0
        names = [name for name, _ in Forward.FIELD_CHECKS]
        for *values, count in self.items:
            out.append(Forward(**dict(zip(names, values)), tensors=self.tensors[at:at + count]))
            at += count
        return out


@message(MsgType.TOKEN)
class Token(Message):
    """The token the tail sampled at `step`. `pass_size` tokens of the tail's pass `pass_id` go to
    the same entry daemon (0: not said): the entry can wait for all of them before its next pass."""

    session_id: bytes
    epoch: int
    step: int
    token_id: int
    logprob: Optional[float] = None
    pass_id: int = 0
    pass_size: int = 0
    accepted: int = 0  # answering a VERIFY frame: how many of its drafts precede `token_id`
    tensors: tuple[Tensor, ...] = field(default=())  # the route's sketches, when the frame asked for them


@message(MsgType.CLOSE)
class Close(Message):
    """The session ended; with `keep`, the hash chain of the tokens its KV holds (whole blocks from
    position 0): the hop may keep that KV for the same entry's next session that extends them."""

    session_id: bytes
    epoch: int
    keep: bytes = b""

    LATE_FIELDS: ClassVar[int] = 1


@message(MsgType.LEAVING)
class Leaving(Message):
    """A hop leaves the mesh on purpose (a drain, a stop, a move): sent on the home stream of each session it
    serves for another daemon, whose entry may have its KV handed over (`HandOver`) instead of replaying it."""

    session_id: bytes
    epoch: int


@message(MsgType.HAND_OVER)
class HandOver(Message):
    """An entry asks the hop of one of its sessions that is leaving to send the KV of the session's first
    `positions` positions to `peer` (who was told to take it: `AcceptKV` with the same `ticket`)."""

    session_id: bytes
    epoch: int
    peer: str
    addrs: str  # space-separated multiaddrs
    ticket: bytes
    positions: int
    held: int = 0  # positions the receiver has already (an earlier round's): send [held, positions)


@message(MsgType.ACCEPT_KV)
class AcceptKV(Message):
    """An entry asks a hop to take the KV of `positions` positions of its session's layers [start, end) from
    `sender` (a hop that is leaving), and keep it under `chain` (the hash chain of those positions' tokens,
    `meshd/shard/prefix.py`) for a session the entry opens next. Without it, KV from anyone is refused."""

    ticket: bytes
    sender: str
    start: int
    end: int
    rope_table: int
    positions: int
    chain: bytes
    model_fingerprint: str
    recipe_fingerprint: str
    held: int = 0  # a later round's: the first `held` positions are the KV it kept for the entry under the chain's
    # first blocks (the earlier round's), and only [held, positions) come


@message(MsgType.KV_CHUNK)
class KVChunk(Message):
    """KV of positions [position, position + n) of a hand-over (`ticket`): tensors `k` and `v`, each
    [layers, 1, kv heads, n, head dim] in the receiver's KV dtype. Chunks come in order; the last one
    (position + n == the positions accepted) is answered with `HandedOver`."""

    ticket: bytes
    position: int
    tensors: tuple[Tensor, ...] = field(default=())


@message(MsgType.HANDED_OVER)
class HandedOver(Message):
    """A hand-over ended: `positions` of KV are kept at the receiver (0: it failed, `reason` says why). The
    receiver answers the sender so; the sender tells the entry on the session's home stream."""

    session_id: bytes
    epoch: int
    ticket: bytes
    positions: int
    reason: str = ""


@message(MsgType.CANCEL)
class Cancel(Message):
    session_id: bytes
    epoch: int
    reason: str = ""


@message(MsgType.HEARTBEAT)
class Heartbeat(Message):
    seq: int
    sent_at: float = 0.0


@message(MsgType.ERROR)
class Error(Message):
    """A structured failure: `code` (see `ErrorCode`), a message for humans, and whether to retry."""

    code: str
    message: str
    retriable: bool = False
    request_id: int = 0
    session_id: bytes = b""
    retry_after_s: float = 0.0  # with `busy`: when trying again may succeed


@message(MsgType.GENERATE)
class GenerateRequest(Message):
    """A client asks an entry daemon for text."""

    request_id: int
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False
    ignore_eos: bool = False
    messages: str = ""  # a whole conversation as JSON ([{"role", "content"}, ...]); replaces `prompt`
    speculate: bool = True  # False: no drafts for this request, whatever the entry's --speculate
    verify: bool = False  # True: check this generation on a second route, whatever the entry's --verify-rate
    grammar: str = ""  # an llguidance grammar (JSON text) every generated token keeps to; empty: free text
    tools: str = ""  # OpenAI tool definitions (JSON list) the chat template is rendered with; empty: none


@message(MsgType.STATUS)
class StatusRequest(Message):
    """A client asks its daemon for status; the answer is a StreamEvent of kind "status"."""

    request_id: int


@message(MsgType.DRAIN)
class DrainRequest(Message):
    """A client asks its daemon to drain: take no new sessions, withdraw its record, let running
    generations finish; `exit` then stops the daemon. The answer is a StreamEvent of kind "status"."""

    request_id: int
    exit: bool = False


@message(MsgType.LEDGER)
class LedgerRequest(Message):
    """A client asks its daemon for its work ledger's totals since `since` (seconds since the epoch;
    0: all it keeps), for one peer or all; the answer is a StreamEvent of kind "ledger"."""

    request_id: int
    since: float = 0.0
    peer: str = ""


@message(MsgType.STREAM_EVENT)
class StreamEvent(Message):
    """One event of a stream: `kind` is "text", "done", "error" or "status"; details in `stats`. A checked
    generation whose text goes out at once also sends "verified" (`stats.verified_through`: its first so many
    generated tokens are checked) and "retract" (`text`: why; `stats.tokens`: the generated tokens that stand,
    `stats.keep_chars`: the characters of the text sent so far that stand; the text goes on from there)."""

    request_id: int
    kind: str
    text: str = ""
    token_id: int = -1
    stats: dict = field(default_factory=dict)
