"""The loss curve of a training run: loss.png through matplotlib where it is installed, else loss.svg from a small
writer of our own (no dependency), both from the rows of train_log.csv."""

from __future__ import annotations

import os
from collections.abc import Sequence
from xml.sax.saxutils import escape

_COLORS = ("#1f77b4", "#d62728")


def write_loss_plot(series: dict[str, Sequence[tuple[float, float]]], out_dir: str, title: str) -> str:
    """Plot each named series of (step, loss) points; returns the file written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a training machine
        import matplotlib.pyplot as plt
    except ImportError:
        return _write_svg(series, os.path.join(out_dir, "loss.svg"), title)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (name, points), color in zip(series.items(), _COLORS):
        if points:
            ax.plot(*zip(*points), label=name, color=color)
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _write_svg(series: dict[str, Sequence[tuple[float, float]]], path: str, title: str) -> str:
    W, H, pad = 640, 360, 50
    points = [p for s in series.values() for p in s]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    sx = (W - 2 * pad) / ((x1 - x0) or 1)
    sy = (H - 2 * pad) / ((y1 - y0) or 1)

    def xy(p: tuple[float, float]) -> str:
        return f"{pad + (p[0] - x0) * sx:.1f},{H - pad - (p[1] - y0) * sy:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle">{escape(title)}</text>',
           f'<polyline points="{pad},{pad} {pad},{H - pad} {W - pad},{H - pad}" fill="none" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step ({x0:g} to {x1:g})</text>',
           f'<text x="{pad - 6}" y="{pad}" text-anchor="end">{y1:.2f}</text>',
           f'<text x="{pad - 6}" y="{H - pad}" text-anchor="end">{y0:.2f}</text>']
    for i, ((name, pts), color) in enumerate(zip(series.items(), _COLORS)):
        if pts:
            out.append(f'<polyline points="{" ".join(map(xy, pts))}" fill="none" stroke="{color}"/>')
        out.append(f'<text x="{W - pad}" y="{pad + 16 * i}" text-anchor="end" fill="{color}">{escape(name)}</text>')
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out + ["</svg>"]) + "\n")
    return path
