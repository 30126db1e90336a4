"""Which layers a daemon takes: the largest gap it can hold, cut to its memory. Pure functions of the
model, the recipe and the coverage map (the watching and the claiming are the daemon's)."""

from __future__ import annotations

from typing import Callable

from meshd.dht.coverage import CoverageMap, choose_range
from meshd.shard.footprint import layer_bytes, weight_bytes


def largest_layer_bytes(artifact, recipe) -> int:
    """Resident bytes of the largest layer under this recipe (the lane's real layout, e.g. packed
    int4; a MoE layer's experts included, so a plain-MLP layer never sets the count)."""
    return max(layer_bytes(artifact, recipe, i) for i in range(artifact.config.n_layers))


def fit_span(start: int, end: int, memory: int | None, size: Callable[[int, int], int]) -> tuple[int, int]:
    """[start, end) cut from its end until `size(start, end)` bytes fit in `memory` (None: uncut); at
    least one layer is kept. `size` prices a range (the daemon: its artifact's weights under its
    recipe; the simulator, `meshd.sim`: a model shape's)."""
    if memory:
        while end - start > 1 and size(start, end) > memory:
            end -= 1
    return start, end


def place_span(coverage: CoverageMap, want: int, memory: int | None, size: Callable[[int, int], int]) -> tuple[int, int]:
    """Coverage first: the largest gap (or the thinnest run) of up to `want` layers, cut to memory."""
    return fit_span(*choose_range(coverage, want), memory, size)


def fit_range(artifact, recipe, start: int, end: int, memory: int | None) -> tuple[int, int]:
    """The range cut to `memory` bytes (None: uncut): the head's embedding and the tail's LM head
    come on top of the layers; at least one layer is kept."""
    return fit_span(start, end, memory, lambda a, b: weight_bytes(artifact, recipe, a, b))


def place(coverage: CoverageMap, want: int, artifact, recipe, memory: int | None) -> tuple[int, int]:
    """`place_span` for this artifact under this recipe."""
    return place_span(coverage, want, memory, lambda a, b: weight_bytes(artifact, recipe, a, b))
