"""A py-libp2p host in memory, as much of it as meshd's dialler touches: a swarm of connections per
peer, dials that take scripted time or fail, streams that fail on a connection marked stale.

For fast tests of dialling policy (`meshd.p2p.dialer`) on trio's MockClock: no sockets, no keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID

from meshd.p2p.addrs import parse_circuit


def fake_id(name: str) -> ID:
    """The peer id whose base58 form is `name` (letters of the base58 alphabet: no 0, O, I, l)."""
    return ID.from_base58(name)


@dataclass
class FakeConn:
    relayed: bool = False
    is_closed: bool = False
    stale: bool = False  # listed and open, but a new stream on it fails (py-libp2p's trimmed connection)

    def get_transport_addresses(self):
        return ["/p2p/relay/p2p-circuit"] if self.relayed else ["/ip4/127.0.0.1/tcp/1"]


class FakeStream:
    """A stream that takes writes and reads as ended (the dialler's tests look at who was dialled)."""

    async def read(self, n: int = -1) -> bytes:
        return b""

    async def write(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class FakeNetwork:
    connections: dict = field(default_factory=dict)  # ID -> [FakeConn]
    protected: set = field(default_factory=set)
    unblocked: list = field(default_factory=list)
    host: "FakeHost | None" = None

    def protect(self, pid: ID, tag: str) -> None:
        self.protected.add((pid, tag))

    def unblock_peer(self, pid: ID) -> None:
        self.unblocked.append(pid)

    async def dial_peer(self, pid: ID):
        return [await self.host.dial(pid, "dial_peer")]


class FakePeerstore:
    def __init__(self) -> None:
        self.addrs_of: dict = {}  # ID -> [multiaddr]

    def add_addrs(self, pid: ID, addrs, ttl: int) -> None:
        self.addrs_of.setdefault(pid, []).extend(addrs)

    def addrs(self, pid: ID):
        return list(self.addrs_of.get(pid, []))


class FakeHost:
    """`delays[peer]`: seconds a dial to it takes (default 0); `refuse`: peers whose dials fail;
    `dials`: (peer name, how) of every dial, in order; `streams`: (peer name, protocol) opened."""

    def __init__(self) -> None:
        self.network = FakeNetwork(host=self)
        self.peerstore = FakePeerstore()
        self.delays: dict[str, float] = {}
        self.refuse: set[str] = set()
        self.dials: list[tuple[str, str]] = []
        self.streams: list[tuple[str, str]] = []

    def get_network(self) -> FakeNetwork:
        return self.network

    def get_peerstore(self) -> FakePeerstore:
        return self.peerstore

    def get_connected_peers(self) -> list[ID]:
        return list(self.network.connections)

    def connect_now(self, name: str, relayed: bool = False, **state) -> FakeConn:
        """Put a connection to `name` in the swarm (as if it had been dialled earlier)."""
        conn = FakeConn(relayed=relayed, **state)
        self.network.connections.setdefault(fake_id(name), []).append(conn)
        return conn

    async def dial(self, pid: ID, how: str, relayed: bool = False) -> FakeConn:
        name = pid.to_base58()
        self.dials.append((name, how))
        await trio.sleep(self.delays.get(name, 0.0))
        if name in self.refuse:
            raise OSError(f"{name} refused")
        self.network.connections[pid] = [FakeConn(relayed=relayed)]  # one connection per peer
        return self.network.connections[pid][0]

    async def connect(self, info) -> None:
        await self.dial(info.peer_id, "connect")

    async def new_stream(self, pid: ID, protocols):
        live = [c for c in self.network.connections.get(pid, []) if not c.is_closed]
        if not live or live[0].stale:
            raise OSError("No valid connections available")
        self.streams.append((pid.to_base58(), str(protocols[0])))
        return FakeStream()

    async def circuit(self, host, addr: str) -> None:
        """Stands in for `meshd.relay.circuit.dial_circuit`: a relayed connection to the addressed peer."""
        _, relay, peer = parse_circuit(addr)
        await self.dial(fake_id(peer), f"circuit via {relay}", relayed=True)
