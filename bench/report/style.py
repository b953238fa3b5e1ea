"""How the figures tell methods apart (a colour, a line style and a marker per method, the
colour of a failure, the nudge that keeps equal answers visible on a log axis) and how a
figure is finished (its heading, legend and caption placed around what is drawn)."""
from __future__ import annotations

import textwrap

import seaborn as sns

from bench.report.tables import BASELINE, method_order

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p"]
LINESTYLES = ["-", "--", ":", "-."]
FAIL_COLOR = "#b2182b"
BASELINE_COLOR = (0.25, 0.25, 0.25)


def _palette_size(n: int) -> int:
    # ten distinct colour-blind-safe colours; beyond that, twenty (markers also differ)
    return 10 if n <= 10 else 20


def method_colors(methods) -> dict[str, tuple]:
    """A stable colour per method; the baseline is dark grey."""
    others = [m for m in method_order(methods) if m != BASELINE]
    size = _palette_size(len(others))
    palette = sns.color_palette("colorblind" if size == 10 else "tab20", size)
    colors = {m: palette[i % size] for i, m in enumerate(others)}
    colors[BASELINE] = BASELINE_COLOR
    return colors


def method_linestyles(methods) -> dict[str, str]:
    """A line style per method such that no two methods share colour and style: beyond the
    palette's size a colour comes back, with the next style (neighbours, whose tab20
    colours are one hue light and dark, differ in style too); the baseline is solid."""
    others = [m for m in method_order(methods) if m != BASELINE]
    size = _palette_size(len(others))
    styles = {m: LINESTYLES[(i + i // size) % len(LINESTYLES)] for i, m in enumerate(others)}
    styles[BASELINE] = "-"
    return styles


def nudge(i: int, n: int) -> float:
    """The factor that moves method i of n along a log axis so that equal answers stay
    visible: 2.5% apart, all n within +-12% of the true value (32 methods nudged 2.5% apart
    drew a 0.02 GiB answer at 0.009 GiB)."""
    step = min(1.025, 1.25 ** (1 / max(n - 1, 1)))
    return step ** (i - (n - 1) / 2)


def finish(fig, heading: str, caption: str = "", handles=(), **legend_kw) -> None:
    """Lay out the panels under `heading`, then put the legend (if any) and the caption below
    everything drawn, measured in pixels so that nothing overlaps (the figure is then saved
    cropped to what it holds, `bbox_inches="tight"`)."""
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    top = max([b.y1 for b in boxes if b is not None] + [fig.bbox.height])
    fig.suptitle(heading, fontsize=12, y=(top + 0.05 * fig.dpi) / fig.bbox.height, va="bottom")
    y = min([b.y0 for b in boxes if b is not None] + [0.0]) - 0.08 * fig.dpi
    height = fig.bbox.height
    if handles:
        legend = fig.legend(handles=list(handles), loc="upper center", frameon=False,
                            bbox_to_anchor=(0.5, y / height), fontsize=9, title_fontsize=9,
                            **legend_kw)
        fig.canvas.draw()
        y = legend.get_window_extent(renderer).y0 - 0.05 * fig.dpi
    if caption:
        width_chars = int(fig.get_figwidth() * 72 / (8.5 * 0.55))
        fig.text(0.5, y / height, textwrap.fill(caption, width_chars), ha="center", va="top",
                 fontsize=8.5, color="0.3")
