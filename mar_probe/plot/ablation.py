"""Figures of the ablations (:mod:`mar_probe.ablation`): the LazyMAR attribution, MARché's selection rules against
attention, and the worst images of each arm beside ``full``'s."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .._io import atomic_path
from .grid import image_grid

GROUP_NAMES = {1: "one cache", 2: "two caches", 3: "all three"}
CELL_INCHES = 1.3     # width of one [full, arm] pair in worst.png (height: half of it, plus its two text lines)
LABEL_INCHES = 1.3    # the arm labels' column of worst.png
WORST_DPI = 100
MIN_WIDTH = 3.6       # inches: room for the title with one image per arm
TITLE_INCHES = 0.55   # the two title lines


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _errors(entries) -> tuple[np.ndarray, np.ndarray]:
    """Means and [2, n] error-bar lengths of ``I`` dicts (0 where there is no interval)."""
    mean = np.array([np.nan if not e or e["mean"] is None else e["mean"] for e in entries], dtype=float)
    lo = np.array([np.nan if not e or e.get("lo") is None else e["lo"] for e in entries], dtype=float)
    hi = np.array([np.nan if not e or e.get("hi") is None else e["hi"] for e in entries], dtype=float)
    return mean, np.nan_to_num(np.abs(np.vstack([mean - lo, hi - mean])), nan=0.0)


def _unit(metric: str) -> str:
    return " (dB)" if metric == "psnr" else ""


def attribution_plot(rows: list[dict], ax=None):
    """LazyMAR attribution: each arm's fidelity against ``full`` (``vs_full``, mean with its 95% interval), the
    arms on the x axis grouped by their number of caches and labelled with their FLOP speed-up over ``full``.

    ``rows`` are :func:`~mar_probe.ablation.attribution_summary` rows (any order: drawn by number of caches, then
    ``order``, the arm's place in the run); ``*`` marks an interval
    clipped to the metric's range."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7.6, 4.4), layout="constrained")
    rows = sorted(rows, key=lambda r: (r["n_caches"], r.get("order", 0)))        # groups, arms in run order
    x = np.array([i + r["n_caches"] - 1 for i, r in enumerate(rows)], dtype=float)  # a gap between groups
    y, err = _errors([r["vs_full"] for r in rows])
    ax.errorbar(x, y, yerr=err, fmt="o", ms=5, lw=1, capsize=3, color="C0")
    ticks = []
    for r in rows:
        s = r.get("speedup_flops") or {}
        speed = f"{s['mean']:.2f}x FLOPs" if s.get("mean") is not None else "-"
        star = "*" if (r["vs_full"] or {}).get("clipped") else ""
        ticks.append(r["label"].replace("+", "+\n") + star + "\n" + speed)
    ax.set_xticks(x, ticks, fontsize=7)
    groups = sorted({r["n_caches"] for r in rows})
    centers = [x[[r["n_caches"] == g for r in rows]].mean() for g in groups]
    for g in groups[1:]:
        first = x[[r["n_caches"] == g for r in rows]].min()
        ax.axvline(first - 1, color="0.7", lw=0.8, ls=":")
    top = ax.secondary_xaxis("top")
    top.set_xticks(centers, [GROUP_NAMES.get(g, f"{g} caches") for g in groups], fontsize=8)
    top.tick_params(length=0)
    metric = rows[0]["metric"] if rows else "psnr"
    ax.set_xlim(x.min() - 0.7, x.max() + 0.7) if len(x) else None
    ax.set(xlabel="arm (caches on) and its FLOP speed-up over full, end to end",
           ylabel=f"{metric} vs full{_unit(metric)}, mean and 95% CI", title="LazyMAR attribution: fidelity per cache")
    ax.grid(axis="y", alpha=0.3)
    if any((r["vs_full"] or {}).get("clipped") for r in rows):
        _footnote(ax.figure, "* interval clipped to the metric's range")
    return ax


def selection_plot(rows: list[dict], ax=None):
    """MARché selection rules against attention: per budget (a group on the x axis), each rule's paired per-image
    difference of fidelity against ``attention@budget`` (``vs_attention``: mean with its 95% interval), a zero
    line for attention itself. ``rows``: :func:`~mar_probe.ablation.selection_summary` rows."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 4.2), layout="constrained")
    budgets = sorted({r["budget"] for r in rows})
    rules = [s for s in dict.fromkeys(r["selection"] for r in rows) if s != "attention"]
    width = 0.7 / max(len(rules), 1)
    markers = "osD^v<>"
    clipped = False
    for j, rule in enumerate(rules):
        pts = [r for r in rows if r["selection"] == rule]
        xs = np.array([budgets.index(r["budget"]) - 0.35 + width * (j + 0.5) for r in pts])
        y, err = _errors([r["vs_attention"] for r in pts])
        clip = any((r["vs_attention"] or {}).get("clipped") for r in pts)
        ax.errorbar(xs, y, yerr=err, fmt=markers[j % len(markers)], ms=5, lw=1, capsize=3, color=f"C{j + 1}",
                    label=rule + ("*" if clip else ""))
        clipped |= clip
    ax.axhline(0.0, color="k", lw=0.9, label="attention (reference)")
    ax.set_xticks(range(len(budgets)), [f"budget {b}" for b in budgets])
    ax.set_xlim(-0.6, len(budgets) - 0.4)
    metric = rows[0]["metric"] if rows else "psnr"
    ax.set(xlabel="refresh budget (tokens per cached layer)",
           ylabel=f"{metric} minus attention's, per image{_unit(metric)}",
           title="MARché refresh selection vs attention, paired per image")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="selection", title_fontsize=8)
    if clipped:
        _footnote(ax.figure, "* interval clipped to the range of a difference")
    return ax


def _footnote(fig, text: str) -> None:
    """A footnote under the axes, in a strip the (constrained) layout keeps free for it."""
    engine = fig.get_layout_engine()
    if engine is not None and hasattr(engine, "set"):
        engine.set(rect=(0, 0.05, 1, 0.95))
    fig.text(0.01, 0.01, text, fontsize=7, color="0.3")


def worst_figsize(n_rows: int, k: int) -> tuple[float, float]:
    """Inches (width, height) of :func:`save_worst_images`' figure: ``n_rows`` arms by ``k`` pairs."""
    return max(LABEL_INCHES + CELL_INCHES * k, MIN_WIDTH), (CELL_INCHES / 2 + 0.35) * n_rows + TITLE_INCHES


def save_worst_images(chosen: dict, path) -> Path:
    """PNG of the worst images: one row per arm, one column per image (its rank), each cell ``full``'s image (left)
    beside the arm's (right), tiled by :func:`~mar_probe.plot.grid.image_grid`, titled with the PSNR against full
    and captioned with seed, index and class. ``chosen``: :func:`~mar_probe.ablation.worst_images`. The figure is
    :func:`worst_figsize` inches at :data:`WORST_DPI`."""
    plt = _plt()
    k = max(len(v) for v in chosen.values())
    fig, axes = plt.subplots(len(chosen), k, figsize=worst_figsize(len(chosen), k), squeeze=False)
    w, h = worst_figsize(len(chosen), k)
    fig.subplots_adjust(left=LABEL_INCHES / w, right=min(0.99, (LABEL_INCHES + CELL_INCHES * k) / w),
                        top=1 - TITLE_INCHES / h, bottom=0.02, hspace=0.5, wspace=0.15)
    for r, (label, items) in enumerate(chosen.items()):
        for c in range(k):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(items):
                it = items[c]
                pair = image_grid(np.stack([it["full"], it["image"]]), ncols=2)
                ax.imshow(pair[..., 0] if pair.shape[-1] == 1 else pair, cmap="gray", vmin=0, vmax=255)
                ax.set_title(f"{it['psnr']:.1f} dB", fontsize=7, pad=2)
                ax.set_xlabel(f"seed {it['seed']} #{it['index']} (class {it['class_label']})", fontsize=6,
                              labelpad=1)
            else:
                ax.axis("off")
            if c == 0:
                ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle("worst images per arm (lowest PSNR vs full)\nleft: full, right: the arm", fontsize=8)
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=WORST_DPI, format="png")
    plt.close(fig)
    return path
