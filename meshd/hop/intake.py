"""What a daemon takes in from other daemons' shard streams, one `Intake` for all its streams:
frame bytes against a per-peer share and a total (`meshd/p2p/budget.py`), streams per peer, each
peer's share of the sessions, the KV budget and the queue, and how long a stream may sit on a
half-sent frame or say nothing at all.

Rule: every answer here is given on the event loop at once (a refusal never waits behind a pass),
and every count taken is given back in one place (`opened`, `dequeue`, `release`). A session admitted here
is reserved in its shard's session table (`meshd/hop/sessions.py`) until its open was tried: that table,
not the intake, says what each peer holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import trio

from meshd.core.settings import default
from meshd.hop.admission import PEER_SHARE, busy
from meshd.p2p.budget import ByteBudget, Held
from meshd.p2p.channel import FRAME_TIMEOUT, Channel
from meshd.shard.footprint import trim_heap
from meshd.wire import DEFAULT_CHUNK_TOKENS, DEFAULT_ENCODING, Error, OpenSession
from meshd.wire.protocols import SHARD_PROTOCOL

IDLE_TIMEOUT = default("stream_idle")
FRAME_BUDGET = default("frame_budget_mb") << 20  # bytes all peers' frames may occupy at once (queued, half-received,
# being decoded)
PEER_FRAME_SHARE = default("peer_frame_mb") << 20  # ... one peer's frames (three of the largest frames a decoder takes)
STREAMS_PER_PEER = default("streams_per_peer")  # shard streams one peer may hold open here (an entry opens one a
# session)
TRIM_AFTER = 16 << 20  # once the frames of a burst this big are done, freed heap goes back to the system
TRIM_PERIOD_S = 2.0
TRIMS_AFTER_BURST = 15  # trims after a burst, TRIM_PERIOD_S apart: 30 s, so that buffers py-libp2p frees
# when the peer hangs up go back too


@dataclass
class Intake:
    """The limits, and what each peer holds against them now."""

    budget: ByteBudget = field(default_factory=lambda: ByteBudget(FRAME_BUDGET, PEER_FRAME_SHARE))
    streams_per_peer: int = STREAMS_PER_PEER
    frame_timeout: float = FRAME_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    peer_share: float = PEER_SHARE  # of the sessions and KV, what one peer may hold (meshd/hop/admission.py)
    encoding: str = DEFAULT_ENCODING  # how the frames sent back on these streams pack their tensors
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # this daemon's prefill chunk: a frame may carry so many positions
    streams: Counter = field(default_factory=Counter)  # peer -> shard streams open now
    queued: Counter = field(default_factory=Counter)  # peer -> its Forward frames waiting for compute here
    trims_due: int = 0  # heap trims `trim_loop` still owes the last burst

    def channel(self, stream) -> Channel:
        channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL), self.encoding)
        channel.peer = str(getattr(getattr(stream, "muxed_conn", None), "peer_id", ""))
        channel.budget, channel.frame_timeout = self.budget, self.frame_timeout
        return channel

    def admission(self, service, peer: str, msg: OpenSession) -> Error | None:
        """The `busy` refusal of a session, answered on the event loop (not behind a pass): the
        daemon is full, or this peer holds its share. None: the endpoint decides (and says what
        else may be wrong); the session then counts against the peer until it is open (reserved in the
        endpoint's session table)."""
        endpoint = service.endpoint
        key = (msg.session_id, msg.epoch)
        if (msg.model_fingerprint, msg.recipe_fingerprint) != (endpoint.model_fp, endpoint.recipe_fp) \
                or key in endpoint.sessions:
            return None
        need = endpoint.kv_need(msg)
        count, promised = endpoint.sessions.held_by(peer)  # its open sessions and those reserved for it
        room = endpoint.capacity(reclaiming=True)  # sessions long unused give way to a new one
        why = room.peer_refusal(count, promised, need, self.peer_share)
        if why is None:
            endpoint.sessions.reserve(peer, key, need)
            return None
        endpoint.refused += 1
        return busy(f"busy: this daemon is full: {why}", msg.request_id, msg.session_id)

    def opened(self, service, peer: str, msg: OpenSession) -> None:
        """A session admitted by `admission` has opened (or failed to): it counts as held, or not at all."""
        service.endpoint.sessions.settle(peer, (msg.session_id, msg.epoch))

    def enqueue(self, service, peer: str) -> Error | None:
        """Count one more Forward frame of `peer`'s waiting here, or the `busy` refusal when its share
        of the shard's queue (`peer_share` of `--max-queue`) is full."""
        most = max(1, int(service.scheduler.max_queued * self.peer_share))
        if self.queued[peer] >= most:
            return busy(f"busy: this daemon is full: this peer has {self.queued[peer]} frames waiting here,"
                        f" its share of {service.scheduler.max_queued}")
        self.queued[peer] += 1
        return None

    def dequeue(self, peer: str) -> None:
        self.queued[peer] -= 1
        if self.queued[peer] <= 0:
            del self.queued[peer]

    async def release(self, held: Held | None) -> None:
        """Give a frame's bytes back; after a burst, hand the freed heap back too (as loading does)."""
        if held is not None:
            held.release()
        await self.trim_after_burst()

    async def trim_after_burst(self, later: bool = False) -> None:
        """Once a burst of frames is over (nothing held, much held before), give the heap back now
        and on the next ticks of `trim_loop` (py-libp2p frees a stream's buffers after its handler
        returned); with `later` (a stream that took a big frame ended), on those ticks only: trims
        in a row would stall the event loop (the trim holds malloc's locks while it walks the heap)."""
        if later:
            self.trims_due = TRIMS_AFTER_BURST
        elif self.budget.trimmed(TRIM_AFTER):
            self.trims_due = TRIMS_AFTER_BURST
            await trio.to_thread.run_sync(trim_heap)

    async def trim_loop(self, period_s: float = TRIM_PERIOD_S) -> None:
        """The daemon's background task: the trims a burst left due, while no frame is held."""
        while True:
            await trio.sleep(period_s)
            if self.trims_due and not self.budget.in_use:
                self.trims_due -= 1
                await trio.to_thread.run_sync(trim_heap)
