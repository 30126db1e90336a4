"""Which layers a daemon takes: the largest gap, with the least-served layers around it up to what it
wants, cut to its memory. Pure functions of the model, the recipe and the coverage map (the watching
and the claiming are the daemon's)."""

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
    """Coverage first: the largest gap (or the thinnest run) of up to `want` layers, cut to memory.
    A gap shorter than `want` is taken with the least-served layers around it, up to `want`, unless
    memory cannot hold that window with the whole gap in it (then the gap alone): the layers a node
    offers serve as redundancy instead of lying idle. Taking such gaps exactly left a churning
    swarm short of its capacity, each new node filling a small gap with a large memory, and kept
    nodes from moving, each the last server of its layers (the runs before and after this rule are
    in docs/simulator.md)."""
    start, end = choose_range(coverage, want)
    wide = widen(coverage, start, end, want)
    if wide != (start, end):
        a, b = fit_span(*wide, memory, size)
        if a <= start and end <= b:
            return a, b
    return fit_span(start, end, memory, size)


def widen(coverage: CoverageMap, start: int, end: int, want: int) -> tuple[int, int]:
    """The window of `want` layers holding [start, end) whose layers have the fewest servers (then the
    lowest most-served layer, then the earliest); [start, end) itself when it is that long already."""
    n = coverage.n_layers
    want = max(1, min(want, n))
    if end - start >= want:
        return start, end
    counts = coverage.counts()
    first = min(range(max(0, end - want), min(start, n - want) + 1),
                key=lambda s: (sum(counts[s:s + want]), max(counts[s:s + want]), s))
    return first, first + want


def fit_range(artifact, recipe, start: int, end: int, memory: int | None) -> tuple[int, int]:
    """The range cut to `memory` bytes (None: uncut): the head's embedding and the tail's LM head
    come on top of the layers; at least one layer is kept."""
    return fit_span(start, end, memory, lambda a, b: weight_bytes(artifact, recipe, a, b))


def place(coverage: CoverageMap, want: int, artifact, recipe, memory: int | None) -> tuple[int, int]:
    """`place_span` for this artifact under this recipe."""
    return place_span(coverage, want, memory, lambda a, b: weight_bytes(artifact, recipe, a, b))
