"""`meshctl status`'s answer: one dict of where a daemon stands, read off its parts (the lifecycle,
the loaded slot, the mesh view, the relays). Nothing here changes anything."""

from __future__ import annotations

import time

from meshd.p2p.host import dialable_addrs
from meshd.shard.footprint import owned_artifact_bytes, rss_bytes


def daemon_status(d) -> dict:
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
        "generations": d.active_generations,
        "uptime_s": round(time.time() - d.started_at, 1),
        "throughput": round(d.throughput, 1),
        "load_s": round(slot.shard.load_seconds, 2) if slot else None,
        "weight_bytes": slot.shard.weight_bytes if slot else 0,
        "file_bytes": owned_artifact_bytes(d.artifact, slot.shard.start, slot.shard.end) if slot else 0,
        "rss_bytes": rss_bytes(),
        "http": d.http_addrs,
        "mesh_key": d.pnet.summary() if getattr(d, "pnet", None) else {"private": False},
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


def check_status(d) -> dict:
    """Checked generations: the rate, how many ran and disagreed here, the peers excluded now and why."""
    entry = d.slot.entry if d.slot else None
    exclusions = getattr(d, "exclusions", None)
    return {"verify_rate": d.settings.verify_rate, "checked": entry.checked if entry else 0,
            "disagreed": entry.disagreed if entry else 0,
            "excluded": exclusions.listing(time.monotonic()) if exclusions is not None else []}


def handover_status(d) -> dict:
    """Hand-overs (meshd/hop/handover.py): as a hop, sessions' KV sent and received whole, failed, refused;
    as an entry, routes moved off a leaving hop with its KV, and those replayed because the hand-over failed."""
    entry = d.slot.entry if d.slot else None
    return {**d.handover_tally.summary(), "moved": entry.handovers if entry else 0,
            "replayed": entry.handover_fallbacks if entry else 0}
