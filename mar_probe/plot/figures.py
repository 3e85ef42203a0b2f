"""The figures of the redundancy papers (LazyMAR, MARché) and a selection-vs-drift figure, from a recorded run.

Every figure has two functions: ``NAME_data(ds, ...)`` computes a tidy :class:`pandas.DataFrame` of exactly
the values plotted (the CSV written by ``mar-probe figures``), and ``NAME(data, ax=None)`` draws it. Error
bars are confidence intervals over samples (and seeds, a coordinate of ``sample``). Layers and steps are the
store's 0-based coordinates; the papers count layers from 1 (MARché's "Layer 2" is layer 1 here).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from .. import analysis as A

CI_NOTE = "shaded: 95% CI over samples"


def _axes(ax, figsize=(6.4, 4.2)):
    import matplotlib.pyplot as plt
    import seaborn as sns
    sns.set_theme(style="whitegrid", context="notebook")
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _agg_frame(x: xr.DataArray, **kw) -> pd.DataFrame:
    """Per-sample values -> mean, lo, hi, n over samples as a flat frame."""
    agg = A.aggregate(x.drop_vars([c for c in x.coords if c not in x.dims]), "sample", **kw)
    return agg.to_dataframe().reset_index()


def _band(ax, df, x, hue, label_fmt="{}", **kw):
    for key, g in df.groupby(hue, sort=False):
        g = g.sort_values(x)
        line, = ax.plot(g[x], g["mean"], marker="o", ms=3, label=label_fmt.format(key), **kw)
        ax.fill_between(g[x], g["lo"], g["hi"], color=line.get_color(), alpha=0.2, lw=0)


def require_var(ds, *names):
    """:func:`mar_probe.analysis.require` (missing variable -> the record flag that captures it)."""
    A.require(ds, *names)


def _layer(ds, layer, var="dec_k"):
    layers = [int(v) for v in ds[var]["layer"].values]
    return layer if layer in layers else layers[min(1, len(layers) - 1)]


# ---- LazyMAR Fig. 1 ------------------------------------------------------------------------------------
def lazymar_fig1_data(ds: xr.Dataset, var: str = "dec_resid_post", branch: str = "cond") -> pd.DataFrame:
    """Adjacent-step cosine of ``var`` per token category and step (mean over tokens and layers, CI over samples)."""
    A.require(ds, var)
    cos = A.cosine_stability(ds[var].sel(branch=branch, drop=True))
    summ = A.summarize_stability(cos, A.token_categories(ds), dim=("token", "layer"))
    df = _agg_frame(summ["mean"])
    return df.assign(var=var).dropna(subset=["mean"])


def lazymar_fig1(data: pd.DataFrame, ax=None):
    """LazyMAR Fig. 1: how similar each token category's features are to the previous step."""
    ax = _axes(ax)
    _band(ax, data, "step", "category")
    var = data["var"].iloc[0] if len(data) else "?"
    ax.set(xlabel="decoding step s", ylabel=f"cos({var}[s], {var}[s-1])",
           title="Token redundancy: adjacent-step cosine by token category")
    ax.legend(title="token (t = generated now)", fontsize="small")
    ax.text(0.01, 0.01, CI_NOTE, transform=ax.transAxes, fontsize="x-small")
    return ax


# ---- LazyMAR Fig. 2 ------------------------------------------------------------------------------------
def lazymar_fig2_data(ds: xr.Dataset, var: str = "z") -> pd.DataFrame:
    """Adjacent-step MSE of the cond and uncond outputs and their residual, per step (CI over samples)."""
    mse = A.cfg_residual_mse(ds, var=var)
    parts = [_agg_frame(mse[q]).assign(quantity=q) for q in ("cond", "uncond", "residual", "ratio_cond")]
    return pd.concat(parts, ignore_index=True)


def lazymar_fig2(data: pd.DataFrame, ax=None):
    """LazyMAR Fig. 2: the CFG residual changes far less between steps than either branch (log scale)."""
    ax = _axes(ax)
    _band(ax, data[data["quantity"] != "ratio_cond"], "step", "quantity")
    ratio = data[data["quantity"] == "ratio_cond"]["mean"].mean()
    ax.set_yscale("log")
    ax.set(xlabel="decoding step s", ylabel="MSE between step s and s-1",
           title=f"Condition redundancy: residual {ratio:.1f}x more stable than cond (mean over steps)")
    ax.legend(title="output", fontsize="small")
    return ax


# ---- MARché Fig. 1, 10, 11 -----------------------------------------------------------------------------
def cosine_map_data(ds: xr.Dataset, var: str = "dec_k", pairs=((4, 5),), layers=(1,), sample: int | None = None,
                    branch: str = "cond") -> pd.DataFrame:
    """Cosine of ``var`` between step pairs (s0, s1) per image token, at ``layers``, for one sample."""
    A.require(ds, var)
    x = ds[var].sel(branch=branch, drop=True).isel(sample=0) if sample is None else ds[var].sel(
        branch=branch, sample=sample, drop=True)
    A.check_values(x, "layer", list(layers))
    frames = []
    for s0, s1 in pairs:
        A.check_values(x, "step", [s0, s1])
        pair = x.sel(step=[s0, s1], layer=list(layers)).assign_coords(step=[0, s1 - s0])
        cos = A.cosine_stability(pair, lag=s1 - s0).isel(step=0, drop=True).compute()
        df = cos.rename("cos").to_dataframe().reset_index()
        frames.append(df.assign(step_from=s0, step_to=s1))
    df = pd.concat(frames, ignore_index=True)
    df = df[df["row"] >= 0][["step_from", "step_to", "layer", "token", "row", "col", "cos"]]
    return df.assign(var=var).reset_index(drop=True)


def _cos_map(ax, g, vmin):
    grid = g.pivot(index="row", columns="col", values="cos").values
    return ax.imshow(grid, vmin=vmin, vmax=1, cmap="viridis")


def marche_fig1(data: pd.DataFrame, ax=None):
    """MARché Fig. 1: K cosine between two steps at one layer on the token grid (bright = unchanged)."""
    ax = _axes(ax, (4.8, 4.2))
    ax.grid(False)
    r = data.iloc[0]
    im = _cos_map(ax, data, min(0.8, float(np.nanmin(data["cos"]))))
    ax.figure.colorbar(im, ax=ax, label="cosine similarity")
    ax.set(title=f"{r['var']} cosine, step {r['step_from']}->{r['step_to']}, layer {r['layer']}",
           xlabel="token column", ylabel="token row")
    return ax


def marche_cos_grid(data: pd.DataFrame, axes=None, title=""):
    """Cosine maps on a grid: one row per step pair, one column per layer (MARché Figs. 10 and 11)."""
    import matplotlib.pyplot as plt
    pairs = data[["step_from", "step_to"]].drop_duplicates().values.tolist()
    layers = sorted(data["layer"].unique())
    if axes is None:
        _axes(None)
        plt.close()
        _, axes = plt.subplots(len(pairs), len(layers), figsize=(2.2 * len(layers) + 1, 2.2 * len(pairs) + 0.6),
                               squeeze=False, layout="constrained")
    vmin = min(0.8, float(np.nanmin(data["cos"])))
    for i, (s0, s1) in enumerate(pairs):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            g = data[(data["step_from"] == s0) & (data["layer"] == layer)]
            im = _cos_map(ax, g, vmin)
            ax.set(xticks=[], yticks=[], title=f"step {s0}->{s1}, layer {layer}")
            ax.grid(False)
    axes[0][0].figure.colorbar(im, ax=axes, label="cosine similarity", shrink=0.8)
    axes[0][0].figure.suptitle(title, fontsize="medium")
    return axes


def marche_fig10(data: pd.DataFrame, axes=None):
    """MARché Fig. 10: key cosine across step pairs and layers (most tokens stay near 1)."""
    return marche_cos_grid(data, axes, "K cosine between steps\n(rows: step pairs, columns: layers)")


def marche_fig11(data: pd.DataFrame, axes=None):
    """MARché Fig. 11: value cosine across step pairs and layers (V is somewhat more dynamic than K)."""
    return marche_cos_grid(data, axes, "V cosine between steps\n(rows: step pairs, columns: layers)")


# ---- MARché Fig. 12 and selection vs drift -------------------------------------------------------------
def marche_fig12_data(ds: xr.Dataset, k: int | None = None, ref_layer: int = 1) -> pd.DataFrame:
    """Overlap of each layer's top-K attended tokens with ``ref_layer``'s, per step (CI over samples)."""
    A.require(ds, "attn_gen")
    k = k or max(1, min(64, ds.sizes["token"] // 8))
    ref_layer = _layer(ds, ref_layer, "attn_gen")
    ov = A.topk_overlap_layers(ds, k=k, ref_layer=ref_layer)
    return _agg_frame(ov).assign(k=k, ref_layer=ref_layer)


def marche_fig12(data: pd.DataFrame, ax=None):
    """MARché Fig. 12: how far each layer's top-K attended tokens agree with the selection layer's."""
    ax = _axes(ax)
    _band(ax, data, "step", "layer", "layer {}")
    k, ref = data["k"].iloc[0], data["ref_layer"].iloc[0]
    ax.set(xlabel="decoding step", ylabel=f"|top-{k}(layer) ∩ top-{k}(layer {ref})| / {k}", ylim=(0, 1.05),
           title=f"Top-{k} attention overlap with layer {ref} (from generating tokens)")
    ax.legend(fontsize="small")
    return ax


def selection_vs_drift_data(ds: xr.Dataset, var: str = "dec_k", layer: int = 1, lazymar_layer: int = 2,
                            k=None) -> pd.DataFrame:
    """Precision of attention-selected (and LazyMAR V-cosine-selected) tokens against top-K drift of ``var``."""
    A.require(ds, var, "attn_gen")
    n_img = int((ds["row"] >= 0).sum())
    k = k or sorted({max(1, n_img * f // 64) for f in (2, 4, 8, 16, 32)})
    layer = _layer(ds, layer, "attn_gen")
    actual = A.drift(ds[var].sel(branch="cond", drop=True))
    later = actual.sel(layer=actual["layer"] >= min(layer + 1, int(actual["layer"].max())))
    cats = A.token_categories(ds)
    frames = [_sel_frame(A.attention_selector(ds, layer), later, cats, k, f"attention@layer {layer}")]
    if "dec_v" in ds.data_vars:
        lz = _layer(ds, lazymar_layer, "dec_v")
        frames.append(_sel_frame(A.lazymar_selector(ds, lz), later, cats, k, f"LazyMAR V-cos@layer {lz}"))
    return pd.concat(frames, ignore_index=True).assign(var=var)


def _sel_frame(selector, actual, cats, k, name) -> pd.DataFrame:
    out = A.selection_vs_drift(selector, actual, cats, k=k)
    per_sample = out[["precision", "jaccard", "random_precision"]].mean("step")
    frames = [_agg_frame(per_sample[m]).assign(metric=m) for m in per_sample.data_vars]
    return pd.concat(frames, ignore_index=True).assign(selector=name)


def selection_vs_drift(data: pd.DataFrame, ax=None):
    """Does the refresh selection find the tokens whose K/V drift? Precision (= recall) vs K, with chance."""
    ax = _axes(ax)
    prec = data[data["metric"] == "precision"].copy()
    prec["series"] = prec["selector"] + " vs drift@layer " + prec["layer"].astype(str)
    _band(ax, prec, "k", "series")
    rnd = data[(data["metric"] == "random_precision")].groupby("k")["mean"].mean()
    ax.plot(rnd.index, rnd.values, "k--", label="random (K/N)")
    ax.set(xlabel="K (refresh budget)", ylabel=f"precision = recall vs top-K drift of {data['var'].iloc[0]}",
           ylim=(0, 1.05), title="Selected tokens vs tokens that actually drift")
    ax.legend(fontsize="x-small")
    return ax
