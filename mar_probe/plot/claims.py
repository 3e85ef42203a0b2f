"""Figures of LazyMAR's two redundancy claims as :mod:`mar_probe.analysis.claims` measures them.

* ``lazymar_skippable``: the share of the tokens LazyMAR's token cache could skip whose V cosine to the previous step
  exceeds a threshold, against the threshold, with LazyMAR's ~84% (:func:`skippable_data`, :func:`skippable_plot`);
* ``lazymar_residual_lags``: how many times less the CFG residual changes than the branch outputs at lags 1..8, one
  line per estimator, all tokens and the tokens the head reads, with LazyMAR's 35.5x (:func:`residual_ratio_data`,
  :func:`residual_ratio_plot`).

As in :mod:`mar_probe.plot.figures`, ``*_data`` returns a tidy frame of exactly the plotted values (the CSV that
``mar-probe figures`` writes) and the plot function draws it; bands are 95% intervals over samples, clipped to the
quantity's range ([0, 1] for fractions, [0, inf) for ratios).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
import pandas as pd
import xarray as xr

from ..analysis import claims as C

BAND_LABEL = "95% t-interval over samples"


def _style():
    import seaborn as sns
    sns.set_theme(style="whitegrid", context="notebook")


def _frame(agg: xr.Dataset) -> pd.DataFrame:
    agg = agg.drop_vars([c for c in agg.coords if c not in agg.dims])
    return agg.to_dataframe(dim_order=list(agg["mean"].dims)).reset_index()


# ---- skippable tokens vs threshold ------------------------------------------------------------------------------
def skippable_data(ds: xr.Dataset, thresholds: Iterable[float] = C.SWEEP_THRESHOLDS, layer: int | None = None,
                   var: str = "dec_v") -> pd.DataFrame:
    """:func:`~mar_probe.analysis.claims.skippable_sweep` as a frame: one row per threshold (mean, lo, hi, n).

    ``layer`` defaults to :func:`~mar_probe.analysis.claims.default_prune_layer` (3, the released code's, when
    recorded).
    """
    layer = C.default_prune_layer(ds, var) if layer is None else layer
    df = _frame(C.skippable_sweep(ds, thresholds, layer=layer, var=var))
    return df.assign(layer=layer, var=var, series="skippable", reference=C.LAZYMAR_SKIPPABLE)


def skippable_plot(data: pd.DataFrame, ax=None):
    """Share of skippable candidate tokens (%) against the V-cosine threshold, with LazyMAR's ~84%."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter
    _style()
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 5.0), layout="constrained")
    g = data.sort_values("threshold")
    n = int(g["n"].max()) if len(g) else 0
    line, = ax.plot(g["threshold"], g["mean"], marker="o", ms=4, label=f"mean over samples (n={n})")
    ax.fill_between(g["threshold"], g["lo"], g["hi"], color=line.get_color(), alpha=0.2, lw=0, label=BAND_LABEL)
    ax.axhline(C.LAZYMAR_SKIPPABLE, color="0.3", ls=":", lw=1.2, label=f"LazyMAR: ~{C.LAZYMAR_SKIPPABLE:.0%} skipped")
    if len(g) and (g["threshold"] > 0).all() and (g["threshold"] < 1).all():
        ax.set_xscale("logit")                                    # thresholds crowd towards 1
        ax.set_xticks(g["threshold"], [f"{t:g}" for t in g["threshold"]], fontsize="small")
        ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    layer = int(g["layer"].iloc[0]) if len(g) else "?"
    var = g["var"].iloc[0] if len(g) else "V"
    ax.set(xlabel="cosine threshold (skippable: cos(V[s], V[s-1]) > threshold; unitless)",
           ylabel="skippable tokens (% of candidates)")
    ax.set_title(f"Token redundancy by LazyMAR's criterion ({var}, layer {layer})\ncandidates: all rows but the "
                 "generating and just-decoded tokens", fontsize="medium")
    ax.figure.legend(loc="outside lower center", ncols=2, fontsize="small")
    return ax


# ---- CFG residual ratio vs lag ----------------------------------------------------------------------------------
def residual_ratio_data(ds: xr.Dataset, lags: Iterable[int] = C.LAGS, tokens=C.TOKEN_SETS,
                        var: str = "z") -> pd.DataFrame:
    """:func:`~mar_probe.analysis.claims.cfg_residual_ratio` per token set, estimator and lag as one frame.

    Lags without a stored step pair are left out (a 6-step run has lags 1..5); ``n_inf`` counts samples whose ratio
    is infinite (a residual that did not change), which the figure cannot draw on its log axis and notes instead.
    """
    import dask
    use = C.available_lags(ds, lags)
    if not use:
        raise ValueError(f"no lag of {list(lags)!r} has a stored step pair; the store has step "
                         f"{ds['step'].values.tolist()!r}")
    parts = [C.cfg_residual_ratio_per_sample(ds, use, C.ESTIMATORS, t, var=var) for t in tokens]
    values = dask.compute(*parts)
    frames = [_frame(C.aggregate_ratio(v)).assign(tokens=t) for t, v in zip(tokens, values)]
    df = pd.concat(frames, ignore_index=True)
    return df.assign(series=df["estimator"], var=var, reference=C.LAZYMAR_RATIO)


TOKEN_TITLES = {"all": "all tokens", "head": "tokens the head reads (generating at s)"}


def residual_ratio_plot(data: pd.DataFrame, axes=None):
    """Ratio of the branch outputs' lag-MSE to the CFG residual's against the lag, one panel per token set (log y)."""
    import matplotlib.pyplot as plt
    _style()
    sets = list(dict.fromkeys(data["tokens"]))
    if axes is None:
        fig, axes = plt.subplots(1, len(sets), figsize=(4.6 * len(sets) + 2.4, 4.4), sharey=True, squeeze=False,
                                 layout="constrained")
    else:
        axes = np.atleast_2d(axes)
        fig = axes[0][0].figure
    notes = []
    finite = data[np.isfinite(data["mean"].to_numpy(float))]
    low = finite["mean"].to_numpy(float)
    high = np.concatenate([finite["hi"][np.isfinite(finite["hi"])].to_numpy(float), [C.LAZYMAR_RATIO]])
    floor = low.min() / 3 if len(low) and low.min() > 0 else C.LAZYMAR_RATIO / 100
    for ax, t in zip(axes[0], sets):
        for est, g in data[data["tokens"] == t].groupby("estimator", sort=False):
            g = g.sort_values("lag")
            ok = np.isfinite(g["mean"].to_numpy(float))
            line, = ax.plot(g["lag"][ok], g["mean"][ok], marker="o", ms=4, label=est if t == sets[0] else None)
            band = ok & np.isfinite(g["hi"].to_numpy(float))
            lo = np.maximum(g["lo"][band], floor)       # display only: an interval down to 0 meets the log axis floor
            ax.fill_between(g["lag"][band], lo, g["hi"][band], color=line.get_color(), alpha=0.15, lw=0)
            if (~ok).any():
                notes.append(f"{TOKEN_TITLES.get(t, t)}, {est}: infinite at lag "
                             f"{g['lag'][~ok].astype(int).tolist()} (residual unchanged)")
        ax.axhline(C.LAZYMAR_RATIO, color="0.3", ls=":", lw=1.2,
                   label=f"LazyMAR: {C.LAZYMAR_RATIO:g}x" if t == sets[0] else None)
        ax.set_yscale("log")
        ax.set_ylim(floor, high.max() * 1.5)
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, 50: readable ratios
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())   # minor log labels (3x10^1, 4x10^1) collide: the lint found it
        ax.set_xticks(sorted(data["lag"].unique()))
        ax.set(xlabel="lag L (steps between s - L and s)", title=TOKEN_TITLES.get(t, t))
    axes[0][0].set_ylabel("MSE ratio, branches / residual (x)")
    n = int(data["n"].max() + data["n_inf"].max()) if len(data) else 0
    handles, labels = axes[0][0].get_legend_handles_labels()
    from matplotlib.patches import Patch
    handles.append(Patch(color="0.5", alpha=0.3))
    labels.append(BAND_LABEL + " (down to the floor: includes 0)")
    fig.legend(handles, labels, loc="outside lower center", ncols=3, title=f"estimator (n={n} samples)",
               fontsize="small")
    fig.suptitle("Condition redundancy vs staleness: MSE(x[s] - x[s-L]) of the CFG branch outputs over that of "
                 "their residual cond - uncond"
                 + ("\n" + "; ".join(notes) if notes else ""), fontsize="medium")
    return axes
