"""Training curves (reward, loss) as PNG: matplotlib when it is installed, else a small plot drawn pixel by pixel.

The fallback needs nothing beyond the standard library (``zlib`` for the PNG), so the
demo always leaves a picture behind.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence

__all__ = ["Series", "write_curve"]

Series = Sequence[float] | tuple[Sequence[int], Sequence[float]]
"""A curve's values at the plot's steps, or ``(its own steps, its values)`` (a validation every N steps)."""


def _points(steps: Sequence[int], values: Series) -> tuple[list[int], list[float]]:
    if isinstance(values, tuple) and len(values) == 2 and isinstance(values[0], Sequence):
        own, vals = values
        return list(own), [float(v) for v in vals]
    return list(steps), [float(v) for v in values]  # type: ignore[arg-type]


def write_curve(path: str | os.PathLike[str], steps: Sequence[int], series: dict[str, Series], *,
                title: str = "", target: float | None = None, ylabel: str = "mean per rollout") -> str:
    """Plot each named series against ``steps`` (or its own) into ``path``; return which writer drew it."""
    plotted = {name: _points(steps, values) for name, values in series.items()}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_plain(path, plotted, target)
        return "plain"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name, (xs, ys) in plotted.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)
    return "matplotlib"


_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def _write_plain(path: str | os.PathLike[str], series: dict[str, tuple[list[int], list[float]]],
                 target: float | None) -> None:
    width, height, margin = 640, 360, 30
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    values = [v for _, vs in series.values() for v in vs] + ([target] if target is not None else [])
    low, high = min([0.0, *values]), max([1.0, *values])
    steps = [s for xs, _ in series.values() for s in xs]
    first, last = (min(steps), max(steps)) if steps else (0, 1)
    span_x = max(last - first, 1)

    def xy(step: float, value: float) -> tuple[int, int]:
        x = margin + (step - first) / span_x * (width - 2 * margin)
        y = height - margin - (value - low) / (high - low) * (height - 2 * margin)
        return int(round(x)), int(round(y))

    def line(a: tuple[int, int], b: tuple[int, int], colour: tuple[int, int, int]) -> None:
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            x = a[0] + (b[0] - a[0]) * i // n
            y = a[1] + (b[1] - a[1]) * i // n
            for dx, dy in ((0, 0), (1, 0), (0, 1)):
                if 0 <= x + dx < width and 0 <= y + dy < height:
                    pixels[y + dy][x + dx] = colour

    grey = (160, 160, 160)
    line(xy(first, low), xy(last, low), grey)
    line(xy(first, low), xy(first, high), grey)
    if target is not None:
        for x in range(margin, width - margin, 8):
            y = xy(first, target)[1]
            line((x, y), (x + 3, y), grey)
    for k, (xs, values_k) in enumerate(series.values()):
        points = [xy(s, v) for s, v in zip(xs, values_k, strict=False)]
        for a, b in zip(points, points[1:], strict=False):
            line(a, b, _COLOURS[k % len(_COLOURS)])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)
