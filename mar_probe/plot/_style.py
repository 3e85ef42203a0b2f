"""Placement shared by the figures: legends beside the data, footnotes under the axes (never over the plot)."""
from __future__ import annotations

import textwrap


def legend_beside(ax, handles=None, labels=None, **kw):
    """The legend to the right of ``ax`` (top aligned), outside the data; constrained layout makes room for it."""
    args = () if handles is None else (handles, labels)
    kw = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": "small", **kw}
    return ax.legend(*args, **kw)


def legend_outside(fig, handles, labels, **kw):
    """A figure legend right of every axes (``twinx`` figures: beside the right axis' labels too)."""
    kw = {"loc": "outside right upper", "fontsize": "small", **kw}
    return fig.legend(handles, labels, **kw)


def footnote(ax, text: str, fontsize="x-small", width: float | None = None):
    """``text`` under ``ax``, below its x label (or its tick labels), wrapped to the axes' width so that the
    layout does not squeeze the plot to fit one long line. ``width``: characters per line (default: the axes')."""
    from matplotlib.font_manager import FontProperties
    fig = ax.figure
    if width is None:
        points = ax.get_position().width * fig.get_figwidth() * 72
        width = max(40, int(points / (0.55 * FontProperties(size=fontsize).get_size_in_points())))
    text = "\n".join(textwrap.fill(p, int(width)) for p in text.split("\n"))
    if ax.get_xlabel():
        coords, offset = ("axes fraction", ax.xaxis.label), (0, -4)
    else:                                                               # under the tick labels
        coords, offset = "axes fraction", (0, -24)
    return ax.annotate(text, xy=(0, 0), xycoords=coords, xytext=offset,
                       textcoords="offset points", ha="left", va="top", fontsize=fontsize, color="0.3")
