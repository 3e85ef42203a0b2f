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


def save_strategy_grid(images: dict, path, scale: float = 0.9) -> Path:
    """One row per strategy (its label on the left) of uint8 images [n, H, W, C] -> PNG at ``path``."""
    plt = _plt()
    n = max(len(v) for v in images.values())
    fig, axes = plt.subplots(len(images), n, figsize=(scale * n + 1.2, scale * len(images)), squeeze=False,
                             layout="constrained")
    for r, (label, imgs) in enumerate(images.items()):
        for c in range(n):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(imgs):
                img = imgs[c]
                ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=255)
            if c == 0:
                ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pareto_plot(df: pd.DataFrame, speed: str, fidelity: str, ax=None):
    """Speed (x) against fidelity (y) with interval bars, labels, and the Pareto front (``on_front``) joined."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    x, y = df[speed].to_numpy(float), df[fidelity].to_numpy(float)
    xerr = _err(df, speed)
    yerr = _err(df, fidelity)
    ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o", ms=4, lw=0.8, capsize=2)
    clipped = _clipped(df, speed) | _clipped(df, fidelity)
    for xi, yi, lab, clip in zip(x, y, df["label"], clipped):
        ax.annotate(f"{lab}*" if clip else lab, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if clipped.any():
        ax.annotate("* interval clipped to the metric's range", (1, 0), xycoords="axes fraction",
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="0.3")
    if "on_front" in df:
        front = df[df["on_front"]].sort_values(speed)
        ax.plot(front[speed], front[fidelity], "k--", lw=1, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set(xlabel=f"{speed} over full (x)", ylabel=f"{fidelity} vs full" if fidelity in
           ("token_mse", "token_cos", "psnr", "ssim") else fidelity, title="speed-quality trade-off")
    ax.grid(alpha=0.3)
    return ax


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
    """Mean shadow error per step and layer (mean over tokens, 95% CI over samples), with the refresh flag.

    ``var`` is a shadow variable with a layer dim (``dec_kv_err``, ``enc_kv_err``, ``*_resid_err``) or ``z_err``.
    """
    from ..analysis import aggregate
    if var not in ds:
        raise ValueError(f"shadow dataset has no {var!r}; expected one of {sorted(ds.data_vars)!r}")
    x = ds[var].sel(branch=branch).mean("token", skipna=True)              # [sample, step, (layer)]
    agg = aggregate(x, "sample").to_dataframe().reset_index()
    layer = next((d for d in x.dims if d.endswith("layer")), None)
    if layer is None:
        agg["layer"] = "z"
    else:
        agg = agg.rename(columns={layer: "layer"})
    refresh = ds["refresh"].any("sample").to_series()
    return agg.assign(refresh=agg["step"].map(refresh), var=var)


def shadow_error(data: pd.DataFrame, ax=None):
    """Shadow error against step, one line per layer, refresh steps marked: error grows between refreshes."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for layer, g in data.groupby("layer", sort=True):
        g = g.sort_values("step")
        line, = ax.plot(g["step"], g["mean"], marker="o", ms=2.5, lw=1, label=f"layer {layer}")
        ax.fill_between(g["step"], g["lo"], g["hi"], color=line.get_color(), alpha=0.2, lw=0)
    for step in data.loc[data["refresh"].astype(bool), "step"].unique():
        ax.axvline(step, color="0.6", lw=0.6, ls=":")
    ax.set(xlabel="step (dotted: full refresh)", ylabel=f"{data['var'].iloc[0]} (relative error vs full)",
           title="shadow error: what the strategy used vs fresh values")
    ax.legend(fontsize=7, ncol=2)
    return ax
