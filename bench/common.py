"""What the benches share: the CPU facts quoted with every figure. Imported by the scripts beside it (a script's
own folder is on its path: `python bench/x.py`)."""

from __future__ import annotations

import statistics


def cpu_flags() -> list[str]:
    """The CPU's vector flags (avx2, avx512*, fma) as /proc/cpuinfo lists them."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx2", "avx512", "fma")))
    return []


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None
