"""Fakes of meshd's own interfaces for fast tests, as `trio.testing` ships memory streams and a clock:
a hop's channel, a mesh view, coverage records and maps, a channel pair over memory streams, a
pair of raw connections (what a transport hands the security upgrade) over memory streams, and a
daemon as its parts read it, with a model's artifact, a dialer and a loaded range's shard and service.

Rule: these stand in only for what a test does not exercise; each one keeps the real interface's
names and meaning, so a test written against a fake reads like one against the real part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import trio
import trio.testing

from meshd.api.control import Controls
from meshd.api.http import Served
from meshd.api.metrics import Metrics
from meshd.dht.coverage import CoverageMap
from meshd.dht.record import CoverageRecord
from meshd.node.ledger import Ledger
from meshd.node.lifecycle import Lifecycle, State
from meshd.core.settings import Settings
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


@dataclass
class FakeConfig:
    """A model's configuration as the entry and the HTTP API read it."""

    max_positions: int = 2048
    eos_id: int = 2


@dataclass
class FakeArtifact:
    """A model's files as their readers see them, without weights: its name, configuration, fingerprint
    and GGUF metadata (where a chat template lives)."""

    name: str = "m"
    config: FakeConfig = field(default_factory=FakeConfig)
    fingerprint: str = "m"
    metadata: dict = field(default_factory=dict)


class FakeDialer:
    """A dialer that reaches nobody: for tests that plan routes and open no stream."""

    async def open_stream(self, peer_id: str, addrs, protocol):
        raise ConnectionError(f"a fake dialer dials nobody ({peer_id})")


@dataclass
class FakeShard:
    """A loaded range as the daemon switches to it, without weights."""

    start: int
    end: int
    passes_equal_steps: bool = True

    @property
    def is_head(self) -> bool:
        return self.start == 0


@dataclass
class FakeService:
    """A range's shard service as the daemon hands it to an entry: a name, the nursery it is given."""

    name: str
    nursery: object = None


class FakeEntry:
    """This daemon's entry: each generation asked of it runs `generate(request, emit) -> stats`."""

    def __init__(self, generate) -> None:
        self._generate = generate

    async def generate(self, req, emit) -> dict:
        return await self._generate(req, emit)


class FakeDaemon:
    """The daemon as its parts are handed it: a lifecycle that serves, a status (`status` adds to its
    state), a mesh view, a model's artifact, settings and a ledger (the real ones, the ledger without a
    file), metrics over its status and ledger, and an entry whose generations `generate` runs (none
    without it); `controls()` and `served()` give the control socket and the HTTP API what the real daemon
    gives them (meshd/node/daemon.py), the rebalancer reads it as its `Placed`."""

    def __init__(self, status: dict | None = None, *, mesh: FakeMesh | None = None,
                 artifact: FakeArtifact | None = None, generate=None) -> None:
        self.lifecycle = Lifecycle()
        self.lifecycle.to(State.SERVING)
        self.fields = dict(status or {})
        self.mesh, self.artifact = mesh, artifact
        self.entry = FakeEntry(generate) if generate is not None else None
        self.settings, self.ledger = Settings(), Ledger(None)
        self.metrics = Metrics(self.status, lambda: self.ledger.totals())
        self.started_at = time.time()

    def status(self) -> dict:
        return {"state": str(self.lifecycle), **self.fields}

    def controls(self) -> Controls:
        async def drain(reason, timeout):
            self.lifecycle.to(State.DRAINING, reason)

        def no_entry(*_):
            raise AssertionError("this fake hands no generation on")

        return Controls(stage=self.lifecycle, status=self.status, ledger_totals=lambda *a: self.ledger.totals(*a),
                        drain=drain, stop=lambda why: None, drain_timeout_s=self.settings.drain_timeout,
                        observe=self.metrics.observe_generation, entry=lambda: self.entry, choose_entry=no_entry,
                        open_stream=no_entry)

    def served(self) -> Served:
        from meshd.api.structured import chat_template

        a = self.artifact
        return Served(model=a.name if a else "", max_positions=a.config.max_positions if a else 0,
                      chat_template=chat_template(a), started_at=self.started_at, status=self.status,
                      state=lambda: "" if self.lifecycle.takes_new_work else str(self.lifecycle),
                      gaps=lambda: self.mesh.coverage.serving().gaps() if self.mesh else [])
