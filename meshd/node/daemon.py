"""The meshd daemon: join the mesh, load a layer range, serve it, answer the local socket.

Rules: `Daemon` wires the parts together and keeps none of their logic: the lifecycle is
`meshd/node/lifecycle.py`'s table, the loaded range is one `Slot` (meshd/node/slot.py), placement
is `meshd/dht/placement.py`, status is `meshd/node/status.py`. Each part is handed the few things it
uses (`Controls`, `Served`, the metrics' two readings, `Observed`), never the daemon, and keeps the
counts it changes; a daemon leaving and a range left by a move go through the one drain (`_let_go`).
trio runs on a second thread with
every background loop in the daemon's nursery; tensor work (loading included) runs on the main
thread through `ComputeExecutor`, so the host keeps answering while weights load; SIGTERM and
SIGINT withdraw the record, close sessions and remove the socket before the process exits.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import trio
from libp2p.tools.anyio_service import background_trio_service

from meshd.api.control import ControlServer, Controls
from meshd.api.http import HttpApi, Served, check_bind, serve_http
from meshd.api.metrics import Metrics
from meshd.api.structured import chat_template
from meshd.dht.kad import MeshDHT
from meshd.dht.placement import fit_range, largest_layer_bytes
from meshd.dht.rebalancer import Rebalancer, choose_first_range
from meshd.dht.record import CoverageRecord, first_seq
from meshd.dht.view import MeshView
from meshd.entry.generation import Entry
from meshd.entry.policy import choose_entry
from meshd.hop.handover import Tally
from meshd.hop.stream import serve_shard_stream
from meshd.core.compute import ComputeExecutor
from meshd.entry.checks import Exclusions
from meshd.node.ledger import Ledger
from meshd.node.lifecycle import Lifecycle, State, StopRequest
from meshd.core.log import get_logger
from meshd.node.model import open_draft, open_model
from meshd.node.relaying import Relaying
from meshd.core.settings import Settings
from meshd.node import wiring
from meshd.node.slot import Slot, evict_loop, forget_shard, open_slot
from meshd.node.status import Observed, daemon_status
from meshd.p2p.dialer import Dialer
from meshd.p2p.host import dialable_addrs, load_or_create_identity, open_host
from meshd.p2p.pnet import Pnet
from meshd.relay.circuit import dial_circuit
from meshd.relay.punch import HolePuncher
from meshd.relay.reachability import DIALBACK_PROTOCOL, Reachability
from meshd.shard.footprint import pin_heap_thresholds
from meshd.wire.protocols import GEN_PROTOCOL, SHARD_PROTOCOL

DRAIN_POLL_S = 0.2
log = get_logger(__name__)


class Daemon:
    """One meshd node: wires its host, mesh view, slot, APIs and lifecycle; the parts hold the logic."""

    def __init__(self, settings: Settings, compute: ComputeExecutor) -> None:
        self.settings, self.compute = settings, compute
        key = wiring.mesh_key(settings)  # refused here, before anything starts, when it is unusable
        self.pnet = Pnet(key) if key else None  # a private mesh: its key and the connections refused
        self.lifecycle = Lifecycle()
        self.stopping = StopRequest()
        self.started_at = time.time()
        self.slot: Slot | None = None  # the range this daemon serves, and what serves it
        self.host = self.mesh = self.reach = None
        self.relaying: Relaying | None = None  # the relay it offers, the reservations it keeps
        self.punch: HolePuncher | None = None  # upgrades relayed connections to direct ones (--hole-punch)
        self.control: ControlServer | None = None  # the local socket; counts the generations running here
        self.artifact = self.recipe = None
        self.metrics = Metrics(self.status, lambda: self.ledger.totals())
        self.http_addrs: list[str] = []
        self.dialer: Dialer | None = None  # every connection and stream to another peer
        self.ledger = Ledger(None)  # the work ledger (opened in run; this one keeps nothing)
        self.rebalancer: Rebalancer | None = None  # with --layers auto: moves to fill gaps
        self.intake = wiring.intake(settings)  # what other daemons' shard streams may take here, all slots together
        self.exclusions = Exclusions()  # peers kept off this daemon's routes after a check (meshd/entry/checks.py)
        self.draft_model = None  # --draft: proposes its entries' drafts (meshd/entry/draftmodel.py)
        self.nursery: trio.Nursery | None = None  # the serving nursery: hand-overs run in it
        self.handover_tally = Tally()  # hand-overs as a hop, all its slots together (meshd/hop/handover.py)

    @property
    def entry(self) -> Entry | None:
        """Where this daemon's generations start (None: it holds no layer 0)."""
        return self.slot.entry if self.slot else None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the model, come up on the network, join the mesh, serve a range until asked to stop, leave."""
        self.stopping.arm()
        s = self.settings
        self.artifact, self.recipe, self.recipe_fp, fixed = await open_model(s, self.compute)
        s.speculate_on, wiring.verify_share(s), wiring.checking(s)  # noqa: B018 -- a bad --speculate, --draft-max,
        # --verify-rate or --verify-by/-window/-release: refused
        self.draft_model = await open_draft(s, self.artifact, self.compute, fixed)
        key_pair = load_or_create_identity(s.state_path)
        self.ledger = await trio.to_thread.run_sync(Ledger, s.ledger_path, s.ledger_days)
        async with open_host(key_pair, s.listen, self.pnet) as host:
            self.host = host
            self.dialer = Dialer(host, dial_circuit,
                                 latency=lambda: self.mesh.latency if self.mesh is not None else {},
                                 known=lambda: self.mesh.known if self.mesh is not None else {},
                                 encoding=s.wire_encoding)
            dht = MeshDHT(host)
            self.punch = HolePuncher(host, busy_protocols=(SHARD_PROTOCOL, GEN_PROTOCOL)) if s.hole_punch else None
            async with (background_trio_service(dht),
                        background_trio_service(self.punch) if self.punch else nullcontext(),
                        trio.open_nursery() as nursery):
                control = await self._come_up(dht, key_pair, fixed, nursery)
                start, end = await self._join(fixed, nursery)
                if fixed != (0, 0):  # --layers none: a bootstrap and relay that holds no layers
                    await self._serve(start, end, control, nursery)
                self.lifecycle.to(State.SERVING)
                log.info("serving", layers=f"{start}:{end}" if self.slot else "none (relay and bootstrap only)",
                         load_s=round(self.slot.shard.load_seconds, 2) if self.slot else 0.0,
                         throughput=round(self.throughput, 1))
                task_status.started()
                await self.stopping.event.wait()
                with self.stopping.drain_scope:  # a second stop request cancels the wait
                    await self.drain("stop", self.settings.drain_timeout)
                self.lifecycle.to(State.STOPPING)
                if self.mesh.record.serving:  # a drain withdrew it already: peers were told once
                    log.info("stopping: withdrawing record")
                    await self.mesh.withdraw()
                log.info("stopping")
                nursery.cancel_scope.cancel()

    async def _come_up(self, dht, key_pair, fixed, nursery) -> ControlServer:
        """The mesh view (with a record not yet published), reachability, relays and the local APIs."""
        s, host, cfg = self.settings, self.host, self.artifact.config
        pid = host.get_id().to_base58()
        start, end = fixed or (0, 1)
        record = CoverageRecord(peer_id=pid, addrs=tuple(dialable_addrs(host)), model=self.artifact.fingerprint,
                                recipe=self.recipe_fp, start=start, end=end, n_layers=cfg.n_layers,
                                model_name=self.artifact.name, serving=False, seq=first_seq())
        self.mesh = MeshView(host, dht, key_pair, record, s.record_ttl, dial=self.dialer.ensure_connected)
        self.mesh.walker.client.dial = self.dialer.dial_known
        self.reach = Reachability(host, peers=self.dialer.mesh_peers, pnet=self.pnet)
        host.set_stream_handler(DIALBACK_PROTOCOL, self.reach.serve_stream)
        nursery.start_soon(self.reach.run)
        self.relaying = Relaying(s, host, self.reach, self.mesh, self.dialer, on_change=lambda: self.mesh.publish(**self.live_fields()))
        self.relaying.start(nursery)
        control = self.control = ControlServer(self._controls(), s.socket_path)
        await nursery.start(control.serve)
        if s.http:
            app = HttpApi(self._served(), control.generate, self.metrics, s.bearer_token())
            self.http_addrs = await nursery.start(serve_http, app, check_bind(s.http))
            log.info("http api up", addrs=self.http_addrs, token=bool(app.token))
        log.info("daemon up", peer_id=pid, addrs=dialable_addrs(host), socket=str(s.socket_path),
                 mesh=f"private, key {self.pnet.fingerprint}" if self.pnet else "open")
        return control

    async def _join(self, fixed, nursery) -> tuple[int, int]:
        """Reach the bootstrap peers, choose a range (the operator's, or with --layers auto the one
        the mesh lacks most), publish the record and keep it published. The range."""
        s = self.settings
        if s.bootstrap and not await self.mesh.connect_bootstrap(s.bootstrap):
            log.error("no bootstrap peer reachable; serving alone until one dials in")
        start, end = self.mesh.record.start, self.mesh.record.end  # the fixed range, or the placeholder
        if fixed is None:
            self.lifecycle.to(State.CHOOSING)
            self.rebalancer = Rebalancer(self, s.layers_wanted(self.artifact.config.n_layers,
                                                               largest_layer_bytes(self.artifact, self.recipe)))
            start, end = await choose_first_range(self.mesh, self.rebalancer.want, self.artifact, self.recipe, s.memory)
        self.mesh.record = replace(self.mesh.record, start=start, end=end,
                                   auto_layers=self.rebalancer.want if self.rebalancer else 0)
        await self.mesh.publish(**self.relaying.record_fields())
        if self.rebalancer:  # another daemon may have claimed the same layers at the same moment
            start, end = await self.rebalancer.settle_claim()
        nursery.start_soon(self.mesh.publish_loop, self.live_fields)
        nursery.start_soon(self.mesh.coverage_loop)
        return start, end

    async def _serve(self, start: int, end: int, control: ControlServer, nursery) -> None:
        """Load the range, take other daemons' sessions and generations, and say so in the record."""
        self.lifecycle.to(State.LOADING)
        self.nursery = nursery  # where the services it loads send hand-overs from
        self.switch_to(await self.open_range(start, end))
        nursery.start_soon(evict_loop, self.compute, lambda: self.slot, self.ledger,
                           min(self.settings.session_idle, self.settings.prefix_ttl or math.inf))
        nursery.start_soon(self.intake.trim_loop)
        if self.rebalancer:
            nursery.start_soon(self.rebalancer.run)
        self.host.set_stream_handler(SHARD_PROTOCOL, self._serve_shard_stream)
        self.host.set_stream_handler(GEN_PROTOCOL, control.serve_remote_generate)
        await self.mesh.publish(serving=True, **self.live_fields())

    def _controls(self) -> Controls:
        """What the control socket asks of this daemon."""
        return Controls(stage=self.lifecycle, status=self.status, ledger_totals=lambda *a: self.ledger.totals(*a),
                        drain=self.drain, stop=self.stopping.request, drain_timeout_s=self.settings.drain_timeout,
                        observe=self.metrics.observe_generation, entry=lambda: self.entry,
                        choose_entry=self.choose_entry, open_stream=self.dialer.open_stream)

    def _served(self) -> Served:
        """What the HTTP API asks of this daemon."""
        return Served(model=self.artifact.name, max_positions=self.artifact.config.max_positions,
                      chat_template=chat_template(self.artifact), started_at=self.started_at, status=self.status,
                      state=lambda: "" if self.lifecycle.takes_new_work else str(self.lifecycle),
                      gaps=lambda: self.mesh.coverage.serving().gaps() if self.mesh else [])

    async def drain(self, reason: str, timeout: float | None = None) -> None:
        """Leave the mesh gently: refuse new sessions from other daemons, withdraw the record (peers
        route around this daemon at once), and wait until no session is open here and no
        generation runs, for at most `timeout` seconds (None: as long as that takes). The entries of
        the sessions here are told first, and move them to a replica with their KV where one serves
        the layers (meshd/hop/handover.py). Sessions still open at the deadline end with the process,
        and their entries reroute them."""
        if self.slot is None or not self.lifecycle.accepts_generations:
            return
        if self.lifecycle.to(State.DRAINING, reason):
            log.info("draining", reason=reason, sessions=len(self.slot.shard.kv), generations=self.control.generations,
                     timeout_s=timeout)
            self.mesh.record = replace(self.mesh.record, leaving=True)  # rebalancing plans go without it
            # the entries of the sessions crossing this daemon may move them to a replica at once, their KV
            # handed over (meshd/hop/handover.py); the others finish here, or replay when it leaves. Told
            # first: withdrawing the record may wait on slow peers
            await self._retire(self.slot)
            log.info("withdrawing record")
            await self.mesh.withdraw()
        t0 = time.monotonic()
        left = await self._let_go(self.slot, timeout, until_idle=True)
        log.info("drained", left_sessions=left, seconds=round(time.monotonic() - t0, 2))

    async def move_to(self, slot: Slot) -> None:
        """A rebalancing move's switch (meshd/dht/rebalancer.py): serve `slot`, loaded by `open_range`, instead
        of the range served now, and announce it; the daemon is moving until the old range has gone through
        the one drain (its sessions handed over to a replica, or finished, for at most --drain-timeout
        seconds) and its memory is free, which runs on in the daemon's nursery."""
        if not self.lifecycle.to(State.MOVING):
            raise RuntimeError(f"a daemon that is {self.lifecycle} does not move")
        old = self.switch_to(slot)
        await self._retire(old)
        await self.mesh.publish(start=slot.shard.start, end=slot.shard.end, serving=True, auto_layers=0,
                                **self.live_fields())
        self.nursery.start_soon(self._moved_off, old)

    async def _moved_off(self, old: Slot) -> None:
        """The rest of a move: the old range drained and freed, then serving again."""
        layers, t0 = f"{old.shard.start}:{old.shard.end}", time.monotonic()
        try:
            left = await self._let_go(old, self.settings.drain_timeout)
            log.info("old range freed", layers=layers, left_sessions=left, seconds=round(time.monotonic() - t0, 2))
        finally:
            if self.lifecycle.state == State.MOVING:  # a stop asked meanwhile has moved it on already
                self.lifecycle.to(State.SERVING)
        del old
        await self.forget()

    @staticmethod
    async def _retire(slot: Slot) -> None:
        """The slot's service takes no new sessions, and tells the entries of those open that it leaves."""
        told = await slot.service.retire()
        if told:
            log.info("told the entries of sessions here that it leaves", sessions=told,
                     layers=f"{slot.shard.start}:{slot.shard.end}")

    async def _let_go(self, slot: Slot, timeout: float | None, until_idle: bool = False) -> int:
        """The one drain: wait until no session is open on `slot` (and with `until_idle`, no generation runs
        here and every forwarded answer is out), for at most `timeout` seconds (None: as long as that
        takes). The sessions still open then."""
        sessions = slot.service.endpoint.sessions
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            while len(sessions) or (until_idle and not self.control.idle):
                await trio.sleep(DRAIN_POLL_S)
        return len(sessions)

    # what the rebalancer asks of its daemon (meshd/dht/rebalancer.py, `Placed`)

    def fit(self, start: int, end: int) -> tuple[int, int]:
        """The range cut to --memory: the head's embedding and the tail's LM head come on top of the layers."""
        return fit_range(self.artifact, self.recipe, start, end, self.settings.memory)

    @property
    def throughput(self) -> float:
        """Layer-steps per second: measured on real decode steps once there are some, else at load."""
        if self.slot is None:
            return 0.0
        return self.slot.service.stats.decode_layer_rate or self.slot.throughput

    def live_fields(self) -> dict:
        """Record fields that change while serving: throughput, free session capacity and load (share
        of the KV budget in use), and the relay this daemon offers or goes through."""
        relay = self.relaying.record_fields()
        if self.slot is None:
            return relay
        kv = self.slot.shard.kv  # its load is open sessions' KV: kept KV gives way to any session (room, not load)
        return {"throughput": self.throughput, "free_sessions": self.slot.service.endpoint.free_sessions(),
                "load": round(kv.live_bytes / kv.budget_bytes, 4) if kv.budget_bytes else 0.0, **relay}

    async def open_range(self, start: int, end: int) -> Slot:
        """Load a range and everything that serves it, without touching what this daemon serves now."""
        return await open_slot(start, end, artifact=self.artifact, recipe=self.recipe, recipe_fp=self.recipe_fp,
                               settings=self.settings, compute=self.compute, metrics=self.metrics,
                               dial=self.dialer.dial_shard, ledger=self.ledger, handovers=self.handover_tally)

    def switch_to(self, slot: Slot) -> Slot | None:
        """Serve a range loaded by `open_range`: new sessions and generations go to it from now on
        (those begun before keep the slot they began on). Returns the slot it replaces."""
        s = self.settings
        if slot.shard.is_head:
            slot.entry = Entry(slot.service, slot.tokenizer, self.artifact.config, self.artifact.fingerprint,
                               self.recipe_fp, self.mesh, self.dialer.open_stream, end=slot.shard.end,
                               busy_wait_s=s.busy_wait, forwarding=bool(s.forwarding), microbatches=s.microbatches,
                               speculate=s.speculate_on, draft_max=s.draft_max, draft_model=self.draft_model,
                               ledger=self.ledger,
                               verify_rate=wiring.verify_share(s), exclusions=self.exclusions,
                               prefix_ttl_s=s.prefix_ttl, chunk_tokens=wiring.chunk_size(s),
                               encoding=wiring.wire_encoding(s), checking=wiring.checking(s))
        slot.service.nursery = self.nursery
        old, self.slot = self.slot, slot
        return old

    async def forget(self) -> None:
        """Give the memory of a replaced slot back, once the caller has let go of it."""
        await self.compute.run(forget_shard)

    async def _serve_shard_stream(self, stream) -> None:
        try:
            self.dialer.protect(stream.muxed_conn.peer_id)  # the peer sends sessions our way: keep its connection
        except AttributeError:
            pass
        await serve_shard_stream(self.slot.service, stream, self.intake)

    def choose_entry(self, tried=()) -> CoverageRecord | None:
        """The entry a request this daemon cannot run is handed to (see `meshd/entry/policy.py`)."""
        return choose_entry(self.mesh.coverage.serving().records, dict(self.mesh.latency), self.mesh.peer_id, tried)

    def status(self) -> dict:
        return daemon_status(Observed(
            lifecycle=self.lifecycle, settings=self.settings, started_at=self.started_at,
            generations=self.control.generations if self.control else 0, throughput=self.throughput,
            metrics=self.metrics, compute=self.compute, handover_tally=self.handover_tally,
            exclusions=self.exclusions, http_addrs=self.http_addrs, host=self.host, mesh=self.mesh, slot=self.slot,
            artifact=self.artifact, recipe=self.recipe, rebalancer=self.rebalancer, pnet=self.pnet,
            reach=self.reach, relaying=self.relaying, punch=self.punch, dialer=self.dialer,
            draft_model=self.draft_model))


def run_daemon(settings: Settings) -> int:
    """Run a daemon: trio in a second thread, tensor work on this (the main) thread.

    SIGTERM and SIGINT stop it cleanly; a stop requested before the mesh is joined (while the
    event loop cannot take it yet) ends the process at once.
    """
    pin_heap_thresholds()  # before anything large is freed: what a burst of frames leaves goes back
    Path(settings.state_path).mkdir(parents=True, exist_ok=True)
    wiring.configure(settings)
    compute = ComputeExecutor()
    daemon = Daemon(settings, compute)
    failure: list[BaseException] = []

    def event_loop() -> None:
        try:
            trio.run(daemon.run)
        except BaseException as exc:  # reported from the main thread below
            failure.append(exc)
        finally:
            compute.stop()

    def on_signal(signum, frame) -> None:
        if not daemon.stopping.armed or daemon.lifecycle.stops_at_once:
            raise KeyboardInterrupt
        daemon.stopping.request(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop = threading.Thread(target=event_loop, name="meshd-events", daemon=True)
    loop.start()
    try:
        compute.serve()
    except KeyboardInterrupt:
        daemon.stopping.request("interrupt")
        loop.join(timeout=10)
        return 130 if not failure else 1
    loop.join()
    if failure:
        exc = failure[0]
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # a nursery's wrapper around the one real failure
        raise exc
    return 0
