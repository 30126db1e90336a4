"""The `meshd local` command: one prompt through the whole model in this process (see
`meshd/entry/local.py`). Stdout carries only generated text; `--stats` puts the numbers on stderr."""

from __future__ import annotations

import json
import os
import sys

from meshd.entry.local import LocalPipeline
from meshd.entry.state import stop_ids
from meshd.shard import blocks
from meshd.shard.sampler import SamplingParams


def run_local(args, settings) -> int:
    """`settings`: the daemon's settings as flags, MESHD_* and the config file give them here."""
    from meshd.shard.tokenizer import TextStream, encode_prompt, load_tokenizer

    pipeline = LocalPipeline(args.model, args.split, args.recipe, chunk_tokens=settings.chunk_tokens,
                             encoding=settings.wire_encoding, cache=settings.cache_dir or None)
    blocks.divide_threads(args.threads or len(os.sched_getaffinity(0)), pipeline.recipe)
    tokenizer = load_tokenizer(pipeline.artifact)
    ids = encode_prompt(tokenizer, args.prompt, args.chat)
    gen = pipeline.start(ids, args.max_tokens, stop_ids(pipeline.artifact.config, tokenizer, args.ignore_eos))
    stream = TextStream(tokenizer)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    for token in pipeline.generate(ids, args.max_tokens, sampling, generation=gen):
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        print(json.dumps({**gen.stats(), "route": [list(r) for r in pipeline.ranges],
                          "recipe": pipeline.recipe.name}), file=sys.stderr)
    return 0
