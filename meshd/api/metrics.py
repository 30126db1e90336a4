"""A daemon's Prometheus metrics: events counted as they happen, live state read at each scrape.

Rules: one registry per daemon (never the process-global one, so tests can run several); names
follow Prometheus conventions (`meshd_..._total`, `_seconds`, `_bytes`); gauges that mirror state
(sessions, KV, peers, coverage, traffic) are computed from the daemon's status when scraped, so they
cannot drift from what `meshctl status` shows. The metrics know the daemon only by the two callables
they read: its status and its work ledger's totals.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshd.api.recent import RecentGenerations
from meshd.entry.errors import ending
from meshd.p2p.channel import TRAFFIC
from meshd.wire import ErrorCode, StreamEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self, status: Callable[[], dict], ledger_totals: Callable[[], dict]) -> None:
        r = self.registry = CollectorRegistry()
        self.started = Counter("meshd_generations_started", "Generations asked of this daemon", registry=r)
        self.finished = Counter("meshd_generations_finished", "Generations that ended normally", registry=r)
        self.failed = Counter("meshd_generations_failed", "Generations that failed, by reason", ["reason"],
                              registry=r)
        self.tokens = Counter("meshd_tokens_generated", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("meshd_prompt_tokens", "Prompt tokens of the generations asked of this daemon",
                                     registry=r)
        self.cached_tokens = Counter("meshd_prompt_tokens_cached", "Of those, tokens not prefilled: every hop of the"
                                     " route held their KV already (prefix reuse)", registry=r)
        self.drafted = Counter("meshd_draft_tokens", "Draft tokens sent down a route (speculation)", registry=r)
        self.accepted = Counter("meshd_draft_accepted", "Draft tokens the tail accepted", registry=r)
        self.ttft = Histogram("meshd_time_to_first_token_seconds", "Time to the first streamed text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.token_latency = Histogram("meshd_token_latency_seconds", "Time between streamed tokens",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("meshd_compute_step_seconds", "Tensor work per step of this daemon's layers",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("meshd_batch_sessions", "Sessions sharing one forward pass of this daemon's layers",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.hop_failures = Counter("meshd_hop_failures", "Hops that failed under a generation", registry=r)
        self.reroutes = Counter("meshd_reroutes", "Generations moved to a new route", registry=r)
        self.rope_switches = Counter("meshd_rope_switches", "Generations of a longrope model (Phi-3) opened again"
                                     " on its long RoPE table as they grew past its switch", registry=r)
        self.recent = RecentGenerations()  # timings and routes of the last generations, for the dashboard
        r.register(_Live(status, ledger_totals))

    def drafts(self) -> dict:
        """Draft tokens sent and accepted in the generations asked of this daemon (status shows them)."""
        value = self.registry.get_sample_value
        return {"drafted": int(value("meshd_draft_tokens_total") or 0),
                "accepted": int(value("meshd_draft_accepted_total") or 0)}

    def observe_pass(self, seconds: float, sessions: int) -> None:
        self.step.observe(seconds)
        self.batch.observe(sessions)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def observe_generation(self, run, req, emit) -> dict:
        """Run `run(req, emit)` (one generation), counting it and timing its stream."""
        self.started.inc()
        t0, last, first, streamed = time.perf_counter(), None, None, 0

        async def timed(event: StreamEvent) -> None:
            nonlocal last, first, streamed
            if event.kind == "text":  # its text holds the tokens so far: those before it may have added none
                now, tokens = time.perf_counter(), event.stats.get("tokens", streamed + 1)
                if last is None:
                    self.ttft.observe(now - t0)
                else:  # k tokens came with this text: k gaps of a k-th of the wait each
                    k = max(1, tokens - streamed)
                    for _ in range(k):
                        self.token_latency.observe((now - last) / k)
                first, last, streamed = first or now - t0, now, tokens
            await emit(event)

        try:
            stats = await run(req, timed)
        except BaseException as exc:
            end = ending(exc)  # completed also when e.g. the HTTP API cut the answer at a stop sequence
            self.recent.record({"tokens": streamed}, end.reason, first, time.perf_counter() - t0)
            if end.outcome == "completed":
                self.finished.inc()
                raise
            self.failed.labels(end.reason).inc()
            if end.reason == ErrorCode.HOP_FAILED:
                self.hop_failures.inc()
            raise
        self.recent.record(stats, "ok", first, time.perf_counter() - t0)
        self.finished.inc()
        self.tokens.inc(stats.get("tokens", 0))
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.cached_tokens.inc(stats.get("cached_tokens", 0))
        self.drafted.inc(stats.get("drafted", 0))
        self.accepted.inc(stats.get("accepted", 0))
        self.reroutes.inc(stats.get("reroutes", 0))
        self.hop_failures.inc(stats.get("reroutes", 0))
        self.rope_switches.inc(1 if stats.get("rope_switched_at") else 0)  # 0: its prompt was past the switch
        return stats


class _Live:
    """Gauges read from the daemon's status and ledger at scrape time."""

    def __init__(self, status: Callable[[], dict], ledger_totals: Callable[[], dict]) -> None:
        self.status, self.ledger_totals = status, ledger_totals

    def collect(self):
        st = self.status()
        gauges = {"meshd_sessions_open": ("Sessions holding KV here", st["sessions"]),
                  "meshd_kv_bytes": ("Bytes of KV held", st["kv_bytes"]),
                  "meshd_weight_bytes": ("Bytes of weights held", st.get("weight_bytes", 0)),
                  "meshd_resident_bytes": ("Resident memory of the process", st.get("rss_bytes", 0)),
                  "meshd_peers_known": ("Live records of other daemons", len(st["peers"])),
                  "meshd_layers_uncovered": ("Layers no live daemon serves", sum(b - a for a, b in st["gaps"])),
                  "meshd_generations_active": ("Generations running now", st["generations"]),
                  "meshd_queue_frames": ("Forward frames waiting for a pass", st.get("queue", 0)),
                  "meshd_busy_refusals": ("Sessions and frames refused as busy, since start",
                                          st.get("busy_refusals", 0))}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        traffic = CounterMetricFamily("meshd_stream_bytes", "Bytes on meshd streams, by protocol and direction",
                                      labels=["protocol", "direction"])
        for (protocol, direction), n in sorted(TRAFFIC.items()):
            traffic.add_metric([protocol, direction], n)
        yield traffic
        refused = CounterMetricFamily("meshd_connections_refused_without_key", "Connections refused because the peer"
                                      " does not hold the private mesh's key, since start")
        refused.add_metric([], (st.get("mesh_key") or {}).get("refused", 0))
        yield refused
        yield from ledger_metrics(self.ledger_totals())
        yield from check_metrics(st.get("checks") or {})
        yield from prefix_metrics(st.get("prefix_cache") or {})
        yield from handover_metrics(st.get("handovers") or {})


def ledger_metrics(totals: dict):
    """The work ledger's totals (all it keeps) as counters."""
    work = CounterMetricFamily("meshd_ledger_layer_tokens", "Layer-tokens computed, per peer: for_us (the peer"
                               " for this daemon) or by_us (this daemon for the peer)", labels=["peer", "direction"])
    for peer, row in sorted(totals["peers"].items()):
        for direction in ("for_us", "by_us"):
            work.add_metric([peer, direction], row[direction])
    yield work
    for kind in ("generations", "sessions"):
        family = CounterMetricFamily(f"meshd_ledger_{kind}", f"{kind.capitalize()} in the work ledger, by outcome",
                                     labels=["outcome"])
        for outcome, n in sorted(totals[kind].items()):
            family.add_metric([outcome], n)
        yield family


def prefix_metrics(cache: dict):
    """The KV kept of ended sessions on this daemon's layers, and the sessions that started from it."""
    for name, key, doc in (("entries", "entries", "Ended sessions whose KV is kept for reuse"),
                           ("bytes", "held_bytes", "Bytes of kept KV (counted in meshd_kv_bytes too)"),
                           ("tokens", "held_tokens", "Token positions of kept KV")):
        yield GaugeMetricFamily(f"meshd_prefix_kept_{name}", doc, value=cache.get(key, 0))
    for name, doc in (("hits", "Sessions opened with kept KV of their prefix, since start"),
                      ("misses", "Sessions that asked for a kept prefix and found none, since start"),
                      ("tokens_reused", "Positions those hits did not compute, since start"),
                      ("evictions", "Kept entries dropped for room or idle past the TTL, since start")):
        family = CounterMetricFamily(f"meshd_prefix_{name}", doc)
        family.add_metric([], cache.get(name, 0))
        yield family


def handover_metrics(h: dict):
    """Hand-overs (meshd/hop/handover.py), as a hop and as an entry, since start."""
    for name, doc in (("sent", "Sessions whose KV this daemon handed to a replica when it left"),
                      ("received", "Hand-overs of another daemon's sessions this daemon took whole"),
                      ("failed", "Hand-overs that ended without the KV kept, either side"),
                      ("refused", "KV chunks refused: nobody asked this daemon to take them"),
                      ("positions", "KV positions handed over whole, sent or received"),
                      ("moved", "Routes this entry moved off a leaving hop with its KV"),
                      ("replayed", "Routes this entry moved off a leaving hop by replay (its hand-over failed)")):
        family = CounterMetricFamily(f"meshd_handover_{name}", doc + ", since start")
        family.add_metric([], h.get(name, 0))
        yield family


def check_metrics(checks: dict):
    """Checked generations and the peers excluded now (one series a peer, its reason as a label)."""
    for name, doc in (("checked", "Generations this entry ran on two routes, since start"),
                      ("disagreed", "Checked generations whose two routes disagreed, since start")):
        family = CounterMetricFamily(f"meshd_generations_{name}", doc)
        family.add_metric([], checks.get(name, 0))
        yield family
    excluded = GaugeMetricFamily("meshd_peer_excluded_seconds", "Seconds left of a peer's exclusion from this"
                                 " daemon's routes (it disagreed with two other routes)", labels=["peer", "reason"])
    for row in checks.get("excluded", []):
        excluded.add_metric([row["peer"], row["reason"]], row["left_s"])
    yield excluded
