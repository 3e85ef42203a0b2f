"""Figures of strategy comparisons: images side by side, the speed-fidelity Pareto plot, shadow error per step."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


#: axis labels with units of the quantities compare reports (others: their column name)
#: speed-ups are end to end (compare.SPEED_SCOPE), said on the axis (issue 15 item 7)
AXIS_LABELS = {"speedup_flops": "FLOPs speed-up over full, end to end (×)",
               "speedup_time": "time speed-up over full, end to end (×)",
               "seconds": "seconds per run (s)", "gflops": "GFLOPs per run", "psnr": "PSNR vs full (dB)",
               "ssim": "SSIM vs full", "token_mse": "token MSE vs full", "token_cos": "token cosine vs full",
               "class_accuracy": "class accuracy (judge)", "frechet_distance": "Fréchet distance (judge features)"}


def axis_label(name: str) -> str:
    """``name``'s axis label with its unit (:data:`AXIS_LABELS`), else the name itself."""
    return AXIS_LABELS.get(name, name)


def _grid_caption(label: str, results: dict | None) -> str:
    """A column title: the strategy's label (one option a line) and its mean PSNR against full if reported."""
    title = label.replace(",", "\n")
    entry = (results or {}).get("strategies", {}).get(label, {})
    psnr = entry.get("fidelity", {}).get("psnr", {}).get("mean")
    if label == "full" and entry:
        return title + "\n(reference)"
    return title + (f"\nPSNR {psnr:.1f} dB" if psnr is not None else "")


def strategy_grid_figure(images: dict, results: dict | None = None, scale: float = 1.15):
    """One column per strategy (titled with its label and, from ``results``, its mean PSNR vs full), one row per
    sample, of uint8 images [n, H, W, C]; returns the Figure."""
    from .lint import exempt_labels
    plt = _plt()
    n = max(len(v) for v in images.values())
    cols = len(images)
    fig, axes = plt.subplots(n, cols, figsize=(scale * cols + 0.4, scale * n + 0.9), squeeze=False,
                             layout="constrained")
    for c, (label, imgs) in enumerate(images.items()):
        axes[0, c].set_title(_grid_caption(label, results), fontsize=7)
        for r in range(n):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            exempt_labels(ax, "a generated sample")
            if r < len(imgs):
                img = imgs[r]
                ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=255)
            else:
                ax.axis("off")
    if results is not None:
        fig.suptitle("same labels and seeds per row; PSNR: mean over all compared images", fontsize=7)
    return fig


def save_strategy_grid(images: dict, path, results: dict | None = None, scale: float = 1.15) -> Path:
    """:func:`strategy_grid_figure` as a PNG at ``path``."""
    plt = _plt()
    fig = strategy_grid_figure(images, results, scale)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pareto_plot(df: pd.DataFrame, speed: str, fidelity: str, ax=None, options=None):
    """Speed (x) against fidelity (y) with interval bars, one colour per configuration (named in the legend beside
    the axes), and the Pareto front (``on_front``) joined by a dashed line.

    When every configuration has the same speed (a swept option that does not change the cost, e.g. MARché's
    selection rule), the x axis lists the configurations instead and the common speed is in the title.
    ``options``: the swept options (the x axis' label then).
    """
    from ._style import footnote, legend_beside
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7.6, 4.4), layout="constrained")
    x, y = df[speed].to_numpy(float), df[fidelity].to_numpy(float)
    xerr, yerr = _err(df, speed), _err(df, fidelity)
    clipped = _clipped(df, speed) | _clipped(df, fidelity)
    labels = [f"{lab}*" if clip else str(lab) for lab, clip in zip(df["label"], clipped)]
    finite = x[np.isfinite(x)]
    one_speed = len(finite) > 1 and np.ptp(finite) <= 1e-9 * max(1.0, np.abs(finite).max())
    pos = np.arange(len(df), dtype=float) if one_speed else x
    for i, lab in enumerate(labels):
        xe = None if xerr is None or one_speed else xerr[:, i:i + 1]
        ye = None if yerr is None else yerr[:, i:i + 1]
        ax.errorbar(pos[i:i + 1], y[i:i + 1], xerr=xe, yerr=ye, fmt="o", ms=5, lw=0.8, capsize=2, color=f"C{i % 10}",
                    label=lab)
    if "on_front" in df and df["on_front"].any():
        on = df["on_front"].to_numpy(bool)
        order = np.argsort(pos[on])
        style = dict(ls="--", lw=1) if on.sum() > 1 and not one_speed else dict(ls="none", ms=11, mfc="none")
        ax.plot(pos[on][order], y[on][order], color="k", marker="o" if "ms" in style else None,
                label="Pareto front" if "ms" not in style else "best (Pareto front)", **style)
    if one_speed:
        ax.set_xticks(pos, [_tick(v, options) for v in df["label"]], fontsize="small")
        ax.set_xlim(-0.6, len(df) - 0.4)
        xlabel = f"swept option{'s' if options and len(options) > 1 else ''}: {', '.join(options)}" if options \
            else "configuration"
        name = axis_label(speed)
        value = f"{name[:-4]} {finite[0]:.3g}×" if name.endswith(" (×)") else f"{name} {finite[0]:.3g}"
        title = f"speed-quality trade-off\n(every configuration: {value})"
    else:
        xlabel, title = axis_label(speed), "speed-quality trade-off"
    ax.set(xlabel=xlabel, ylabel=axis_label(fidelity), title=title)
    ax.grid(alpha=0.3)
    legend_beside(ax, fontsize=8)
    if clipped.any():
        footnote(ax, "* interval clipped to the metric's range", fontsize=7)
    return ax


def _tick(label, options) -> str:
    """A configuration's label as a tick: one option a line, without the swept options' names (the axis'
    label names them)."""
    parts = str(label).split(",")
    return "\n".join(p.split("=", 1)[1] if "=" in p and p.split("=", 1)[0] in (options or ()) else p for p in parts)


def _err(df, col):
    """Error bar lengths from ``COL_lo``/``COL_hi``; none (0) where a point has no interval."""
    lo, hi = f"{col}_lo", f"{col}_hi"
    if lo not in df or hi not in df:
        return None
    v = df[col].to_numpy(float)
    err = np.abs(np.vstack([v - df[lo].to_numpy(float), df[hi].to_numpy(float) - v]))
    return np.nan_to_num(err, nan=0.0)


def _clipped(df, col) -> np.ndarray:
    """Whether each point's interval of ``col`` was clipped to the metric's range (``COL_clipped``)."""
    flag = f"{col}_clipped"
    if flag not in df:
        return np.zeros(len(df), dtype=bool)
    return np.array([v is not None and not (isinstance(v, float) and np.isnan(v)) and bool(v) for v in df[flag]])


# ---- shadow error vs step -------------------------------------------------------------------------------------
def shadow_error_data(ds: xr.Dataset, var: str = "dec_kv_err", branch: str = "cond") -> pd.DataFrame:
    """Mean shadow error per step and layer (mean over tokens, 95% CI over samples, clipped at 0), with the
    refresh flag.

    ``var`` is a shadow variable with a layer dim (``dec_kv_err``, ``enc_kv_err``, ``*_resid_err``) or ``z_err``.
    """
    from ..analysis import aggregate
    if var not in ds:
        raise ValueError(f"shadow dataset has no {var!r}; expected one of {sorted(ds.data_vars)!r}")
    x = ds[var].sel(branch=branch).mean("token", skipna=True)              # [sample, step, (layer)]
    agg = aggregate(x, "sample", bounds=(0.0, np.inf)).to_dataframe().reset_index()   # a relative error is >= 0
    layer = next((d for d in x.dims if d.endswith("layer")), None)
    if layer is None:
        agg["layer"] = "z"
    else:
        agg = agg.rename(columns={layer: "layer"})
    refresh = ds["refresh"].any("sample").to_series()
    return agg.assign(refresh=agg["step"].map(refresh), var=var)


def shadow_error(data: pd.DataFrame, ax=None):
    """Shadow error against step, one line per layer, refresh steps marked: error grows between refreshes."""
    from ._style import legend_beside
    from .lint import declare_range
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7.4, 4.2), layout="constrained")
    declare_range(ax, 0, None)
    for layer, g in data.groupby("layer", sort=True):
        g = g.sort_values("step")
        line, = ax.plot(g["step"], g["mean"], marker="o", ms=2.5, lw=1, label=f"layer {layer}")
        ax.fill_between(g["step"], g["lo"], g["hi"], color=line.get_color(), alpha=0.2, lw=0)
    for step in data.loc[data["refresh"].astype(bool), "step"].unique():
        ax.axvline(step, color="0.6", lw=0.6, ls=":")
    ax.set(xlabel="step (dotted: full refresh)", ylabel=f"{data['var'].iloc[0]} (relative error vs full)",
           title="shadow error: what the strategy used vs fresh values\n(mean over tokens, 95% CI over samples)")
    legend_beside(ax, fontsize=7)
    return ax
