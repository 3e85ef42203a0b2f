"""A lint for drawn matplotlib figures: the defects a reader sees before reading a number.

:func:`lint_figure` draws a figure (Agg) and returns a :class:`Problem` per defect; :func:`check_figure` raises
:class:`FigureLintError` listing them all. The checks and their rules:

``outside``
    A drawn text (title, suptitle, axis and tick label, legend text, annotation, ``fig.text`` footnote) whose
    window extent leaves the figure's canvas by more than 1 pixel: it is clipped in the saved image.
``overlap``
    Two drawn texts whose extents intersect by more than 1 pixel in both directions. Only texts that were drawn
    count: invisible ones, empty or blank strings, tick labels matplotlib did not draw (outside the view or hidden
    by shared axes) and a text against itself never do. Tick labels count like any other text: crowded tick
    labels are a defect; rotated texts are compared by their own (rotated) rectangles. A text over a legend's
    frame (a footnote under a legend) overlaps it too; the legend's own texts do not.
``legend_covers_data``
    A legend over an axes' data: the plotted lines (their segments sampled every 2 pixels; markers only for
    marker-only lines) and scatter points of every axes, restricted to what lies inside its axes, of which more
    than :data:`DATA_TOLERANCE` (by sample count) falls inside a legend's box. Lines in axes coordinates
    (``axhline``, ``axvline``: they span the whole axes) are not data.
``unlabelled``
    An axes whose x or y axis has no label. Exempt: axes turned off or invisible; an axis that is itself
    invisible (the x axis of a ``twinx``); an axis shared (``sharex``/``sharey``) with an axes that labels it;
    image-only axes (``imshow`` and nothing else) whose image has a labelled colour bar (same colour map and
    limits) or that are marked with :func:`exempt_labels` (pictures: sample grids); colour-bar axes need only
    the label along the bar.
``band_range``
    A band (``fill_between``) of an axes with a declared range (:func:`declare_range`) whose y extent leaves it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

#: pixels a text may leave the canvas by, or two texts may overlap by (in both directions)
TEXT_TOLERANCE = 1.0
#: the fraction of an axes' sampled data points that may lie under a legend
DATA_TOLERANCE = 0.01
_RANGE_ATTR = "_mar_probe_range"
_EXEMPT_ATTR = "_mar_probe_unlabelled"


@dataclass(frozen=True)
class Problem:
    """One defect: its kind (``outside``, ``overlap``, ``legend_covers_data``, ``unlabelled``, ``band_range``),
    the artist's text or label, and what is wrong."""
    kind: str
    artist: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.artist!r}: {self.detail}"


class FigureLintError(AssertionError):
    """A figure has defects; ``problems`` lists them all."""

    def __init__(self, problems, name: str = "figure"):
        self.problems = list(problems)
        super().__init__(f"{name} has {len(self.problems)} problem(s):\n" + "\n".join(f"  {p}" for p in self.problems))


class FigureLintWarning(UserWarning):
    """A defect of a figure written anyway (``mar-probe figures`` warns instead of failing)."""


def declare_range(ax, lo=None, hi=None):
    """Declare the range of the quantity on ``ax``'s y axis (None: unbounded): its bands must stay inside."""
    setattr(ax, _RANGE_ATTR, (-np.inf if lo is None else float(lo), np.inf if hi is None else float(hi)))
    return ax


def exempt_labels(ax, reason: str):
    """Mark an image-only axes (a picture, e.g. a sample in a grid) as needing no x/y label, saying why."""
    setattr(ax, _EXEMPT_ATTR, reason)
    return ax


def lint_figure(fig) -> list[Problem]:
    """Draw ``fig`` (Agg) and return its problems (see the module's docstring for the checks)."""
    texts = _drawn_texts(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [(t, t.get_window_extent(renderer)) for t in texts]
    return (_outside(fig, boxes) + _overlaps(boxes, renderer) + _legends(fig, renderer, boxes) + _unlabelled(fig)
            + _bands(fig))


def check_figure(fig, name: str = "figure") -> None:
    """Raise :class:`FigureLintError` listing every problem of ``fig`` (none: return None)."""
    problems = lint_figure(fig)
    if problems:
        raise FigureLintError(problems, name)


# ---- drawing ---------------------------------------------------------------------------------------------------
def _drawn_texts(fig) -> list:
    """Every Text artist drawn (visible, non-blank, not skipped by its parent) when ``fig`` is drawn on Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    drawn: dict[int, Text] = {}
    original = Text.draw

    def recording(self, renderer):
        if self.get_visible() and self.get_text().strip() and self.get_alpha() != 0:
            drawn[id(self)] = self
        return original(self, renderer)

    Text.draw = recording
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    return list(drawn.values())


def _name(t) -> str:
    return " ".join(t.get_text().split())[:80]


def _outside(fig, boxes) -> list[Problem]:
    w, h = fig.bbox.width, fig.bbox.height
    tol = TEXT_TOLERANCE
    out = []
    for t, b in boxes:
        if b.x0 < -tol or b.y0 < -tol or b.x1 > w + tol or b.y1 > h + tol:
            out.append(Problem("outside", _name(t), f"extent x [{b.x0:.0f}, {b.x1:.0f}], y [{b.y0:.0f}, {b.y1:.0f}] "
                                                    f"px leaves the {w:.0f}x{h:.0f} px canvas"))
    return out


def _rotated(t) -> bool:
    return t.get_rotation() % 90 != 0


def _corners(t, b, renderer) -> np.ndarray:
    """The 4 corners of a rotated text's own rectangle: its unrotated size turned by its angle about the centre
    of its (axis-aligned) window extent, which a rotated rectangle's bounding box shares."""
    angle = t.get_rotation()
    try:
        t.set_rotation(0)
        flat = t.get_window_extent(renderer)
    finally:
        t.set_rotation(angle)
    a = np.deg2rad(angle)
    rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    half = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]]) * [flat.width / 2, flat.height / 2]
    return half @ rot.T + [(b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2]


def _shape(t, b, renderer) -> np.ndarray:
    return _corners(t, b, renderer) if _rotated(t) else np.array([[b.x0, b.y0], [b.x1, b.y0], [b.x1, b.y1],
                                                                  [b.x0, b.y1]])


def _depth(p: np.ndarray, q: np.ndarray) -> float:
    """How deep two convex polygons overlap: the least overlap of their projections on any edge normal
    (separating axes); <= 0 when they are apart."""
    depth = np.inf
    for poly in (p, q):
        for e in np.diff(np.vstack([poly, poly[:1]]), axis=0):
            n = np.array([-e[1], e[0]]) / (np.hypot(*e) or 1.0)
            a, b = p @ n, q @ n
            depth = min(depth, min(a.max(), b.max()) - max(a.min(), b.min()))
    return depth


def _overlaps(boxes, renderer) -> list[Problem]:
    """Overlapping pairs; rotated texts (tick labels at 30°) by their own rectangles, as their axis-aligned
    extents overlap where the glyphs do not."""
    tol = TEXT_TOLERANCE
    out = []
    for (t1, b1), (t2, b2) in itertools.combinations(boxes, 2):
        w, h = _intersection(b1, b2)
        if w <= tol or h <= tol:
            continue
        if (_rotated(t1) or _rotated(t2)) and _depth(_shape(t1, b1, renderer), _shape(t2, b2, renderer)) <= tol:
            continue
        out.append(Problem("overlap", _name(t1), f"overlaps {_name(t2)!r} by {w:.0f}x{h:.0f} px"))
    return out


# ---- legends over data -----------------------------------------------------------------------------------------
def _data_points(ax) -> np.ndarray:
    """Display coordinates of ``ax``'s plotted data inside the axes: line segments every 2 px (markers only for
    marker-only lines) and scatter offsets."""
    from matplotlib.collections import PathCollection
    pts = []
    for line in ax.get_lines():
        if not line.get_visible() or not line.get_transform().contains_branch(ax.transData):
            continue
        xy = line.get_transform().transform(np.column_stack(line.get_data()).astype(float))
        xy = xy[np.isfinite(xy).all(1)]
        if line.get_linestyle() in ("None", "none", "", " ") or len(xy) < 2:
            pts.append(xy)
            continue
        for a, b in zip(xy[:-1], xy[1:]):
            n = max(2, int(np.ceil(np.hypot(*(b - a)) / 2.0)) + 1)
            pts.append(a + np.linspace(0, 1, n)[:, None] * (b - a))
    for coll in ax.collections:
        if isinstance(coll, PathCollection) and coll.get_visible() and len(coll.get_offsets()):
            xy = coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), float))
            pts.append(xy[np.isfinite(xy).all(1)])
    if not pts:
        return np.zeros((0, 2))
    xy = np.concatenate(pts)
    box = ax.bbox
    inside = (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)
    return xy[inside]


def _intersection(a, b) -> tuple[float, float]:
    return min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)


def _legends(fig, renderer, boxes) -> list[Problem]:
    legends = [leg for ax in fig.axes if (leg := ax.get_legend()) is not None] + list(fig.legends)
    out = []
    for leg in legends:
        if not leg.get_visible():
            continue
        b = leg.get_window_extent(renderer)
        own = {id(t) for t in leg.get_texts()} | {id(leg.get_title())}
        for t, tb in boxes:
            w, h = _intersection(b, tb)
            if id(t) not in own and w > TEXT_TOLERANCE and h > TEXT_TOLERANCE:
                out.append(Problem("overlap", _name(t),
                                   f"overlaps the legend {_legend_name(leg)!r} by {w:.0f}x{h:.0f} px"))
        for ax in fig.axes:
            if not ax.get_visible() or not ax.bbox.overlaps(b):
                continue
            xy = _data_points(ax)
            if not len(xy):
                continue
            under = ((xy[:, 0] > b.x0) & (xy[:, 0] < b.x1) & (xy[:, 1] > b.y0) & (xy[:, 1] < b.y1)).mean()
            if under > DATA_TOLERANCE:
                out.append(Problem("legend_covers_data", _legend_name(leg),
                                   f"covers {under:.0%} of the data of the axes {ax.get_title()!r} "
                                   f"(tolerance {DATA_TOLERANCE:.0%})"))
    return out


def _legend_name(leg) -> str:
    return leg.get_title().get_text() or ", ".join(t.get_text() for t in leg.get_texts()[:3])


# ---- axis labels -----------------------------------------------------------------------------------------------
def _colorbars(fig) -> list:
    return [ax._colorbar for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def _image_exempt(ax, colorbars) -> bool:
    """Image-only axes explained by a labelled colour bar of the same map and limits, or marked exempt."""
    if not ax.images or ax.get_lines() or ax.collections or ax.patches:
        return False
    if getattr(ax, _EXEMPT_ATTR, None):
        return True
    for cb in colorbars:
        m = cb.mappable
        label = cb.ax.get_ylabel() if cb.orientation == "vertical" else cb.ax.get_xlabel()
        if label and any(im.get_cmap().name == m.get_cmap().name and im.get_clim() == m.get_clim()
                         for im in ax.images):
            return True
    return False


def _unlabelled(fig) -> list[Problem]:
    colorbars = _colorbars(fig)
    out = []
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison:
            continue
        cb = getattr(ax, "_colorbar", None)
        if cb is not None:
            axis, label = ("y", ax.get_ylabel()) if cb.orientation == "vertical" else ("x", ax.get_xlabel())
            if not label:
                out.append(Problem("unlabelled", "colour bar", f"the colour bar has no label along its {axis} axis"))
            continue
        if _image_exempt(ax, colorbars):
            continue
        for axis, label, shared in (("x", ax.get_xlabel(), ax.get_shared_x_axes()),
                                    ("y", ax.get_ylabel(), ax.get_shared_y_axes())):
            if label or not getattr(ax, f"{axis}axis").get_visible():
                continue
            if any(getattr(o, f"get_{axis}label")() for o in shared.get_siblings(ax) if o is not ax):
                continue
            out.append(Problem("unlabelled", ax.get_title() or "axes", f"the {axis} axis has no label"))
    return out


# ---- bands within a declared range -----------------------------------------------------------------------------
def _bands(fig) -> list[Problem]:
    from matplotlib.collections import PolyCollection
    out = []
    for ax in fig.axes:
        rng = getattr(ax, _RANGE_ATTR, None)
        if rng is None:
            continue
        lo, hi = rng
        span = hi - lo if np.isfinite(hi - lo) else 1.0
        eps = 1e-9 * max(span, 1.0)
        for coll in ax.collections:
            if (not isinstance(coll, PolyCollection) or not coll.get_visible()
                    or not coll.get_transform().contains_branch(ax.transData)):
                continue
            ys = [p.vertices[:, 1] for p in coll.get_paths() if len(p.vertices)]
            ys = np.concatenate(ys) if ys else np.zeros(0)
            ys = ys[np.isfinite(ys)]
            if len(ys) and (ys.min() < lo - eps or ys.max() > hi + eps):
                out.append(Problem("band_range", coll.get_label() or ax.get_ylabel() or "band",
                                   f"band spans y [{ys.min():.4g}, {ys.max():.4g}], outside the declared range "
                                   f"[{lo:g}, {hi:g}] of the axes {ax.get_title()!r}"))
    return out
