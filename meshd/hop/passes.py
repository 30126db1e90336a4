"""What a hop's passes did, and where their outputs go next: pure bookkeeping over a finished pass.

`PassStats` keeps the numbers status, metrics, routing and busy replies read (compute seconds, the
moving averages of a pass and of decode layer-steps per second). `route_outputs` hands a finished
pass's hidden states to the links of their next hops and stamps each entry's tokens with how many
of the pass's tokens go to that entry (see `meshd/hop/due.py`); `local_tokens` names the sessions
whose tokens go to an entry in this daemon, whose next steps the next pass waits for the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from meshd.hop.links import NextHop
from meshd.wire import Forward, Token


@dataclass
class PassStats:
    layers: int  # layers of the range the passes run
    compute_s: float = 0.0  # time spent in tensor work, for status and benchmarks
    steps: int = 0  # passes run
    pass_s: float | None = None  # moving average of a pass's seconds (the retry hint of a busy reply)
    decode_layer_rate: float | None = None  # moving average of layer-steps/s on passes of decode steps only
    on_step: Callable[[float, int], None] | None = None  # each pass's seconds and size (metrics)

    def account(self, took: float, batch: list) -> None:
        self.compute_s += took
        self.steps += 1
        self.pass_s = took if self.pass_s is None else 0.9 * self.pass_s + 0.1 * took
        if self.on_step is not None:
            self.on_step(took, len(batch))
        if took > 0 and all(w.decode for w in batch):
            rate = self.layers / took
            old = self.decode_layer_rate
            self.decode_layer_rate = rate if old is None else 0.9 * old + 0.1 * rate

    def retry_hint(self, queued: int, max_batch: int) -> float:
        """Seconds after which a refused client may try again: about the time to drain the queue."""
        per_pass = self.pass_s or 0.05
        return round(min(5.0, max(0.1, per_pass * queued / max(1, max_batch))), 2)


def route_outputs(done: list, links_of, pass_id: int) -> tuple[set[NextHop], int]:
    """Queue the pass's hidden states for the next hops, in pass order (a link sends them as one
    frame), taking them out of the pieces' outputs, and tell each entry how many of this pass's
    tokens go to it. `links_of(key)` is a session's `Links` (or None). Returns the links that got
    frames and how many."""
    hops: set[NextHop] = set()
    forwarded = 0
    homes: dict[str, list] = {}
    for w in done:
        links = links_of((w.payload.session_id, w.payload.epoch))
        if links is None or not w.output:
            continue
        if links.next is not None and isinstance(w.output[0], Forward):
            links.next.put(w.output[0])
            hops.add(links.next)
            forwarded += 1
            w.output = w.output[1:]
        elif isinstance(w.output[0], Token):
            homes.setdefault(links.home.peer, []).append(w)
    for group in homes.values():
        for w in group:
            w.output = [replace(w.output[0], pass_id=pass_id, pass_size=len(group)), *w.output[1:]]
    return hops, forwarded


def local_tokens(done: list, links_of) -> list:
    """The sessions of a pass whose Token goes to an entry in this daemon (no links: the entry called
    the service itself). Each asks for its next step at once, so the next pass waits for all of them
    (`ShardService.expect`) instead of starting with whichever comes back first."""
    keys = []
    for w in done:
        key = (w.payload.session_id, w.payload.epoch)
        if w.output and isinstance(w.output[0], Token) and links_of(key) is None:
            keys.append(key)
    return keys
