"""The meshd daemon: join the mesh, load a layer range, serve it, answer the local socket.

Rules: trio runs on a second thread with every background loop in the daemon's nursery; tensor
work (loading included) runs on the main thread through `ComputeExecutor`, so the host keeps
answering while weights load; SIGTERM and SIGINT withdraw the
record, close sessions and remove the socket before the process exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import trio
from libp2p.tools.anyio_service import background_trio_service

from meshd.api.http import HttpApi, check_bind, serve_http
from meshd.node.compute import ComputeExecutor
from meshd.api.control import ControlServer
from meshd.dht.coverage import choose_range
from meshd.dht.kad import MeshDHT
from meshd.dht.record import CoverageRecord, first_seq
from meshd.entry.generation import Entry
from meshd.wire.protocols import GEN_PROTOCOL, SHARD_PROTOCOL
from meshd.node.log import get_logger
from meshd.dht.view import MeshView
from meshd.api.metrics import Metrics
from meshd.p2p.dialer import Dialer
from meshd.p2p.host import dialable_addrs, load_or_create_identity, open_host
from meshd.dht.rebalancer import Rebalancer
from meshd.relay.circuit import HOP_PROTOCOL, STOP_PROTOCOL, RelayService, accept_circuit
from meshd.relay.client import RelayClient, relay_candidates
from meshd.relay.punch import HolePuncher
from meshd.relay.reachability import DIALBACK_PROTOCOL, Reachability
from meshd.hop.service import ShardService
from meshd.node.settings import Settings
from meshd.shard.artifact import open_artifact
from meshd.hop.endpoint import ShardEndpoint
from meshd.shard.footprint import check_fits, layer_bytes, rss_bytes, trim_heap, weight_bytes
from meshd.shard import blocks
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard
from meshd.hop.scheduler import Scheduler

DRAIN_POLL_S = 0.2
AUTO_SETTLE_S = 3.0  # how long a joining node watches the mesh before choosing its layers
log = get_logger(__name__)


class Daemon:
    def __init__(self, settings: Settings, compute: ComputeExecutor) -> None:
        self.settings = settings
        self.compute = compute
        self.stop_requested: trio.Event | None = None
        self.state = "starting"
        self.started_at = time.time()
        self.shard: Shard | None = None
        self.service: ShardService | None = None
        self.tokenizer = None
        self.entry: Entry | None = None
        self.host = self.mesh = self.reach = None
        self.relay: RelayService | None = None  # the relay this daemon offers (when public)
        self.relays: RelayClient | None = None  # the relays this daemon reserves at (when private)
        self.punch: HolePuncher | None = None  # upgrades relayed connections to direct ones (--hole-punch)
        self.active_generations = 0
        self.answering = 0  # forwarded requests whose answer is not yet out (a drain waits for them)
        self.throughput = 0.0  # layer-steps per second, measured once loaded
        self.artifact = self.recipe = None
        self.metrics = Metrics(self)
        self.http_addrs: list[str] = []
        self.dialer: Dialer | None = None  # every connection and stream to another peer
        self._drain_scope = trio.CancelScope()
        self.drain_reason = ""
        self.rebalancer: Rebalancer | None = None  # with --layers auto: moves to fill gaps

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.stop_requested = trio.Event()
        self.trio_token = trio.lowlevel.current_trio_token()
        s = self.settings
        self.artifact = await trio.to_thread.run_sync(open_artifact, s.model)
        self.recipe = get_recipe(s.recipe, self.artifact)
        await self.compute.run(blocks.divide_threads, s.threads or len(os.sched_getaffinity(0)), self.recipe)
        cfg = self.artifact.config
        self.recipe_fp = self.recipe.fingerprint(self.artifact.fingerprint, cfg.family, "artifact")
        fixed = s.parse_layers(cfg.n_layers)
        relay_only = fixed == (0, 0)  # --layers none: a bootstrap and relay that holds no layers
        if fixed is not None and not relay_only:  # refuse before joining: a range that cannot fit is an operator's error
            check_fits(self.artifact, self.recipe, *fixed, memory=s.memory)
        key_pair = load_or_create_identity(s.state_path)
        async with open_host(key_pair, s.listen) as host:
            self.host = host
            self.dialer = Dialer(host, latency=lambda: self.mesh.latency if self.mesh is not None else {},
                                 known=lambda: self.mesh.known if self.mesh is not None else {})
            dht = MeshDHT(host)
            self.punch = HolePuncher(host, busy_protocols=(SHARD_PROTOCOL, GEN_PROTOCOL)) if s.hole_punch else None
            async with (background_trio_service(dht),
                        background_trio_service(self.punch) if self.punch else nullcontext(),
                        trio.open_nursery() as nursery):
                self.nursery = nursery
                pid = host.get_id().to_base58()
                start, end = fixed or (0, 1)
                record = CoverageRecord(peer_id=pid, addrs=tuple(dialable_addrs(host)), model=self.artifact.fingerprint,
                                        recipe=self.recipe_fp, start=start, end=end, n_layers=cfg.n_layers,
                                        model_name=self.artifact.name, serving=False, seq=first_seq())
                self.mesh = MeshView(host, dht, key_pair, record, s.record_ttl, dial=self.dialer.ensure_connected)
                self.mesh.walker.dial = self.dialer.dial_known
                self.reach = Reachability(host, peers=self.dialer.mesh_peers)
                host.set_stream_handler(DIALBACK_PROTOCOL, self.reach.serve_stream)
                nursery.start_soon(self.reach.run)
                self._start_relaying(host, nursery)
                control = ControlServer(self, s.socket_path)
                await nursery.start(control.serve)
                if s.http:
                    app = HttpApi(self, control.generate, self.metrics, s.bearer_token())
                    self.http_addrs = await nursery.start(serve_http, app, check_bind(s.http))
                    log.info("http api up", addrs=self.http_addrs, token=bool(app.token))
                log.info("daemon up", peer_id=pid, addrs=dialable_addrs(host), socket=str(s.socket_path))
                if s.bootstrap:
                    reached = await self.mesh.connect_bootstrap(s.bootstrap)
                    if not reached:
                        log.error("no bootstrap peer reachable; serving alone until one dials in")
                if fixed is None:
                    self.state = "choosing layers"
                    start, end = await self._choose_auto(cfg)
                self.mesh.record = replace(self.mesh.record, start=start, end=end,
                                           auto_layers=self.rebalancer.want if self.rebalancer else 0)
                await self.mesh.publish(**self._relay_fields())
                if self.rebalancer:  # another daemon may have claimed the same layers at the same moment
                    start, end = await self.rebalancer.settle_claim()
                nursery.start_soon(self.mesh.publish_loop, self._live_fields)
                nursery.start_soon(self.mesh.coverage_loop)
                if not relay_only:
                    self.state = "loading"
                    await self._load(start, end)
                    nursery.start_soon(self._evict_loop)
                    if self.rebalancer:
                        nursery.start_soon(self.rebalancer.run)
                    host.set_stream_handler(SHARD_PROTOCOL, self._serve_shard_stream)
                    host.set_stream_handler(GEN_PROTOCOL, control.serve_remote_generate)
                    await self.mesh.publish(serving=True, **self._live_fields())
                self.state = "serving"
                log.info("serving", layers=f"{start}:{end}" if not relay_only else "none (relay and bootstrap only)",
                         load_s=round(self.shard.load_seconds, 2) if self.shard else 0.0,
                         throughput=round(self.throughput, 1))
                task_status.started()
                await self.stop_requested.wait()
                with self._drain_scope:  # a second stop request cancels the wait
                    await self.drain("stop", self.settings.drain_timeout)
                self.state = "stopping"
                log.info("stopping: withdrawing record")
                await self.mesh.withdraw()
                nursery.cancel_scope.cancel()

    def _start_relaying(self, host, nursery) -> None:
        """Offer a relay (`--relay`: auto while publicly reachable, on, off) and keep reservations at
        `--relays` relays while this daemon cannot be dialled itself."""
        s = self.settings
        self.relay = RelayService(host, s.relay_limits(), enabled=self._relay_on, own_addrs=lambda: self.mesh.record.addrs)
        if s.relay != "off":
            host.set_stream_handler(HOP_PROTOCOL, self.relay.serve_stream)
        self.relays = RelayClient(host, s.relays, connect=self.dialer.ensure_connected,
                                  candidates=lambda: relay_candidates(self.mesh.known.values(), self.mesh.latency,
                                                                      self.mesh.peer_id, time.time()),
                                  active=self._needs_relays, on_change=self._relays_changed)
        host.set_stream_handler(STOP_PROTOCOL, self._accept_relayed)
        nursery.start_soon(self.relays.run)

    def _relay_on(self) -> bool:
        mode = self.settings.relay
        return mode == "on" or (mode == "auto" and self.reach is not None and self.reach.summary()["status"] == "public")

    def _needs_relays(self) -> bool:
        return self.settings.relays > 0 and self.reach is not None and self.reach.summary()["status"] == "private"

    def _relay_fields(self) -> dict:
        return {"relay": self._relay_on(), "relay_addrs": self.relays.circuit_addrs() if self.relays else ()}

    async def _relays_changed(self) -> None:
        await self.mesh.publish(**self._live_fields())

    async def _accept_relayed(self, stream) -> None:
        await accept_circuit(self.host, stream, self.relays.allowed)

    async def _evict_loop(self, period_s: float = 30.0) -> None:
        """Free the KV of sessions idle past their TTL, so a vanished entry cannot hold memory."""
        while True:
            await trio.sleep(period_s)
            evicted = await self.compute.run(self.service.endpoint.evict_expired)
            if evicted:
                log.info("evicted idle sessions", count=len(evicted))

    async def drain(self, reason: str, timeout: float | None = None) -> None:
        """Leave the mesh gently: refuse new sessions from other daemons, withdraw the record (peers
        route around this daemon at once), and wait until no session is open here and no
        generation runs, for at most `timeout` seconds (None: as long as that takes). Sessions
        still open at the deadline end with the process, and their entries reroute them."""
        if self.service is None or self.state not in ("serving", "draining"):
            return
        if self.state == "serving":
            self.state = "draining"
            self.drain_reason = reason
            self.service.draining = True
            log.info("draining", reason=reason, sessions=len(self.shard.kv), generations=self.active_generations,
                     timeout_s=timeout)
            self.mesh.record = replace(self.mesh.record, leaving=True)  # rebalancing plans go without it
            await self.mesh.withdraw()
        t0 = time.monotonic()
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            while len(self.service.endpoint.sessions) or self.active_generations or self.answering:
                await trio.sleep(DRAIN_POLL_S)
        log.info("drained", left_sessions=len(self.service.endpoint.sessions), seconds=round(time.monotonic() - t0, 2))

    def request_stop(self, reason: str) -> None:
        """Thread-safe: ask the daemon to drain, withdraw its record and stop; asked again while
        it drains, it stops at once."""
        def stop() -> None:
            log.info("stop requested", reason=reason)
            if self.stop_requested is not None:
                if self.stop_requested.is_set():
                    self._drain_scope.cancel()
                self.stop_requested.set()

        try:
            self.trio_token.run_sync_soon(stop)
        except (AttributeError, trio.RunFinishedError):
            pass

    async def _choose_auto(self, cfg) -> tuple[int, int]:
        """Coverage first: watch the mesh briefly, then take the largest gap we can hold."""
        with trio.move_on_after(AUTO_SETTLE_S):
            for _ in range(3):
                await self.mesh.refresh()
                await trio.sleep(0.5)
        want = self.settings.layers_wanted(cfg.n_layers, self._layer_bytes())
        coverage = self.mesh.coverage.without(self.mesh.peer_id)
        self.rebalancer = Rebalancer(self, want)
        start, end = self._fit(*choose_range(coverage, want))
        log.info("layers chosen", start=start, end=end, gaps=coverage.gaps(), counts=coverage.counts())
        return start, end

    def _fit(self, start: int, end: int) -> tuple[int, int]:
        """The range cut to --memory: the head's embedding and the tail's LM head come on top of the layers."""
        if self.settings.memory:
            while end - start > 1 and weight_bytes(self.artifact, self.recipe, start, end) > self.settings.memory:
                end -= 1
        return start, end

    def _layer_bytes(self) -> int:
        """Resident bytes of the largest layer under this recipe (the lane's real layout, e.g. packed
        int4; a MoE layer's experts included, so a plain-MLP layer never sets the count)."""
        return max(layer_bytes(self.artifact, self.recipe, i) for i in range(self.artifact.config.n_layers))

    def _live_fields(self) -> dict:
        """Record fields that change while serving: throughput (measured on real decode steps once
        there are some), free session capacity and load (share of the KV budget in use)."""
        relay = self._relay_fields()
        if self.service is None or self.shard is None:
            return relay
        if self.service.decode_layer_rate:
            self.throughput = self.service.decode_layer_rate
        kv, ep = self.shard.kv, self.service.endpoint
        room = (kv.budget_bytes - sum(ep.promised.values())) // self._session_bytes()
        free = max(0, min(ep.max_sessions - len(ep.sessions), room))
        return {"throughput": self.throughput, "free_sessions": int(free),
                "load": round(kv.used_bytes / kv.budget_bytes, 4) if kv.budget_bytes else 0.0, **relay}

    def _session_bytes(self) -> int:
        return max(1, self.shard.kv.bytes_for(2048))

    async def _load(self, start: int, end: int) -> None:
        self._install(await self._open_shard(start, end))

    async def _open_shard(self, start: int, end: int) -> tuple:
        """Load a range and everything that serves it, without touching what this daemon serves now."""
        check_fits(self.artifact, self.recipe, start, end, memory=self.settings.memory)

        def load():
            shard = Shard(self.artifact, start, end, self.recipe, kv_budget_bytes=self.settings.kv_budget)
            tokenizer = None
            if shard.is_head:
                from meshd.shard.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self.artifact)
            else:
                self.artifact.forget_tokenizer()
            trim_heap()  # the tokenizer's conversion, or the dropped arrays, freed heap the shard's trim did not see
            return shard, tokenizer

        shard, tokenizer = await self.compute.run(load)
        endpoint = ShardEndpoint(shard, self.artifact.fingerprint, self.recipe_fp,
                                 max_sessions=self.settings.max_sessions)
        service = ShardService(endpoint, self.compute, Scheduler(max_queued=self.settings.max_queue))
        service.on_step = self.metrics.observe_pass
        service.dial = self.dialer.dial_shard
        service.gather_s = self.settings.gather_ms / 1000
        throughput = await self.compute.run(self._measure_throughput, shard)
        return shard, tokenizer, service, throughput

    def _install(self, loaded: tuple) -> None:
        """Serve a range loaded by `_open_shard`: new sessions and generations go to it from now on."""
        self.shard, self.tokenizer, self.service, self.throughput = loaded
        self.entry = (Entry(self, busy_wait_s=self.settings.busy_wait, forwarding=bool(self.settings.forwarding),
                            microbatches=self.settings.microbatches)
                      if self.shard.is_head else None)

    @staticmethod
    def _forget_shard() -> None:
        """Give a dropped shard's memory back to the system (compute thread)."""
        import gc

        gc.collect()
        trim_heap()

    def _measure_throughput(self, shard: Shard) -> float:
        """Layer-steps per second of a decode step on this machine (advertised for routing)."""
        import torch

        key = ("throughput-probe", 0)
        shard.open_session(key, 16)
        x = torch.tensor([[1]]) if shard.is_head else torch.zeros(1, 1, self.artifact.config.hidden)
        try:
            shard.forward(key, x, 0)
            t0 = time.perf_counter()
            for pos in range(1, 5):
                shard.forward(key, x, pos)
            per_step = (time.perf_counter() - t0) / 4
        finally:
            shard.release(key)
        return (shard.end - shard.start) / per_step

    async def _serve_shard_stream(self, stream) -> None:
        try:
            self.dialer.protect(stream.muxed_conn.peer_id)  # the peer sends sessions our way: keep its connection
        except AttributeError:
            pass
        await self.service.serve_stream(stream)

    def find_entry(self, exclude=()) -> CoverageRecord | None:
        """A live serving peer that holds layer 0 (for forwarding a request), not one in `exclude`."""
        for r in self.mesh.coverage.serving().records:
            if r.start == 0 and r.peer_id != self.mesh.peer_id and r.peer_id not in exclude:
                return r
        return None

    def status(self) -> dict:
        cov = self.mesh.coverage if self.mesh else None
        rec = self.mesh.record if self.mesh else None
        serving = cov.serving() if cov else None
        return {
            "peer_id": rec.peer_id if rec else None,
            "addrs": list(dialable_addrs(self.host)) if self.host else [],
            "state": self.state,
            "drain_reason": self.drain_reason,
            "moved": self.rebalancer.summary() if self.rebalancer else "",
            "model": self.artifact.name if self.artifact else None,
            "model_fingerprint": self.artifact.fingerprint if self.artifact else None,
            "recipe": self.recipe.name if self.recipe else None,
            "range": [rec.start, rec.end] if rec and self.state != "choosing layers" else None,
            "n_layers": rec.n_layers if rec else None,
            "sessions": len(self.shard.kv) if self.shard else 0,
            "kv_bytes": self.shard.kv.used_bytes if self.shard else 0,
            "generations": self.active_generations,
            "uptime_s": round(time.time() - self.started_at, 1),
            "throughput": round(self.throughput, 1),
            "load_s": round(self.shard.load_seconds, 2) if self.shard else None,
            "weight_bytes": self.shard.weight_bytes if self.shard else 0,
            "rss_bytes": rss_bytes(),
            "http": self.http_addrs,
            "reachability": self.reach.summary() if self.reach else None,
            "relay": {"service": self.relay.summary() if self.relay and self.settings.relay != "off" else None,
                      "client": self.relays.summary() if self.relays else None,
                      "hole_punch": self.punch.summary() if self.punch else None,
                      "relayed_peers": self.dialer.relayed_peers() if self.dialer else []},
            "compute_s": round(self.service.compute_s, 3) if self.service else 0.0,
            "steps": self.service.steps if self.service else 0,
            "queue": self.service.scheduler.queued if self.service else 0,
            "forwarded_frames": self.service.forwarded if self.service else 0,
            "batches": self.service.scheduler.stats.as_dict() if self.service else {},
            "busy_refusals": (self.service.endpoint.refused + self.service.scheduler.stats.refused
                              if self.service else 0),
            "max_sessions": self.settings.max_sessions,
            "microbatches": self.entry.microbatch_use.counts() if self.entry else [],
            "compute_busy_s": round(self.compute.busy_s, 3),
            "peers": [{"peer_id": r.peer_id, "range": [r.start, r.end], "serving": r.serving,
                       "relay": r.relay, "relay_addrs": list(r.relay_addrs),
                       "addrs": list(r.addrs), "throughput": round(r.throughput, 1),
                       "rtt_ms": round(self.mesh.latency[r.peer_id] * 1000, 2) if r.peer_id in self.mesh.latency
                       else None,
                       "expires_in_s": round(r.expires_at - time.time(), 1)}
                      for r in (cov.records if cov else ()) if r.peer_id != (rec.peer_id if rec else None)],
            "coverage": serving.counts() if serving else [],
            "gaps": [list(g) for g in serving.gaps()] if serving else [],
            "complete": serving.complete if serving else False,
        }


def run_daemon(settings: Settings) -> int:
    """Run a daemon: trio in a second thread, tensor work on this (the main) thread.

    SIGTERM and SIGINT stop it cleanly; a stop requested before the mesh is joined (while the
    event loop cannot take it yet) ends the process at once.
    """
    Path(settings.state_path).mkdir(parents=True, exist_ok=True)
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
        if daemon.stop_requested is None or daemon.state in ("starting",):
            raise KeyboardInterrupt
        daemon.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop = threading.Thread(target=event_loop, name="meshd-events", daemon=True)
    loop.start()
    try:
        compute.serve()
    except KeyboardInterrupt:
        daemon.request_stop("interrupt")
        loop.join(timeout=10)
        return 130 if not failure else 1
    loop.join()
    if failure:
        exc = failure[0]
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # a nursery's wrapper around the one real failure
        raise exc
    return 0
