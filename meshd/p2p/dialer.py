"""One dialler for a daemon: a connection to a peer, directly or through the relays its circuit
addresses name, and new streams on it.

Rules: dials to one peer go one at a time (16 sessions opening at once must not dial 16
connections); a peer with circuit addresses is tried every way at once, staggered
(`meshd.p2p.race`: a dead relay costs a second, not a timeout), direct first, then the relays we
hold a connection to, then the nearest (`circuit_rank`, pure); a peer we dial for sessions is
protected from py-libp2p's per-peer trimming; a stream on a connection py-libp2p has just closed
is tried once more on a fresh one; a stream a connected peer does not answer within NEGOTIATE_S fails. The mesh is seen only through two callables (`latency()`,
`known()`), and relays through the `circuit` dialler it is handed, so this module knows nothing of
records, the relay protocol or the daemon.
"""

from __future__ import annotations

from typing import Callable, Mapping

import multiaddr
import structlog
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from meshd.p2p.addrs import is_circuit, parse_circuit, relay_of, split_addrs, strip_peer
from meshd.p2p.channel import Channel
from meshd.p2p.connections import forget_failed_dials, is_connected, relayed_peers
from meshd.p2p.race import race
from meshd.wire import DEFAULT_ENCODING
from meshd.wire.protocols import SHARD_PROTOCOL

DIAL_STAGGER_S = 1.0  # a peer with circuit addresses: the next way is tried after this (or a failure)
DIAL_ATTEMPT_S = 8.0  # one way to a peer (direct, or through one relay)
NEGOTIATE_S = 5.0  # opening a stream on a connection held already: a peer that does not answer by then is
# frozen (SIGSTOP, a hung event loop), and its streams would wait for it as long as it stays so
PROTECT_TAG = "meshd-sessions"
log = structlog.get_logger(__name__)  # (meshd.core.log's get_logger is this; p2p/ does not import node/)


def circuit_rank(addr: str, connected: set[str], latency: Mapping[str, float]) -> tuple:
    """Sort key of a circuit address: relays in `connected` first, then the nearest by `latency`
    (seconds; an unmeasured relay counts as 1 s); an address that is not a well-formed circuit last."""
    relay = relay_of(addr)
    if relay is None:
        return (2, 0.0)
    return (0 if relay in connected else 1, latency.get(relay, 1.0))


class Dialer:
    def __init__(self, host, circuit, latency: Callable[[], Mapping[str, float]] = dict,
                 known: Callable[[], Mapping] = dict, encoding: str = DEFAULT_ENCODING) -> None:
        """`circuit(host, addr)`: a connection through the (connected) relay a circuit address names (the
        relay room's `dial_circuit`, handed in so that p2p, below the relay, imports nothing of it);
        `latency()`: peer id -> measured round trip (seconds); `known()`: peer id -> its record (anything
        with `addrs` and `relay_addrs`), the peers of this mesh; `encoding`: how shard streams it opens pack
        the tensors they send (--wire-encoding)."""
        self.host = host
        self.latency, self.known, self.circuit, self.encoding = latency, known, circuit, encoding
        self._locks: dict[str, trio.Lock] = {}

    async def dial_shard(self, peer_id: str, addrs) -> Channel:
        """A new shard stream to a peer (a session's next hop)."""
        stream = await self.open_stream(peer_id, addrs, SHARD_PROTOCOL)
        return Channel.over_libp2p(stream, str(SHARD_PROTOCOL), self.encoding)

    async def open_stream(self, peer_id: str, addrs, protocol):
        """A new stream to a peer. A connection py-libp2p has just closed (trimmed, reset) can still be
        listed as connected, and a stream on it fails with "No valid connections available" (seen on
        a fresh mesh's first generation): then dial a new connection, once."""
        pid = ID.from_base58(peer_id)
        for attempt in (0, 1):
            await self.ensure_connected(peer_id, addrs, fresh=attempt == 1)
            try:
                with trio.fail_after(NEGOTIATE_S):
                    return await self.host.new_stream(pid, [protocol])
            except trio.TooSlowError:
                raise  # connected, and not answering: a fresh connection would wait the same
            except Exception as exc:  # py-libp2p's SwarmException and stream negotiation errors
                if attempt == 1:
                    raise
                log.info("stream on a stale connection failed; dialling again", peer=peer_id[-8:],
                         error=f"{type(exc).__name__}: {exc}")

    async def ensure_connected(self, peer_id: str, addrs, fresh: bool = False) -> None:
        """A connection to a peer that sessions will use: directly, or through one of the relays its
        circuit addresses name (those we hold a connection to first, then the nearest), tried
        staggered (`meshd.p2p.race`: a dead relay costs a second, not a timeout). Dials to one peer go one at a time (16
        sessions opening at once must not dial 16 connections), and the peer is protected from
        py-libp2p's per-peer trimming: with one connection allowed per peer, a second one (both
        sides dialling at once) made it close the older connection, streams and all (seen under
        load: every session on it failed with StreamEOF)."""
        pid = ID.from_base58(peer_id)
        self.protect(pid)
        async with self._locks.setdefault(peer_id, trio.Lock()):
            network = self.host.get_network()
            if not fresh and is_connected(network, pid):
                return
            direct, circuits = split_addrs(addrs)
            if not circuits:
                await self._dial_direct(pid, direct, fresh)
                return
            connected = {r for r in map(relay_of, circuits) if r is not None and is_connected(network, r)}
            latency = self.latency()
            ways = [("direct", lambda: self._dial_direct(pid, direct, fresh))] if direct else []
            ways += [(addr, lambda addr=addr: self._dial_circuit(addr))
                     for addr in sorted(circuits, key=lambda a: circuit_rank(a, connected, latency))]
            try:
                await race(ways, stagger=DIAL_STAGGER_S, attempt_timeout=DIAL_ATTEMPT_S)
            except ConnectionError as exc:
                raise ConnectionError(f"cannot reach {peer_id[-8:]}: {exc}") from None

    async def dial_known(self, pid: ID) -> None:
        """The DHT's way to a peer the swarm cannot dial itself: through the relays its record, or the
        DHT's answers about it (circuit addresses in the peerstore), name. Never raises."""
        rec = self.known().get(pid.to_base58())
        circuits = list(rec.relay_addrs) if rec is not None else []
        if not circuits:
            try:
                circuits = [str(a) for a in self.host.get_peerstore().addrs(pid) if is_circuit(str(a))]
            except Exception:
                circuits = []
        if circuits:
            try:
                await self.ensure_connected(pid.to_base58(), (tuple(rec.addrs) if rec else ()) + tuple(circuits))
            except Exception:
                pass

    def protect(self, pid: ID) -> None:
        """Keep py-libp2p's connection trimming away from `pid` (a peer that carries sessions)."""
        try:
            self.host.get_network().protect(pid, PROTECT_TAG)
        except Exception:  # an older swarm without tags: nothing to protect against
            pass

    def mesh_peers(self) -> list[str]:
        """Connected peers of this mesh (they hold a record): the ones asked to dial us back."""
        connected = {p.to_base58() for p in self.host.get_connected_peers()}
        relayed = set(self.relayed_peers())  # one that reaches us through a relay sees the relay's address
        return [p for p in self.known() if p in connected and p not in relayed]

    def relayed_peers(self) -> list[str]:
        """Peers this daemon is connected to only through a relay."""
        return relayed_peers(self.host.get_network())

    async def _dial_circuit(self, addr: str) -> None:
        relay_addr, relay_id, _ = parse_circuit(addr)
        await self.ensure_connected(relay_id, [relay_addr])
        await self.circuit(self.host, addr)

    async def _dial_direct(self, pid: ID, addrs: list[str], fresh: bool) -> None:
        network = self.host.get_network()
        maddrs = [multiaddr.Multiaddr(strip_peer(a)) for a in addrs]
        forget_failed_dials(network, pid)
        if fresh or pid in network.connections:  # connect() returns early while any is listed
            self.host.peerstore.add_addrs(pid, maddrs, 120)
            await network.dial_peer(pid)
        else:
            await self.host.connect(PeerInfo(pid, maddrs))
