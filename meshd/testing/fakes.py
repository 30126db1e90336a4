"""Fakes of meshd's own interfaces for fast tests, as `trio.testing` ships memory streams and a clock:
a hop's channel, a mesh view, coverage records and maps, a channel pair over memory streams, and a
pair of raw connections (what a transport hands the security upgrade) over memory streams.

Rule: these stand in only for what a test does not exercise; each one keeps the real interface's
names and meaning, so a test written against a fake reads like one against the real part.
"""

from __future__ import annotations

import time
from dataclasses import replace

import trio
import trio.testing

from meshd.dht.coverage import CoverageMap
from meshd.dht.record import CoverageRecord
from meshd.p2p.channel import Channel
from meshd.wire import Heartbeat


def record(peer_id: str, start: int, end: int, n_layers: int = 30, *, auto: int = 10, serving: bool = True,
           **fields) -> CoverageRecord:
    """A coverage record as a serving daemon publishes it (valid for a minute)."""
    return CoverageRecord(peer_id=peer_id, addrs=(f"/ip4/127.0.0.1/tcp/{4000 + len(peer_id)}",), model="m",
                          recipe="r", start=start, end=end, n_layers=n_layers, expires_at=time.time() + 60,
                          serving=serving, auto_layers=auto, **fields)


def coverage(*records: CoverageRecord, n_layers: int = 30) -> CoverageMap:
    return CoverageMap.build(n_layers, records)


class FakeMesh:
    """The mesh view as its readers see it: this daemon's record, the coverage map, measured latencies;
    `publish` changes the record as the real view does (without the DHT)."""

    def __init__(self, own: CoverageRecord, cover: CoverageMap, latency: dict[str, float] | None = None,
                 ttl_s: float = 8.0) -> None:
        self.record, self.coverage, self.ttl_s = own, cover, ttl_s
        self.peer_id = own.peer_id
        self.latency = dict(latency or {})
        self.published: list[dict] = []
        self.lapsed: set[str] = set()  # peers whose records lapsed lately (set by a test)

    async def refresh(self) -> CoverageMap:
        return self.coverage

    def lapsed_serving(self, start: int) -> set[str]:
        return set(self.lapsed)

    async def publish(self, **changes) -> None:
        self.published.append(changes)
        self.record = replace(self.record, **changes)


class FakeHop:
    """A hop's channel: what the entry sends is recorded; what the hop answers is fed by the test.
    A live hop (`echo`) answers pings at once, as a daemon's event loop does while it computes."""

    def __init__(self, echo: bool = False) -> None:
        self.sent, self.echo = [], echo
        self.answers_in, self.answers = trio.open_memory_channel(100)

    async def send(self, msg) -> None:
        if isinstance(msg, Heartbeat):
            if self.echo:
                self.answers_in.send_nowait(msg)
            return
        self.sent.append(msg)

    async def receive(self, timeout: float):
        with trio.fail_after(timeout):
            return await self.answers.receive()

    async def aclose(self) -> None:
        pass


def channel_pair() -> tuple[Channel, Channel]:
    """Two `Channel`s joined by an in-memory stream: frames sent on one arrive, encoded, at the other."""
    a, b = trio.testing.memory_stream_pair()
    return Channel.over_trio(a), Channel.over_trio(b)


class MemoryRawConn:
    """A raw libp2p connection (read/write/close, addresses) over a trio memory stream."""

    def __init__(self, stream, remote: tuple[str, int], is_initiator: bool) -> None:
        self.stream, self.remote, self.is_initiator = stream, remote, is_initiator

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()

    def get_remote_address(self) -> tuple[str, int]:
        return self.remote

    def get_transport_addresses(self) -> list:
        return []


def raw_conn_pair() -> tuple[MemoryRawConn, MemoryRawConn]:
    """Two ends of one raw connection (the dialler's first), in memory."""
    a, b = trio.testing.memory_stream_pair()
    return MemoryRawConn(a, ("192.0.2.2", 4690), True), MemoryRawConn(b, ("192.0.2.1", 50000), False)
