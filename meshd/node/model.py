"""What a daemon serves, settled before it joins: the model file, its recipe, and the range the operator fixed.

Rule: a fixed range that cannot fit `--memory` is refused here, before the daemon joins the mesh
(an operator's error, not the mesh's); the recipe's fingerprint names the file, its adapter and the
recipe, so peers on another recipe never share a route with this one.
"""

from __future__ import annotations

import os

import trio

from meshd.node.compute import ComputeExecutor
from meshd.node.settings import Settings
from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.footprint import check_fits
from meshd.shard.recipe import get_recipe


async def open_model(settings: Settings, compute: ComputeExecutor):
    """(artifact, recipe, recipe fingerprint, fixed range or None); `(0, 0)` is `--layers none`.
    The compute thread's tensor work gets its threads here."""
    artifact = await trio.to_thread.run_sync(open_artifact, settings.model)
    recipe = get_recipe(settings.recipe, artifact)
    await compute.run(blocks.divide_threads, settings.threads or len(os.sched_getaffinity(0)), recipe)
    recipe_fp = recipe.fingerprint(artifact.fingerprint, artifact.config.adapter, "artifact")
    fixed = settings.parse_layers(artifact.config.n_layers)
    if fixed is not None and fixed != (0, 0):
        check_fits(artifact, recipe, *fixed, memory=settings.memory)
    return artifact, recipe, recipe_fp, fixed
