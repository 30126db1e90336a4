"""The coverage map of one model: which live peers serve each layer, and where the gaps are.

Rules: built only from live, verified records of the same model and recipe; a pure value, so
routing and `--layers auto` are functions of it, tested without a network.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.dht.record import CoverageRecord


@dataclass(frozen=True)
class CoverageMap:
    n_layers: int
    records: tuple[CoverageRecord, ...]

    @classmethod
    def build(cls, n_layers: int, records, model: str | None = None, recipe: str | None = None,
              now: float | None = None) -> "CoverageMap":
        latest: dict[str, CoverageRecord] = {}
        for r in records:
            if r.expired(now) or r.n_layers != n_layers:
                continue
            if (model and r.model != model) or (recipe and r.recipe != recipe):
                continue
            if r.peer_id not in latest or r.seq > latest[r.peer_id].seq:
                latest[r.peer_id] = r
        return cls(n_layers, tuple(sorted(latest.values(), key=lambda r: (r.start, r.peer_id))))

    def counts(self) -> list[int]:
        """Number of live servers for each layer."""
        counts = [0] * self.n_layers
        for r in self.records:
            for layer in range(r.start, r.end):
                counts[layer] += 1
        return counts

    def gaps(self) -> list[tuple[int, int]]:
        """Maximal [start, end) runs of layers nobody serves."""
        out, start = [], None
        for layer, c in enumerate(self.counts() + [1]):
            if c == 0 and start is None:
                start = layer
            elif c and start is not None:
                out.append((start, layer))
                start = None
        return out

    @property
    def complete(self) -> bool:
        return not self.gaps()

    def serving(self) -> "CoverageMap":
        """Only the peers that have loaded their layers and take sessions."""
        return CoverageMap(self.n_layers, tuple(r for r in self.records if r.serving))

    def without(self, peer_id: str) -> "CoverageMap":
        return CoverageMap(self.n_layers, tuple(r for r in self.records if r.peer_id != peer_id))


def choose_range(coverage: CoverageMap, want: int) -> tuple[int, int]:
    """The contiguous range of at most `want` layers a new node should serve (coverage first).

    With gaps: the largest gap (ties: the earliest), from its start, as much of it as `want`
    allows; a gap shorter than `want` is taken exactly, so no layer is served twice while any
    layer is served by nobody. Without gaps: the window of `want` layers whose servers are fewest
    (redundancy to the least-served layers), ties to the earliest start.
    """
    n = coverage.n_layers
    want = max(1, min(want, n))
    gaps = coverage.gaps()
    if gaps:
        g0, g1 = max(gaps, key=lambda g: (g[1] - g[0], -g[0]))
        return g0, min(g1, g0 + want)
    counts = coverage.counts()
    best = min(range(n - want + 1), key=lambda s: (sum(counts[s:s + want]), max(counts[s:s + want]), s))
    return best, best + want
