"""Labels that neither overlap each other nor cover a point, for the scatter plots of ``plots``.

Points that land on (nearly) the same spot share one label (``_clusters``, ``_label_lines``);
``place_labels`` tries offsets around each anchor, nearest first, until the label's box is clear
of the labels placed before it and of the obstacles (the markers), inside the axes. Everything
works in display pixels, so the figure must be laid out before labels are placed.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def _clusters(points_px: np.ndarray, radius: float) -> list[list[int]]:
    """Indices grouped by single linkage: points closer than ``radius`` pixels share a group."""
    groups: list[list[int]] = []
    for i, p in enumerate(points_px):
        near = [g for g in groups if any(np.hypot(*(points_px[j] - p)) < radius for j in g)]
        merged = [i] + [j for g in near for j in g]
        groups = [g for g in groups if g not in near] + [sorted(merged)]
    return sorted(groups, key=lambda g: g[0])


def _overlap(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(fig: Any, ax: Any, anchors_px: list, texts: list[str], obstacles: list,
                 **text_kw: Any) -> list:
    """Annotate each anchor (display pixels) with its text, trying offsets around it (nearest
    first) until the label box overlaps neither an earlier label nor an obstacle (a Bbox, e.g. a
    marker) and lies inside the axes. Far labels get a leader line. Returns the annotations."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer).padded(-2)
    px_per_pt = fig.dpi / 72.0
    angles = (0, 180, 35, -35, 145, -145, 90, -90, 60, -60, 120, -120, 15, -15, 165, -165)
    offsets = [(r * math.cos(math.radians(a)), r * math.sin(math.radians(a)))
               for r in (5, 11, 18, 26, 36, 48, 62, 80, 100, 125, 155) for a in angles]
    placed: list[Bbox] = []
    out = []
    for (x, y), text in zip(anchors_px, texts):
        data = ax.transData.inverted().transform((x, y))
        best: tuple[float, float, float, str, str, Any] | None = None
        for dx, dy in offsets:
            ha = "left" if dx > 0.3 * abs(dy) else "right" if dx < -0.3 * abs(dy) else "center"
            va = "bottom" if dy > 0.3 * abs(dx) else "top" if dy < -0.3 * abs(dx) else "center"
            ann = ax.annotate(text, data, xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                              **text_kw)
            ann.update_positions(renderer)  # an annotation's text is placed at draw time
            box = Text.get_window_extent(ann, renderer).padded(1.5)
            cost = sum(_overlap(box, b) for b in placed + obstacles)
            if not (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1):
                cost += 1e6
            ann.remove()
            if best is None or cost < best[0]:
                best = (cost, dx, dy, ha, va, box)
            if cost == 0:
                break
        assert best is not None  # there are offsets to try
        cost, dx, dy, ha, va, box = best
        far = math.hypot(dx, dy) > 12
        ann = ax.annotate(text, data, xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                          arrowprops=dict(arrowstyle="-", color="0.5", linewidth=0.6,
                                          shrinkA=0, shrinkB=4 * px_per_pt) if far else None,
                          **text_kw)
        placed.append(box)
        out.append(ann)
    return out


def _label_lines(names: list[str], per_line: int = 2) -> str:
    return "\n= ".join(" = ".join(names[i:i + per_line]) for i in range(0, len(names), per_line))
