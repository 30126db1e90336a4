"""The whole model in one process, split into shards that talk through wire frames (`meshd local`).

Rule: every hop goes through `meshd.wire` bytes exactly as it would over a stream, so a split run
here exercises the same codec and endpoint code as the mesh; the generation's limits, stop tokens,
RoPE table (a longrope model's long one past its switch: the sessions open again and compute the
sequence anew, as the mesh's entry does), decode rule (`Generation.take`), stages and stats are the
entry's own (`meshd/entry/state.py`, `meshd/entry/stages.py`).
"""

from __future__ import annotations

import os
from typing import Iterator

from meshd.entry.stages import Event
from meshd.entry.state import Generation, open_session
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.core.log import get_logger
from meshd.shard import rope
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import Recipe, get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.sampler import SamplingParams
from meshd.wire import (DEFAULT_CHUNK_TOKENS, DEFAULT_ENCODING, Close, Decoder, Error, Message, Opened, Phase, Token,
                        chunk_spans, encode)

log = get_logger(__name__)


class HopError(RuntimeError):
    """A shard answered with an `Error` message."""


def parse_split(split: str, n_layers: int) -> list[tuple[int, int]]:
    """"7,19" -> [(0, 7), (7, 19), (19, n_layers)]; "" -> one shard."""
    cuts = [int(c) for c in split.split(",") if c.strip()] if split else []
    bounds = [0, *cuts, n_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split points {cuts} must increase strictly within (0, {n_layers})")
    return list(zip(bounds, bounds[1:]))


class LocalPipeline:
    """Shards of one model in one process, chained through encoded frames."""

    def __init__(self, model: str, split: str = "", recipe: Recipe | str = "auto", *,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, encoding: str = DEFAULT_ENCODING, cache=None) -> None:
        """`chunk_tokens`, `encoding`, `cache`: --chunk-tokens, --wire-encoding and the cache directory, as a
        daemon here would have them."""
        self.chunk_tokens, self.encoding = chunk_tokens, encoding
        self.artifact = open_artifact(model, cache)
        self.recipe = get_recipe(recipe, self.artifact) if isinstance(recipe, str) else recipe
        self.recipe_fp = self.recipe.fingerprint(self.artifact.fingerprint, self.artifact.config.adapter,
                                                 "artifact")
        self.ranges = parse_split(split, self.artifact.config.n_layers)
        self.endpoints = [ShardEndpoint(Shard(self.artifact, a, b, self.recipe), self.artifact.fingerprint,
                                        self.recipe_fp) for a, b in self.ranges]

    def _hop(self, endpoint: ShardEndpoint, msg: Message) -> Message | None:
        decoded = Decoder().feed(encode(msg, self.encoding))
        replies = endpoint.handle(decoded[0])
        for reply in replies:
            if isinstance(reply, Error):
                raise HopError(f"{reply.code}: {reply.message}")
        return replies[0] if replies else None

    def _through(self, msg: Message) -> Message | None:
        for endpoint in self.endpoints:
            msg = self._hop(endpoint, msg)
            if msg is None:
                return None
        return msg

    def start(self, ids: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> Generation:
        """The generation of up to `max_tokens` after `ids` (cut to the context, as an entry cuts it)."""
        cfg = self.artifact.config
        return Generation.start(ids, max_tokens, cfg.max_positions, frozenset(stop_ids), rope.switch(cfg.rope_scaling))

    def generate(self, ids: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: set[int] = frozenset(), generation: Generation | None = None) -> Iterator[int]:
        """Yield up to max_tokens token ids after the prompt ids; stops after a stop id."""
        gen = generation or Generation(ids=list(ids), max_tokens=max_tokens, stop=frozenset(stop_ids),
                                       switch=rope.switch(self.artifact.config.rope_scaling))
        sid, epoch = os.urandom(16), 0
        try:
            reply = self._open(gen, sid, epoch, sampling)
            while True:
                assert isinstance(reply, Token), reply
                taken, event = gen.take([reply.token_id])  # the entry's decode rule (meshd/entry/state.py)
                if event is not None:
                    gen.course.to(event)
                yield from taken
                if event is Event.DONE:
                    return
                if event is Event.SWITCHED:  # the sessions open again on the long table and compute the sequence anew
                    self._close(sid, epoch)
                    sid = os.urandom(16)
                    reply = self._open(gen, sid, epoch, sampling)
                    continue
                reply = self._through(token_frame(sid, epoch, len(gen.tokens), Phase.DECODE, gen.position,
                                                  [gen.tokens[-1]]))
        finally:
            self._close(sid, epoch)

    def _open(self, gen: Generation, sid: bytes, epoch: int, sampling: SamplingParams) -> Message | None:
        """Open the generation's sessions on every shard (on its RoPE table) and prefill what that table
        computes as a prefill; the tail's reply to the last chunk."""
        if gen.take_table():
            log.info("longrope: the sequence is past the short RoPE table; its sessions open on the long table"
                     " and compute it anew", positions=len(gen.prefill_ids), switch=gen.switch,
                     generated=len(gen.tokens))
        for endpoint, (a, b) in zip(self.endpoints, self.ranges):
            opened = self._hop(endpoint, open_session(1, sid, epoch, a, b, self.artifact.fingerprint, self.recipe_fp,
                                                      gen.max_length, sampling, rope_table=gen.rope_table))
            assert isinstance(opened, Opened)
        ids = gen.prefill_ids
        spans = chunk_spans(len(ids), self.chunk_tokens)
        reply = None
        for ci, (a, b) in enumerate(spans):
            reply = self._through(token_frame(sid, epoch, 0, Phase.PREFILL, a, ids[a:b], ci, len(spans)))
        return reply

    def _close(self, sid: bytes, epoch: int) -> None:
        for endpoint in self.endpoints:
            endpoint.handle(Close(session_id=sid, epoch=epoch))
