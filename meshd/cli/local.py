"""`meshd local`: the whole model in one process, split into shards that talk through wire frames.

Rule: every hop goes through `meshd.wire` bytes exactly as it would over a stream, so a split run
here exercises the same codec and endpoint code as the mesh. Stdout carries only generated text.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.shard.recipe import Recipe, get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.sampler import SamplingParams
from meshd.wire import Close, Decoder, Error, Message, OpenSession, Opened, Phase, Token, chunk_spans, encode


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

    def __init__(self, model: str, split: str = "", recipe: Recipe | str = "auto") -> None:
        self.artifact = open_artifact(model)
        self.recipe = get_recipe(recipe, self.artifact) if isinstance(recipe, str) else recipe
        self.recipe_fp = self.recipe.fingerprint(self.artifact.fingerprint, self.artifact.config.family, "artifact")
        self.ranges = parse_split(split, self.artifact.config.n_layers)
        self.endpoints = [ShardEndpoint(Shard(self.artifact, a, b, self.recipe), self.artifact.fingerprint,
                                        self.recipe_fp) for a, b in self.ranges]

    def _hop(self, endpoint: ShardEndpoint, msg: Message) -> Message | None:
        decoded = Decoder().feed(encode(msg))
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

    def generate(self, ids: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: set[int] = frozenset()) -> Iterator[int]:
        """Yield up to max_tokens token ids after the prompt ids; stops after a stop id."""
        sid, epoch = os.urandom(16), 0
        max_length = len(ids) + max_tokens
        try:
            for endpoint, (a, b) in zip(self.endpoints, self.ranges):
                opened = self._hop(endpoint, OpenSession(
                    request_id=1, session_id=sid, epoch=epoch, start=a, end=b,
                    model_fingerprint=self.artifact.fingerprint, recipe_fingerprint=self.recipe_fp,
                    max_length=max_length, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, seed=sampling.seed))
                assert isinstance(opened, Opened)
            spans = chunk_spans(len(ids))
            reply = None
            for ci, (a, b) in enumerate(spans):
                reply = self._through(token_frame(sid, epoch, 0, Phase.PREFILL, a, ids[a:b], ci, len(spans)))
            position = len(ids)
            for step in range(1, max_tokens + 1):
                assert isinstance(reply, Token), reply
                yield reply.token_id
                if reply.token_id in stop_ids or step == max_tokens:
                    return
                reply = self._through(token_frame(sid, epoch, step, Phase.DECODE, position, [reply.token_id]))
                position += 1
        finally:
            for endpoint in self.endpoints:
                endpoint.handle(Close(session_id=sid, epoch=epoch))


def run_local(args) -> int:
    """The `meshd local` command."""
    import json
    import sys

    from meshd.shard.tokenizer import TextStream, encode_prompt, load_tokenizer

    pipeline = LocalPipeline(args.model, args.split, args.recipe)
    blocks.divide_threads(args.threads or len(os.sched_getaffinity(0)), pipeline.recipe)
    tokenizer = load_tokenizer(pipeline.artifact)
    ids = encode_prompt(tokenizer, args.prompt, args.chat)
    eos = {i for i in (pipeline.artifact.config.eos_id, tokenizer.eos_token_id) if i is not None}
    stream = TextStream(tokenizer)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    t0 = time.perf_counter()
    first = None
    n = 0
    for token in pipeline.generate(ids, args.max_tokens, sampling, stop_ids=eos if not args.ignore_eos else set()):
        first = first or time.perf_counter()
        n += 1
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    end = time.perf_counter()
    if args.stats:
        decode_s = end - (first or end)
        print(json.dumps({"ttft_s": round((first or end) - t0, 4), "tokens": n, "prompt_tokens": len(ids),
                          "decode_tok_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else None,
                          "route": [list(r) for r in pipeline.ranges], "recipe": pipeline.recipe.name}),
              file=sys.stderr)
    return 0
