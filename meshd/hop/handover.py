"""Hand-over: a hop that leaves on purpose sends its sessions' KV to another hop serving the same layers, so
their entries switch routes without computing the text so far again.

Rules: nobody pushes KV nobody asked for. An entry whose hop is leaving (`Leaving`) tells a replica to take
the KV (`AcceptKV`: from which peer, for which layers, how many positions, under which hash chain, with a
one-time ticket) and then the leaving hop to send it (`HandOver`, same ticket). The receiver takes chunks
of that ticket from that sender only, in order, each checked against its own KV layout (dtype, layers, heads,
head dim, positions); the KV is charged to its budget as it arrives, and once whole it becomes KV kept for
that entry (`meshd/shard/prefix.py`), which the entry's next session on those layers starts from. The
sender reads its KV on the compute thread between passes while the session goes on, in bounded chunks,
and tells the entry how it went (`HandedOver`: positions kept, 0 when it failed: the entry replays).
`Incoming` is pure bookkeeping (the endpoint calls it on the compute thread); `push` is the sender's I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import trio

from meshd.core.log import get_logger
from meshd.p2p.channel import ChannelClosed
from meshd.shard import prefix
from meshd.wire import AcceptKV, HandedOver, HandOver, KVChunk, Tensor

CHUNK_BYTES = 4 << 20  # KV bytes in one KVChunk frame (well under a frame's payload limit)
INCOMING_TTL_S = 30.0  # an accepted hand-over whose KV has not all come by then is dropped
MAX_INCOMING = 16  # hand-overs being received at once, all requesters
MAX_INCOMING_PER_PEER = 4  # ... and per requesting entry
INCOMING_SHARE = 0.25  # the share of the KV budget hand-overs being received may hold at once
PUSH_TIMEOUT_S = 20.0  # the longest a sender spends on one hand-over (dial, chunks, the receiver's answer)
log = get_logger(__name__)


class HandOverRefused(ValueError):
    """An AcceptKV or KVChunk this hop does not take (the endpoint answers it with an Error)."""


@dataclass
class Receiving:
    """A hand-over accepted here: KV of `positions` positions coming from `sender` for `requester`."""

    ticket: bytes
    requester: str
    sender: str
    key: tuple
    positions: int
    chain: list[bytes]
    expires: float
    nbytes: int = 0  # its room in the KV budget
    received: int = 0
    held: int = 0  # positions it started with (an earlier round's KV, kept here)


@dataclass
class Tally:
    """Hand-overs as this hop saw them (status, metrics)."""

    sent: int = 0  # sessions whose KV this hop sent, and the receiver kept
    received: int = 0  # hand-overs this hop took whole
    failed: int = 0  # hand-overs that ended without the KV kept (either side)
    refused: int = 0  # KV offered that nobody asked for, or that did not fit
    positions: int = 0  # positions sent or received whole

    def summary(self) -> dict:
        return {"sent": self.sent, "received": self.received, "failed": self.failed, "refused": self.refused,
                "positions": self.positions}


@dataclass
class Incoming:
    """The hand-overs a shard is receiving, by ticket."""

    shard: object  # meshd.shard.runtime.Shard
    clock: object = time.monotonic
    open: dict[bytes, Receiving] = field(default_factory=dict)
    tally: Tally = field(default_factory=Tally)

    def accept(self, msg: AcceptKV, requester: str) -> None:
        """Take `msg`'s hand-over (its room reserved now), or raise HandOverRefused (or KVBudgetExceeded)."""
        self.expire()
        shard = self.shard
        if not requester:
            raise HandOverRefused("a hand-over is asked for by the entry of a session, over a stream")
        if not shard.start <= msg.start < msg.end <= shard.end:
            raise HandOverRefused(f"this shard serves layers [{shard.start}, {shard.end}), not [{msg.start}, {msg.end})")
        if not shard.passes_equal_steps or shard.kv.kept.ttl_s <= 0 or any(shard.windows(msg.start, msg.end)):
            raise HandOverRefused("this hop keeps no KV for reuse (its lane, its --prefix-ttl or windowed layers)")
        chain = prefix.unpack(msg.chain)
        if len(msg.ticket) != 16 or msg.ticket in self.open:
            raise HandOverRefused("a hand-over needs a new ticket of 16 bytes")
        if not 0 < msg.positions == len(chain) * prefix.BLOCK or msg.positions > shard.max_positions:
            raise HandOverRefused(f"{msg.positions} positions under a chain of {len(chain)} blocks")
        if not 0 <= msg.held < msg.positions or msg.held % prefix.BLOCK:
            raise HandOverRefused(f"a hand-over of positions [{msg.held}, {msg.positions})")
        need = shard.kv.bytes_for(msg.positions, msg.end - msg.start)
        if len(self.open) >= MAX_INCOMING or sum(r.requester == requester for r in self.open.values()) \
                >= MAX_INCOMING_PER_PEER or need + sum(r.nbytes for r in self.open.values()) \
                > INCOMING_SHARE * shard.kv.budget_bytes:
            raise HandOverRefused("busy: too many hand-overs under way here")
        key = ("hand-over", msg.ticket)
        shard.open_session(key, msg.positions, msg.start, msg.end, msg.rope_table)
        try:
            # a later round starts from the earlier one's KV, kept here for the same entry (a local copy)
            if msg.held and shard.reuse(key, requester, chain[:msg.held // prefix.BLOCK]) != msg.held:
                raise HandOverRefused(f"the first {msg.held} positions are not kept here")
            kv = shard.kv.get(key)
            kv.reserve(msg.held, msg.positions - msg.held)  # charged now: the KV has its room before it comes
        except Exception:
            shard.release(key)
            raise
        self.open[msg.ticket] = Receiving(msg.ticket, requester, msg.sender, key, msg.positions, chain,
                                          self.clock() + INCOMING_TTL_S, need, received=msg.held, held=msg.held)

    def chunk(self, msg: KVChunk, sender: str) -> HandedOver | None:
        """Store one chunk; the answer once the last one is in (None before). HandOverRefused for a chunk of
        no hand-over accepted here from `sender`, out of order, or not shaped as this shard's KV."""
        self.expire()
        got = self.open.get(msg.ticket)
        if got is None or got.sender != sender:
            self.tally.refused += 1
            raise HandOverRefused("KV that nobody asked this hop to take")
        try:
            kv = self.shard.kv.get(got.key)
            k, v = _chunk_tensors(msg, kv, got)
            kv.k[:, :, :, msg.position:msg.position + k.shape[3]] = k
            kv.v[:, :, :, msg.position:msg.position + k.shape[3]] = v
        except Exception as exc:
            self.drop(got, failed=True)
            raise HandOverRefused(f"hand-over chunk refused: {exc}") from None
        got.received += k.shape[3]
        if got.received < got.positions:
            return None
        del self.open[got.ticket]
        kv.commit(got.positions)
        kept = self.shard.keep(got.key, got.requester, got.chain)
        self.tally.received += bool(kept) and not got.held
        self.tally.positions += max(0, kept - got.held) if kept else 0
        self.tally.failed += not kept
        return HandedOver(session_id=b"", epoch=0, ticket=got.ticket, positions=kept,
                          reason="" if kept else "the KV could not be kept here")

    def drop(self, got: Receiving, failed: bool = False) -> None:
        self.open.pop(got.ticket, None)
        self.shard.release(got.key)
        self.tally.failed += failed

    def expire(self) -> None:
        now = self.clock()
        for got in [r for r in self.open.values() if r.expires < now]:
            log.info("a hand-over's KV did not all come in time", sender=got.sender[-8:], received=got.received,
                     positions=got.positions)
            self.drop(got, failed=True)


def _chunk_tensors(msg: KVChunk, kv, got: Receiving) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's k and v, checked against the receiving cache (layers, heads, head dim, dtype) and its place."""
    named = {t.name: t for t in msg.tensors}
    if set(named) != {"k", "v"}:
        raise ValueError(f"a KV chunk carries tensors k and v, not {sorted(named)}")
    k, v = named["k"].to_torch(), named["v"].to_torch()
    want = (kv.k.shape[0], 1, kv.k.shape[2], kv.k.shape[4])
    for t in (k, v):
        if t.dtype != kv.k.dtype or t.dim() != 5 or (t.shape[0], t.shape[1], t.shape[2], t.shape[4]) != want:
            raise ValueError(f"KV {t.dtype} {tuple(t.shape)} where this hop keeps {kv.k.dtype} {want[:3]}+[n]+{want[3:]}")
    if k.shape != v.shape or k.shape[3] == 0:
        raise ValueError("k and v of a chunk differ in shape, or are empty")
    if msg.position != got.received or msg.position + k.shape[3] > got.positions:
        raise ValueError(f"positions [{msg.position}, {msg.position + k.shape[3]}) where [{got.received}, ...) of"
                         f" {got.positions} were due")
    return k, v


def read_chunk(shard, key, a: int, b: int) -> tuple[Tensor, Tensor]:
    """Positions [a, b) of a session's KV as a chunk's tensors (on the compute thread, between passes)."""
    kv = shard.kv.get(key)
    if kv.n_sliding or b > kv.length:
        raise ValueError(f"this session's KV holds {kv.length} positions of full attention, not [{a}, {b})")
    return (Tensor.from_torch("k", kv.k[:, :, :, a:b].contiguous()),
            Tensor.from_torch("v", kv.v[:, :, :, a:b].contiguous()))


def chunk_positions(shard, key) -> int:
    """Positions a chunk of this session's KV holds (CHUNK_BYTES of it, at least one block)."""
    kv = shard.kv.get(key)
    per_position = max(1, kv.store.bytes_for(1, kv.n_layers))
    return max(prefix.BLOCK, CHUNK_BYTES // per_position)


async def push(service, msg: HandOver, home) -> int:
    """Send session (`msg.session_id`, `msg.epoch`)'s KV to the receiver its entry named, in chunks read
    between passes, and tell the entry (on `home`) how it went. The positions the receiver kept (0: failed)."""
    key, shard = (msg.session_id, msg.epoch), service.endpoint.shard
    kept, reason, channel = 0, "", None
    try:
        with trio.fail_after(PUSH_TIMEOUT_S):
            step = await service.compute.run(chunk_positions, shard, key)
            channel = await service.outputs.dial(msg.peer, msg.addrs.split())
            for a in range(msg.held, msg.positions, step):
                b = min(msg.positions, a + step)
                k, v = await service.compute.run(read_chunk, shard, key, a, b)
                await channel.send(KVChunk(ticket=msg.ticket, position=a, tensors=(k, v)))
            answer = await channel.receive(PUSH_TIMEOUT_S)
        if isinstance(answer, HandedOver) and answer.ticket == msg.ticket:
            kept, reason = answer.positions, answer.reason
        else:
            reason = f"the receiver answered {type(answer).__name__}: {getattr(answer, 'message', '')}"
    except Exception as exc:  # a dead or refusing receiver, a session gone meanwhile: the entry replays
        reason = f"{type(exc).__name__}: {exc}"
    finally:
        if channel is not None:
            with trio.CancelScope(shield=True):
                await channel.aclose()
    tally = service.endpoint.incoming.tally
    tally.sent += kept > 0 and not msg.held  # a session's later rounds count once, with their positions
    tally.failed += kept <= 0
    tally.positions += max(0, kept - msg.held)
    if kept > 0:
        session = service.endpoint.sessions.get(key)
        if session is not None:
            session.handed_over = True
    log.info("hand-over " + ("done" if kept else "failed"), to=msg.peer[-8:], positions=kept or msg.positions,
             reason=reason or None)
    try:
        await home.send(HandedOver(session_id=msg.session_id, epoch=msg.epoch, ticket=msg.ticket, positions=kept,
                                   reason=reason))
    except ChannelClosed:
        pass
    return kept
