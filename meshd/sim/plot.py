"""`--plot PNG`: coverage and load per simulated hour.

matplotlib draws it where it is installed (`pip install -e '.[bench]'`); without it a plain raster
of the same lines is written with zlib alone (no labels: the colours are said on stdout): top,
the share of the hour every layer had one server (blue) and two (green), from 0 to 1; bottom, the
busiest node's sessions over the mean (red), from 1 to its largest value.
"""

from __future__ import annotations

import struct
import zlib

W, H, PAD = 640, 360, 20
BLUE, GREEN, RED, GREY = (31, 119, 180), (44, 160, 44), (214, 39, 40), (180, 180, 180)


def series(report: dict) -> dict[str, list[float | None]]:
    rows = report["per_hour"]
    return {k: [r[k] for r in rows] for k in ("covered_1", "covered_2", "load_max_over_mean")}


def draw(report: dict, path: str) -> str:
    """Writes the PNG; says how it was drawn."""
    s = series(report)
    try:
        import matplotlib
    except ImportError:
        _raster(s, path)
        return "raster (matplotlib not installed): top covered_1 blue, covered_2 green; bottom load max/mean red"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    hours = list(range(len(s["covered_1"])))
    top.plot(hours, s["covered_1"], label="every layer served once")
    top.plot(hours, s["covered_2"], label="twice")
    top.set_ylabel("share of the hour")
    top.legend()
    bottom.plot(hours, [x if x is not None else float("nan") for x in s["load_max_over_mean"]], color="tab:red")
    bottom.set_ylabel("sessions: max / mean")
    bottom.set_xlabel("simulated hour")
    fig.suptitle(f"meshd.sim: {report['nodes']} nodes, capacity {report['capacity']:g}x, "
                 f"sessions {report['session_median_min']:g} min")
    fig.savefig(path, dpi=100)
    return "matplotlib"


def _raster(s: dict, path: str) -> None:
    px = [[(255, 255, 255)] * W for _ in range(H)]
    half = H // 2
    boxes = ((PAD, half - PAD // 2), (half + PAD // 2, H - PAD))
    for y0, y1 in boxes:
        for x in range(PAD, W - PAD):
            px[y0][x] = px[y1][x] = GREY
    loads = [x for x in s["load_max_over_mean"] if x is not None]
    top = max(loads + [2.0])
    _line(px, s["covered_1"], 0.0, 1.0, boxes[0], BLUE)
    _line(px, s["covered_2"], 0.0, 1.0, boxes[0], GREEN)
    _line(px, s["load_max_over_mean"], 1.0, top, boxes[1], RED)
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in px)
    chunk = lambda tag, data: struct.pack(">I", len(data)) + tag + data + struct.pack(  # noqa: E731
        ">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _line(px, values, lo: float, hi: float, box: tuple[int, int], colour) -> None:
    """Values (None: a hole) as a polyline across the box, lo at its bottom, hi at its top."""
    y0, y1 = box
    n = len(values)
    points = []
    for i, v in enumerate(values):
        if v is None:
            points.append(None)
            continue
        x = PAD + (W - 2 * PAD - 1) * (i / max(1, n - 1))
        y = y1 - (y1 - y0) * (min(max(v, lo), hi) - lo) / ((hi - lo) or 1.0)
        points.append((x, y))
    for a, b in zip(points, points[1:] if n > 1 else points):
        if a is None or b is None:
            continue
        steps = int(max(abs(b[0] - a[0]), abs(b[1] - a[1]))) + 1
        for k in range(steps + 1):
            x = round(a[0] + (b[0] - a[0]) * k / steps)
            y = round(a[1] + (b[1] - a[1]) * k / steps)
            for dy in (0, 1):
                if 0 <= y + dy < H:
                    px[y + dy][x] = colour
