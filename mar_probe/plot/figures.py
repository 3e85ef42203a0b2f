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
from ._style import footnote, legend_beside, legend_outside
from .lint import declare_range

CI_NOTE = "shaded: 95% CI over samples (t-interval, clipped to the valid range)"


def _axes(ax, figsize=(7.8, 4.6)):
    import matplotlib.pyplot as plt
    import seaborn as sns
    sns.set_theme(style="whitegrid", context="notebook")
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _agg_frame(x: xr.DataArray, **kw) -> pd.DataFrame:
    """Per-sample values -> mean, lo, hi, n over samples as a flat frame (computes ``x`` once)."""
    agg = A.aggregate(x.drop_vars([c for c in x.coords if c not in x.dims]), "sample", **kw)
    if not agg.dims:
        return pd.DataFrame([{v: agg[v].item() for v in agg.data_vars}])
    return agg.to_dataframe(dim_order=list(agg["mean"].dims)).reset_index()  # not the coordinates' order (varies)


def _computed(obj):
    """``obj`` with its dask arrays computed in one pass (several outputs share their reads)."""
    return obj.compute() if hasattr(obj, "compute") else obj


def _band(ax, df, x, **kw):
    """One line with a shaded CI band per ``series`` of ``df`` (the line's label is the series name)."""
    for key, g in df.groupby("series", sort=False):
        g = g.sort_values(x)
        line, = ax.plot(g[x], g["mean"], marker="o", ms=3, label=str(key), **kw)
        ax.fill_between(g[x], g["lo"], g["hi"], color=line.get_color(), alpha=0.2, lw=0)


def require_var(ds, *names):
    """:func:`mar_probe.analysis.require` (missing variable -> the record flag that captures it)."""
    A.require(ds, *names)


# ---- LazyMAR Fig. 1 ------------------------------------------------------------------------------------
def lazymar_fig1_data(ds: xr.Dataset, var: str = "dec_resid_post", branch: str = "cond") -> pd.DataFrame:
    """Adjacent-step cosine of ``var`` per token category and step (mean over tokens and layers, CI over samples)."""
    A.require(ds, var)
    cos = A.cosine_stability(ds[var].sel(branch=branch, drop=True))
    summ = A.summarize_stability(cos, A.token_categories(ds), dim=("token", "layer"))
    df = _agg_frame(_computed(summ["mean"]), bounds=(-1, 1))
    return df.assign(var=var, series=df["category"]).dropna(subset=["mean"])


def lazymar_fig1(data: pd.DataFrame, ax=None):
    """LazyMAR Fig. 1: how similar each token category's features are to the previous step."""
    ax = _axes(ax)
    _band(ax, data, "step")
    var = data["var"].iloc[0] if len(data) else "?"
    ax.set(xlabel="decoding step s", ylabel=f"cos({var}[s], {var}[s-1])",
           title="Token redundancy: adjacent-step cosine by token category")
    declare_range(ax, -1, 1)
    legend_beside(ax, title="token\n(t = generated now)", title_fontsize="small")
    footnote(ax, CI_NOTE)
    return ax


# ---- LazyMAR Fig. 2 ------------------------------------------------------------------------------------
def lazymar_fig2_data(ds: xr.Dataset, var: str = "z") -> pd.DataFrame:
    """Adjacent-step MSE of the cond and uncond outputs and their residual, per step (CI over samples).

    Rows with ``quantity`` cond / uncond / residual (left axis) and ratio_cond = cond / residual (right axis) per
    step, and two rows without a step (the figure's title): ``ratio_cond_overall``, per sample the
    step-averaged cond MSE over the step-averaged residual MSE, and ``ratio_cond_median_step``, per sample the
    median over steps of the per-step ratio.
    """
    mse = _computed(A.cfg_residual_mse(ds, var=var))
    pos = (0, np.inf)
    parts = [_agg_frame(mse[q], bounds=pos).assign(quantity=q) for q in ("cond", "uncond", "residual", "ratio_cond")]
    mean = mse[["cond", "residual"]].mean("step", skipna=True)
    parts.append(_agg_frame(mean["cond"] / mean["residual"], bounds=pos).assign(quantity="ratio_cond_overall"))
    median = mse["ratio_cond"].median("step", skipna=True)
    parts.append(_agg_frame(median, bounds=pos).assign(quantity="ratio_cond_median_step"))
    df = pd.concat(parts, ignore_index=True)
    return df.assign(series=df["quantity"], var=var)


def lazymar_fig2(data: pd.DataFrame, ax=None):
    """LazyMAR Fig. 2: the CFG residual changes far less between steps than either branch (log scale).

    Left axis: adjacent-step MSE of cond, uncond and residual; right axis (dashed): their ratio cond / residual,
    with LazyMAR's reported 35.5x dotted.
    """
    ax = _axes(ax)
    _band(ax, data[data["quantity"].isin(["cond", "uncond", "residual"])], "step")
    ax.set_yscale("log")
    ax.set(xlabel="decoding step s", ylabel="MSE between step s and s-1")
    declare_range(ax, 0, None)
    right = declare_range(ax.twinx(), 0, None)
    right.grid(False)
    _band(right, data[data["quantity"] == "ratio_cond"], "step", color="0.3", ls="--")
    right.axhline(35.5, color="0.3", ls=":", lw=1, label="LazyMAR: 35.5x")
    right.set_yscale("log")
    right.set_ylabel("ratio cond / residual (dashed)")
    o = data[data["quantity"] == "ratio_cond_overall"].iloc[0]
    m = data[data["quantity"] == "ratio_cond_median_step"].iloc[0]
    ax.set_title(f"Condition redundancy: residual {o['mean']:.1f}x [{o['lo']:.1f}, {o['hi']:.1f}] more stable than "
                 f"cond\n(step-averaged MSEs; median per-step ratio {m['mean']:.1f}x [{m['lo']:.1f}, {m['hi']:.1f}])",
                 fontsize="medium")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    legend_outside(ax.figure, lines[0] + more[0], lines[1] + more[1], title="output", loc="outside lower center",
                   ncol=3)
    footnote(ax, CI_NOTE + "; title: 95% CIs")
    return ax


# ---- MARché Fig. 1, 10, 11 -----------------------------------------------------------------------------
def cosine_map_data(ds: xr.Dataset, var: str = "dec_k", pairs=((4, 5),), layers=(1,), sample: int | None = None,
                    branch: str = "cond", threshold: float = 0.95) -> pd.DataFrame:
    """Cosine of ``var`` between step pairs (s0, s1) per image token, at ``layers``, for one sample.

    Each row is one token of the map of ``sample`` (default: the first); the columns ``share_mean``,
    ``share_lo``, ``share_hi``, ``share_n`` hold, for its (pair, layer) panel, the share of image tokens with
    cosine > ``threshold`` averaged over all samples with its 95% CI (the panel's title).
    """
    A.require(ds, var)
    x = ds[var].sel(branch=branch, drop=True) if "branch" in ds[var].dims else ds[var]
    A.check_values(x, "layer", list(layers))
    if sample is not None:
        A.check_values(x, "sample", sample)
    frames = []
    for s0, s1 in pairs:
        A.check_values(x, "step", [s0, s1])
        pair = x.sel(step=[s0, s1], layer=list(layers)).assign_coords(step=[0, s1 - s0])
        cos = _computed(A.cosine_stability(pair, lag=s1 - s0).isel(step=0, drop=True))  # [sample, layer, token]
        img = cos.sel(token=cos["row"] >= 0)
        share = _agg_frame((img > threshold).where(img.notnull()).mean("token"), bounds=(0, 1))
        share = share.rename(columns={c: f"share_{c}" for c in ("mean", "lo", "hi", "n")})
        one = img.isel(sample=0) if sample is None else img.sel(sample=sample)
        df = one.drop_vars([c for c in one.coords if c not in ("layer", "token", "row", "col")]).rename("cos")
        df = df.to_dataframe().reset_index().merge(share, on="layer")
        frames.append(df.assign(step_from=s0, step_to=s1, sample=int(one["sample"])))
    df = pd.concat(frames, ignore_index=True)
    cols = ["step_from", "step_to", "layer", "sample", "token", "row", "col", "cos", "share_mean", "share_lo",
            "share_hi", "share_n"]
    return df[cols].assign(var=var, threshold=threshold).reset_index(drop=True)


def _cos_map(ax, g, vmin):
    grid = g.pivot(index="row", columns="col", values="cos").values
    return ax.imshow(grid, vmin=vmin, vmax=1, cmap="viridis")


def _share_text(r) -> str:
    return (f"cos>{r['threshold']:g}: {r['share_mean']:.0%} [{r['share_lo']:.0%}, {r['share_hi']:.0%}] "
            f"of {int(r['share_n'])} samples")


def marche_fig1(data: pd.DataFrame, ax=None):
    """MARché Fig. 1: K cosine between two steps at one layer on the token grid (bright = unchanged)."""
    ax = _axes(ax, (4.8, 5.8))
    ax.grid(False)
    r = data.iloc[0]
    im = _cos_map(ax, data, min(0.8, float(np.nanmin(data["cos"]))))
    ax.figure.colorbar(im, ax=ax, label="cosine similarity", location="bottom", shrink=0.8)
    ax.set_title(f"{r['var']} cosine, step {r['step_from']}->{r['step_to']}\nlayer {r['layer']}, sample "
                 f"{r['sample']}", fontsize="small")
    ax.set(xlabel="token column", ylabel="token row")
    footnote(ax, f"{_share_text(r)} (95% CI)")
    return ax


def marche_cos_grid(data: pd.DataFrame, axes=None, title=""):
    """Cosine maps on a grid: one row per step pair, one column per layer (MARché Figs. 10 and 11)."""
    import matplotlib.pyplot as plt
    pairs = data[["step_from", "step_to"]].drop_duplicates().values.tolist()
    layers = sorted(data["layer"].unique())
    if axes is None:
        _axes(None)
        plt.close()
        _, axes = plt.subplots(len(pairs), len(layers), figsize=(2.4 * len(layers) + 1, 2.5 * len(pairs) + 0.8),
                               squeeze=False, layout="constrained")
    vmin = min(0.8, float(np.nanmin(data["cos"])))
    for i, (s0, s1) in enumerate(pairs):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            g = data[(data["step_from"] == s0) & (data["layer"] == layer)]
            im = _cos_map(ax, g, vmin)
            r = g.iloc[0]
            ax.set_title(f"step {s0}->{s1}, layer {layer}\n{r['share_mean']:.0%} "
                         f"[{r['share_lo']:.0%}, {r['share_hi']:.0%}] > {r['threshold']:g}", fontsize="x-small")
            ax.set(xticks=[], yticks=[])
            ax.grid(False)
    axes[0][0].figure.colorbar(im, ax=axes, label="cosine similarity", shrink=0.8)
    r = data.iloc[0]
    axes[0][0].figure.suptitle(f"{title}\nmaps: sample {r['sample']}\npanel titles: share of tokens with "
                               f"cosine > {r['threshold']:g},\nmean [95% CI] over {int(r['share_n'])} samples",
                               fontsize="small")
    return axes


def marche_fig10(data: pd.DataFrame, axes=None):
    """MARché Fig. 10: key cosine across step pairs and layers (most tokens stay near 1)."""
    return marche_cos_grid(data, axes, "K cosine between steps\n(rows: step pairs, columns: layers)")


def marche_fig11(data: pd.DataFrame, axes=None):
    """MARché Fig. 11: value cosine across step pairs and layers (V is somewhat more dynamic than K)."""
    return marche_cos_grid(data, axes, "V cosine between steps\n(rows: step pairs, columns: layers)")


# ---- MARché Fig. 12 and selection vs drift -------------------------------------------------------------
def _default_k(ds) -> int:
    return max(1, min(64, int((ds["row"] >= 0).sum()) // 4))


def marche_fig12_data(ds: xr.Dataset, k: int | None = None, ref_layer: int = 1) -> pd.DataFrame:
    """Overlap of each layer's top-K attended tokens with ``ref_layer``'s, per step (CI over samples).

    ``chance`` is the overlap of two random top-K sets, K / N with N the tokens ranked at that step (the
    non-generating ones, mean over samples). ``k`` defaults to 64 (MARché's budget), or a quarter of the image
    tokens when that is smaller.
    """
    A.require(ds, "attn_gen")
    k = k or _default_k(ds)
    ov = _computed(A.topk_overlap_layers(ds, k=k, ref_layer=ref_layer))
    df = _agg_frame(ov, bounds=(0, 1))
    attn = ds["attn_gen"].sel(branch="cond", drop=True) if "branch" in ds["attn_gen"].dims else ds["attn_gen"]
    eligible = (attn.sel(layer=ref_layer, drop=True).notnull() & ~ds["pred"]).sum("token").mean("sample")
    chance = np.minimum(1.0, k / _computed(eligible).to_series().clip(lower=1))
    return df.assign(k=k, ref_layer=ref_layer, series=[f"layer {v}" for v in df["layer"]],
                     chance=df["step"].map(chance).to_numpy())


def marche_fig12(data: pd.DataFrame, ax=None):
    """MARché Fig. 12: how far each layer's top-K attended tokens agree with the selection layer's."""
    ax = _axes(ax)
    _band(ax, data, "step")
    k, ref = data["k"].iloc[0], data["ref_layer"].iloc[0]
    if "chance" in data:
        chance = data.drop_duplicates("step").sort_values("step")
        ax.plot(chance["step"], chance["chance"], color="k", ls="--", lw=1, label="chance (K/N)")
    ax.set(xlabel="decoding step", ylabel=f"|top-{k}(layer) ∩ top-{k}(layer {ref})| / {k}", ylim=(0, 1.05),
           title=f"Top-{k} attention overlap with layer {ref}\n(attention from the generating tokens)")
    declare_range(ax, 0, 1)
    legend_beside(ax)
    footnote(ax, CI_NOTE + "; layers 0-based (MARché's Layer 2 = layer 1); chance: two random top-K sets of the "
                 "N tokens ranked at that step")
    return ax


def selection_vs_drift_data(ds: xr.Dataset, var: str = "dec_k", layer: int = 1, lazymar_layer: int | None = None,
                            k=None) -> pd.DataFrame:
    """Precision of attention-selected (and LazyMAR V-cosine-selected) tokens against the top-K drift of ``var``.

    The drifting set at each later layer is the top-K candidate tokens (:data:`~mar_probe.analysis.CANDIDATES`)
    by ``1 - cos`` of ``var`` to the previous step, so precision = recall = overlap / K (and the Jaccard index,
    p / (2 - p), adds nothing). Per sample the precision is averaged over steps, then a CI over samples is
    taken. ``lazymar_layer`` defaults to ``layer`` (LazyMAR prunes at index 3 of MAR-B's 12 decoder layers, a
    quarter of the depth); the random baseline is K / N with N the candidates of each step.
    """
    A.require(ds, var, "attn_gen")
    n_img = int((ds["row"] >= 0).sum())
    k = k or sorted({max(1, n_img * f // 64) for f in (2, 4, 8, 16, 32)})
    actual = A.drift(ds[var].sel(branch="cond", drop=True))
    A.check_values(actual, "layer", layer)
    later = actual.sel(layer=actual["layer"] > layer)
    if later.sizes["layer"] == 0:
        raise ValueError(f"no {var} layer after the selection layer {layer!r}; the store has layer "
                         f"{actual['layer'].values.tolist()!r}")
    cats = A.token_categories(ds)
    selectors = {f"attention@layer {layer}": A.attention_selector(ds, layer)}
    if "dec_v" in ds.data_vars:
        lz = layer if lazymar_layer is None else lazymar_layer
        selectors[f"LazyMAR V-cos@layer {lz}"] = A.lazymar_selector(ds, lz)
    out = {name: A.selection_vs_drift(sel, later, cats, k=k)[["precision", "random_precision"]].mean("step")
           for name, sel in selectors.items()}
    out = _computed(xr.concat(list(out.values()), dim=pd.Index(list(out), name="selector")))
    df = _agg_frame(out["precision"], bounds=(0, 1))
    df["series"] = df["selector"] + " vs drift@layer " + df["layer"].astype(str)
    rnd = _agg_frame(out["random_precision"].isel(selector=0, layer=0, drop=True), bounds=(0, 1))
    rnd = rnd.assign(selector="random", layer=np.nan, series="random (K/N)")
    return pd.concat([df, rnd], ignore_index=True).assign(var=var, metric="precision")


def selection_vs_drift(data: pd.DataFrame, ax=None):
    """Does the refresh selection find the tokens whose K/V drift? Precision (= recall) vs K, with chance."""
    ax = _axes(ax)
    _band(ax, data[data["selector"] != "random"], "k")
    _band(ax, data[data["selector"] == "random"], "k", color="k", ls="--")
    ax.set(xlabel="K (refresh budget)", ylabel=f"precision = recall vs top-K drift of {data['var'].iloc[0]}",
           ylim=(0, 1.05), title="Selected tokens vs tokens that actually drift")
    declare_range(ax, 0, 1)
    legend_beside(ax, fontsize="x-small")
    footnote(ax, CI_NOTE + "; layers 0-based")
    return ax
