"""Sketches of what each hop computed for one step, so that an entry whose checked routes disagree can
find the first range where they part without moving whole hidden states.

Rules: an entry asks by adding a `sketch_seed` tensor (int64 [1], a seed it picks) to a frame; every
hop that computes that frame passes the request on and adds `sketch:<start>:<end>` (float32 [K]):
K random projections, drawn from the seed, of its output's last row (hidden states, or a tail's
logits). The tail's Token carries them all back. Pure functions of tensors: no session state.
"""

from __future__ import annotations

import torch

from meshd.wire.tensors import Tensor

REQUEST = "sketch_seed"
PREFIX = "sketch:"
K = 8  # projections a sketch holds
TOLERANCE = 1e-4  # relative: replicas of one recipe on one CPU kind differ by 0 (tests/test_replica_spread.py)


def sketch(out: torch.Tensor, seed: int, k: int = K) -> torch.Tensor:
    """K projections of the last row of `out` on unit-variance random directions drawn from `seed`."""
    row = out.reshape(-1, out.shape[-1])[-1].to(torch.float64)
    gen = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    directions = torch.randn(k, row.shape[0], generator=gen, dtype=torch.float64) / row.shape[0] ** 0.5
    return directions @ row


def request(seed: int) -> Tensor:
    return Tensor.from_torch(REQUEST, torch.tensor([int(seed)], dtype=torch.int64))


def carried(tensors, out: torch.Tensor, layers: tuple[int, int]) -> tuple[Tensor, ...]:
    """What a hop adds to its output frame (or Token) for a frame whose `tensors` ask for a sketch:
    the request, the sketches of the hops before, and its own; () when none was asked for."""
    req = next((t for t in tensors if t.name == REQUEST), None)
    if req is None:
        return ()
    seed = req.to_torch().reshape(-1)
    if seed.numel() != 1 or seed.dtype != torch.int64:
        return ()  # a malformed request is ignored: the step itself is unaffected
    before = tuple(t for t in tensors if t.name.startswith(PREFIX))
    return (req, *before, Tensor.from_torch(f"{PREFIX}{layers[0]}:{layers[1]}",
                                                     sketch(out, int(seed[0])).to(torch.float32)))


def read(tensors) -> dict[tuple[int, int], torch.Tensor]:
    """The sketches among `tensors`, by the layers [start, end) they sketch the output of."""
    out = {}
    for t in tensors:
        if t.name.startswith(PREFIX):
            try:
                start, end = (int(x) for x in t.name[len(PREFIX):].split(":"))
            except ValueError:
                continue
            out[(start, end)] = t.to_torch().to(torch.float64).reshape(-1)
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOLERANCE) -> bool:
    """Whether two sketches agree within `tol` of their larger magnitude."""
    if a.shape != b.shape:
        return False
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-12)
    return float((a - b).abs().max()) <= tol * scale


def first_divergence(a: dict, b: dict, tol: float = TOLERANCE) -> tuple[int, int] | None:
    """The layers [from, to) where two routes' sketches first part: `to` is the first layer both
    routes sketched the output of (a hop of each ends there) with sketches that differ, `from` the
    one before where they agreed (0 if none). None when every shared boundary agrees."""
    ends_a = {end: s for (_, end), s in a.items()}
    ends_b = {end: s for (_, end), s in b.items()}
    agreed = 0
    for end in sorted(set(ends_a) & set(ends_b)):
        if not close(ends_a[end], ends_b[end], tol):
            return agreed, end
        agreed = end
    return None
