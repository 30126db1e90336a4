"""What a daemon serves, settled before it joins: the model file, its recipe, the range the operator
fixed, and the draft model its generations may use (`--draft`).

Rule: a fixed range that cannot fit `--memory` is refused here, before the daemon joins the mesh
(an operator's error, not the mesh's); the recipe's fingerprint names the file, its adapter and the
recipe, so peers on another recipe never share a route with this one.
"""

from __future__ import annotations

import os

import trio

from meshd.core.compute import ComputeExecutor
from meshd.core.log import get_logger
from meshd.core.settings import Settings
from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.footprint import check_fits
from meshd.shard.recipe import get_recipe

log = get_logger(__name__)


async def open_model(settings: Settings, compute: ComputeExecutor):
    """(artifact, recipe, recipe fingerprint, fixed range or None); `(0, 0)` is `--layers none`.
    The compute thread's tensor work gets its threads here."""
    artifact = await trio.to_thread.run_sync(open_artifact, settings.model, settings.cache_dir or None)
    recipe = get_recipe(settings.recipe, artifact)
    await compute.run(blocks.divide_threads, settings.threads or len(os.sched_getaffinity(0)), recipe)
    recipe_fp = recipe.fingerprint(artifact.fingerprint, artifact.config.adapter, "artifact")
    fixed = settings.parse_layers(artifact.config.n_layers)
    if fixed is not None and fixed != (0, 0):
        check_fits(artifact, recipe, *fixed, memory=settings.memory)
    return artifact, recipe, recipe_fp, fixed


async def open_draft(settings: Settings, artifact, compute: ComputeExecutor, fixed):
    """The draft model (`--draft`) loaded whole on the compute thread, or None without one, with
    speculation off, or on a fixed range without layer 0 (never an entry). Refused (DraftRefused,
    a ValueError) before the daemon joins when its tokenizer's vocabulary is not the model's."""
    if not settings.draft or not settings.speculate_on:
        return None
    if fixed is not None and (fixed == (0, 0) or fixed[0] != 0):
        log.info("--draft not loaded: this daemon serves no layer 0, so it starts no generation", draft=settings.draft)
        return None

    def load():
        from meshd.entry.draftmodel import DraftModel
        from meshd.shard.tokenizer import load_tokenizer

        return DraftModel(settings.draft, load_tokenizer(artifact), cache=settings.cache_dir or None)

    return await compute.run(load)
