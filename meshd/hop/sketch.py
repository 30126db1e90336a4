"""Sketches of what each hop computed for one step, so that an entry whose checked routes disagree can
find the first range where they part without moving whole hidden states.

Rules: an entry asks by adding a `sketch_seed` tensor (int64 [1], a seed it picks) to a frame; every
hop that computes that frame passes the request on and adds `sketch:<start>:<end>` (float32 [K]):
K random projections, drawn from the seed, of its output's last row (hidden states, or a tail's
logits). The tail's Token carries them all back. A check's window (`meshd/entry/windows.py`) asks with
`sketch_rows_seed` instead: every row of the frame is sketched (float32 [n, K], row i the sketch its
one-position step would give), and the tail accepts a draft only where it samples that very token
(`teacher`: the window's tokens are the first route's, fed as drafts). A build that does not know the
request ignores it and sends no sketch. Pure functions of tensors: no session state.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from meshd.wire.tensors import Tensor

REQUEST = "sketch_seed"
ROWS = "sketch_rows_seed"  # every row, and drafts held to the sampled token (a check's window)
PREFIX = "sketch:"
K = 8  # projections a sketch holds
TOLERANCE = 1e-4  # relative: replicas of one recipe on one CPU kind differ by 0 (tests/test_replica_spread.py); in
# the native lane AVX-512, AVX2, thread counts and a window's pass against its steps by 0 too, in the exact lane by
# up to 8.4e-6 (bench/sketch_spread.py, docs/protocol.md)


@lru_cache(maxsize=8)
def directions(seed: int, width: int, k: int = K) -> torch.Tensor:
    """K unit-variance random directions of `width` drawn from `seed` (float64 [k, width]): drawn once a
    generation's seed and width, as a tail's logits make it 49,152 wide (SmolLM2)."""
    gen = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(k, width, generator=gen, dtype=torch.float64) / width ** 0.5


def sketch(out: torch.Tensor, seed: int, k: int = K) -> torch.Tensor:
    """K projections of the last row of `out` on unit-variance random directions drawn from `seed`."""
    return sketch_rows(out.reshape(-1, out.shape[-1])[-1:], seed, k)[0]


def sketch_rows(out: torch.Tensor, seed: int, k: int = K) -> torch.Tensor:
    """`sketch` of every row of `out` ([n, k]): row by row, so that each is what its one-position step gives."""
    rows = out.reshape(-1, out.shape[-1]).to(torch.float64)
    dirs = directions(int(seed), rows.shape[1], k)
    return torch.stack([dirs @ row for row in rows])


def request(seed: int) -> Tensor:
    return Tensor.from_torch(REQUEST, torch.tensor([int(seed)], dtype=torch.int64))


def rows_request(seed: int) -> Tensor:
    """The request of a check's window: every row sketched, and the drafts held to the sampled token."""
    return Tensor.from_torch(ROWS, torch.tensor([int(seed)], dtype=torch.int64))


def teacher(tensors) -> bool:
    """Whether a frame is a check's window (`rows_request`): its tail accepts a draft only where it samples it."""
    return any(t.name == ROWS for t in tensors)


def carried(tensors, out: torch.Tensor, layers: tuple[int, int]) -> tuple[Tensor, ...]:
    """What a hop adds to its output frame (or Token) for a frame whose `tensors` ask for a sketch:
    the request, the sketches of the hops before, and its own (of the last row, or of every row for a
    `rows_request`); () when none was asked for."""
    req = next((t for t in tensors if t.name in (REQUEST, ROWS)), None)
    if req is None:
        return ()
    seed = req.to_torch().reshape(-1)
    if seed.numel() != 1 or seed.dtype != torch.int64:
        return ()  # a malformed request is ignored: the step itself is unaffected
    before = tuple(t for t in tensors if t.name.startswith(PREFIX))
    mine = sketch_rows(out, int(seed[0])) if req.name == ROWS else sketch(out, int(seed[0]))
    return (req, *before, Tensor.from_torch(f"{PREFIX}{layers[0]}:{layers[1]}", mine.to(torch.float32)))


def read(tensors) -> dict[tuple[int, int], torch.Tensor]:
    """The sketches among `tensors`, by the layers [start, end) they sketch the output of: [K] each (of
    a last row), or [n, K] (of every row, a `rows_request`'s)."""
    out = {}
    for t in tensors:
        if t.name.startswith(PREFIX):
            try:
                start, end = (int(x) for x in t.name[len(PREFIX):].split(":"))
            except ValueError:
                continue
            values = t.to_torch().to(torch.float64)
            out[(start, end)] = values.reshape(-1, K) if values.dim() == 2 else values.reshape(-1)
    return out


def row(sketches: dict, i: int) -> dict[tuple[int, int], torch.Tensor]:
    """Row `i` of every-row sketches (`read` of a `rows_request`'s answer): what its one-position step's are."""
    return {span: s[i] for span, s in sketches.items() if s.dim() == 2 and s.shape[0] > i}


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
