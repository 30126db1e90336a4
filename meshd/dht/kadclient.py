"""One Kademlia question to one peer and its answer, over py-libp2p's wire protocol, under a deadline.

Rule: a stream is fresh and closed after its one exchange (reset after a failed one), except the
streams kept for republishing to the same peers, which a peer holds one handler slot each for.
"""

from __future__ import annotations

import trio
import varint
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.utils.varint import read_varint_prefixed_bytes_limited


class KadClient:
    """Asks the KadDHT services of a host's peers, one question per call."""

    def __init__(self, host, query_timeout: float) -> None:
        self.host, self.query_timeout = host, query_timeout
        self.queries = 0  # questions sent, for benches and tests
        self._kept: dict[ID, object] = {}  # peer -> open stream, for republishing to the same peers
        self.dial = None  # async dial(peer ID): reach a peer the swarm cannot dial itself (through a relay)

    async def ask(self, peer: ID, request: Message, keep: bool = False) -> Message:
        """One question, one answer; raises on any failure. The stream is fresh and closed after,
        unless `keep`: then the one kept for this peer is used (a fresh one if it broke: a peer
        resets it after any refusal) and kept again, sparing the protocol negotiation that costs
        a Python peer about as much as the question itself."""
        self.queries += 1
        if keep and (kept := self._kept.pop(peer, None)) is not None:
            try:
                reply = await self._exchange(kept, request)
            except Exception:
                await _discard(kept, ok=False)
            else:
                await self._keep(peer, kept)
                return reply
        stream = None
        ok = False
        try:
            with trio.fail_after(self.query_timeout):
                if self.dial is not None and peer not in self.host.get_connected_peers():
                    await self.dial(peer)
                stream = await self.host.new_stream(peer, [PROTOCOL_ID])
            reply = await self._exchange(stream, request)
            ok = True
            return reply
        finally:
            if stream is not None:
                await (self._keep(peer, stream) if ok and keep else _discard(stream, ok))

    async def _exchange(self, stream, request: Message) -> Message:
        with trio.fail_after(self.query_timeout):
            data = request.SerializeToString()
            await stream.write(varint.encode(len(data)) + data)
            raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
        reply = Message()
        reply.ParseFromString(raw)
        return reply

    async def _keep(self, peer: ID, stream) -> None:
        old = self._kept.get(peer)
        self._kept[peer] = stream
        if old is not None and old is not stream:  # two pushes to one peer overlapped: one stream stays
            await _discard(old, ok=True)

    async def close_kept(self, keep: set[ID] = frozenset()) -> None:
        """Close the kept streams of every peer not in `keep` (each holds a handler slot at its peer)."""
        for peer in [p for p in self._kept if p not in keep]:
            await _discard(self._kept.pop(peer), ok=True)


async def _discard(stream, ok: bool) -> None:
    """Close a stream after a clean exchange, reset it after a failed one; never raises, never hangs."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await (stream.close() if ok else stream.reset())
        except Exception:
            pass
