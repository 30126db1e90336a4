"""A daemon's loaded range and everything that serves it: the shard, its tokenizer (at the head),
its hop service and, at the head, its entry. Loaded whole beside the current one (a move of layers
loads the next while the old one serves), then switched to in one assignment.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import trio

from meshd.entry.generation import Entry
from meshd.hop.endpoint import ShardEndpoint
from meshd.hop.scheduler import Scheduler
from meshd.hop.service import ShardService
from meshd.core.log import get_logger
from meshd.shard.footprint import check_fits, trim_heap
from meshd.shard.runtime import Shard

log = get_logger(__name__)


@dataclass
class Slot:
    shard: Shard
    tokenizer: object | None  # the head's only
    service: ShardService
    throughput: float  # layer-steps per second of a decode step, measured at load
    entry: Entry | None = None  # the head's only: generations start here


async def open_slot(start: int, end: int, *, artifact, recipe, recipe_fp: str, settings, compute, metrics, dial,
                    ledger=None, handovers=None) -> Slot:
    """Load layers [start, end) and what serves them (on the compute thread), without touching what
    the daemon serves now. `handovers`: the daemon's tally of hand-overs (meshd/hop/handover.py), all slots'."""
    check_fits(artifact, recipe, start, end, memory=settings.memory)

    def load():
        shard = Shard(artifact, start, end, recipe, kv_budget_bytes=settings.kv_budget, kv_ttl_s=settings.session_idle,
                      prefix_ttl_s=settings.prefix_ttl)
        tokenizer = None
        if shard.is_head or shard.is_tail:  # a tail samples under grammars, which are made of the tokenizer's tokens
            from meshd.shard.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(artifact)
        if not shard.is_head:
            artifact.forget_tokenizer()
        trim_heap()  # the tokenizer's conversion, or the dropped arrays, freed heap the shard's trim did not see
        return shard, tokenizer

    shard, tokenizer = await compute.run(load)
    endpoint = ShardEndpoint(shard, artifact.fingerprint, recipe_fp, max_sessions=settings.max_sessions,
                             idle_when_full=settings.session_idle_full)
    endpoint.ledger = ledger
    endpoint.tokenizer = tokenizer
    if handovers is not None:
        endpoint.incoming.tally = handovers
    service = ShardService(endpoint, compute, Scheduler(max_queued=settings.max_queue))
    service.stats.on_step = metrics.observe_pass
    service.outputs.dial = dial
    service.gather_s = settings.gather_ms / 1000
    throughput = await compute.run(measure_throughput, shard)
    return Slot(shard, tokenizer if shard.is_head else None, service, throughput)


def measure_throughput(shard: Shard) -> float:
    """Layer-steps per second of a decode step on this machine (advertised for routing)."""
    import torch

    key = ("throughput-probe", 0)
    shard.open_session(key, 16)
    x = torch.tensor([[1]]) if shard.is_head else torch.zeros(1, 1, shard.config.hidden)
    try:
        shard.forward(key, x, 0)
        t0 = time.perf_counter()
        for pos in range(1, 5):
            shard.forward(key, x, pos)
        per_step = (time.perf_counter() - t0) / 4
    finally:
        shard.release(key)
    return (shard.end - shard.start) / per_step


def forget_shard() -> None:
    """Give a dropped shard's memory back to the system (compute thread)."""
    gc.collect()
    trim_heap()


async def evict_loop(compute, slot_of, ledger, session_idle: float, period_s: float = 30.0) -> None:
    """Free the KV of sessions idle past their TTL (--session-idle), so a vanished entry, or one that
    keeps sessions with no use, cannot hold memory; roll the ledger's old rows up as it goes.
    `slot_of()` is the daemon's slot at that moment (a move replaces it)."""
    period_s = min(period_s, max(1.0, session_idle / 4))
    while True:
        await trio.sleep(period_s)
        evicted = await compute.run(slot_of().service.endpoint.evict_expired)
        if evicted:
            log.info("evicted idle sessions", count=len(evicted))
        await trio.to_thread.run_sync(ledger.roll_up)
