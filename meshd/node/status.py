"""`meshctl status`'s answer: one dict of where a daemon stands, read off its parts (the lifecycle,
the loaded slot, the mesh view, the relays). Nothing here changes anything; the daemon hands in its
parts as they are at that moment (`Observed`: a part not there yet is None), never itself."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from meshd.p2p.host import dialable_addrs
from meshd.shard.footprint import owned_artifact_bytes, rss_bytes


@dataclass(frozen=True)
class Observed:
    """The parts a status is read from (meshd/node/daemon.py's, at the moment it is asked)."""

    lifecycle: Any  # meshd/node/lifecycle.py's Lifecycle
    settings: Any  # max_sessions, speculate, draft_max, verify_rate, verify_by, verify_window, verify_release
    started_at: float
    generations: int  # running or forwarded from here now (the control socket's count)
    throughput: float
    metrics: Any  # meshd/api/metrics.py's Metrics: recent generations, drafts
    compute: Any  # meshd/core/compute.py's ComputeExecutor
    handover_tally: Any  # meshd/hop/handover.py's Tally
    exclusions: Any  # meshd/entry/checks.py's Exclusions
    http_addrs: list[str]
    host: Any = None
    mesh: Any = None  # meshd/dht/view.py's MeshView
    slot: Any = None  # meshd/node/slot.py's Slot
    artifact: Any = None
    recipe: Any = None
    rebalancer: Any = None
    pnet: Any = None
    reach: Any = None
    relaying: Any = None
    punch: Any = None
    dialer: Any = None
    draft_model: Any = None


def daemon_status(d: Observed) -> dict:
    cov = d.mesh.coverage if d.mesh else None
    rec = d.mesh.record if d.mesh else None
    serving = cov.serving() if cov else None
    slot = d.slot
    service = slot.service if slot else None
    return {
        "peer_id": rec.peer_id if rec else None,
        "addrs": list(dialable_addrs(d.host)) if d.host else [],
        "state": str(d.lifecycle),
        "drain_reason": d.lifecycle.reason,
        "moved": d.rebalancer.summary() if d.rebalancer else "",
        "model": d.artifact.name if d.artifact else None,
        "model_fingerprint": d.artifact.fingerprint if d.artifact else None,
        "recipe": d.recipe.name if d.recipe else None,
        "range": [rec.start, rec.end] if rec and d.lifecycle.range_known else None,
        "n_layers": rec.n_layers if rec else None,
        "sessions": len(slot.shard.kv) if slot else 0,
        "kv_bytes": slot.shard.kv.live_bytes if slot else 0,  # open sessions' (kept KV: prefix_cache's held_bytes)
        "prefix_cache": slot.shard.kv.kept_summary() if slot else None,
        "generations": d.generations,
        "uptime_s": round(time.time() - d.started_at, 1),
        "throughput": round(d.throughput, 1),
        "load_s": round(slot.shard.load_seconds, 2) if slot else None,
        "weight_bytes": slot.shard.weight_bytes if slot else 0,
        "file_bytes": owned_artifact_bytes(d.artifact, slot.shard.start, slot.shard.end) if slot else 0,
        "rss_bytes": rss_bytes(),
        "http": d.http_addrs,
        "mesh_key": d.pnet.summary() if d.pnet else {"private": False},
        "reachability": d.reach.summary() if d.reach else None,
        "relay": {**(d.relaying.summary() if d.relaying else {"service": None, "client": None}),
                  "hole_punch": d.punch.summary() if d.punch else None,
                  "relayed_peers": d.dialer.relayed_peers() if d.dialer else []},
        "compute_s": round(service.stats.compute_s, 3) if service else 0.0,
        "steps": service.stats.steps if service else 0,
        "queue": service.scheduler.queued if service else 0,
        "forwarded_frames": service.forwarded if service else 0,
        "batches": service.scheduler.stats.as_dict() if service else {},
        "busy_refusals": service.endpoint.refused + service.scheduler.stats.refused if service else 0,
        "max_sessions": d.settings.max_sessions,
        "microbatches": slot.entry.microbatch_use.counts() if slot and slot.entry else [],
        "speculation": {"mode": d.settings.speculate, "draft_max": d.settings.draft_max,
                        "source": d.draft_model.describe() if d.draft_model is not None else "prompt lookup",
                        **d.metrics.drafts()},
        "checks": check_status(d),
        "handovers": handover_status(d),
        "compute_busy_s": round(d.compute.busy_s, 3),
        "recent_generations": d.metrics.recent.entries(),  # timings and routes, never text
        "peers": [{"peer_id": r.peer_id, "range": [r.start, r.end], "serving": r.serving,
                   "relay": r.relay, "relay_addrs": list(r.relay_addrs),
                   "addrs": list(r.addrs), "throughput": round(r.throughput, 1),
                   "rtt_ms": round(d.mesh.latency[r.peer_id] * 1000, 2) if r.peer_id in d.mesh.latency else None,
                   "expires_in_s": round(r.expires_at - time.time(), 1)}
                  for r in (cov.records if cov else ()) if r.peer_id != (rec.peer_id if rec else None)],
        "coverage": serving.counts() if serving else [],
        "gaps": [list(g) for g in serving.gaps()] if serving else [],
        "complete": serving.complete if serving else False,
    }


def check_status(d: Observed) -> dict:
    """Checked generations: the rate, how many ran and disagreed here, the peers excluded now and why."""
    entry = d.slot.entry if d.slot else None
    return {"verify_rate": d.settings.verify_rate, "verify_by": d.settings.verify_by,
            "verify_window": d.settings.verify_window, "verify_release": d.settings.verify_release,
            "checked": entry.checked if entry else 0,
            "disagreed": entry.disagreed if entry else 0, "excluded": d.exclusions.listing(time.monotonic())}


def handover_status(d: Observed) -> dict:
    """Hand-overs (meshd/hop/handover.py): as a hop, sessions' KV sent and received whole, failed, refused;
    as an entry, routes moved off a leaving hop with its KV, and those replayed because the hand-over failed."""
    entry = d.slot.entry if d.slot else None
    return {**d.handover_tally.summary(), "moved": entry.handovers if entry else 0,
            "replayed": entry.handover_fallbacks if entry else 0}
