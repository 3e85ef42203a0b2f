"""One table of a run's redundancy measurements, each with its confidence interval over samples.

:func:`run_summary` computes, in one streaming pass over the store, the numbers behind the papers' claims:

* ``stability``: share of tokens whose K / V / hidden state has cosine > ``threshold`` to the previous step, per
  layer and token category, and the mean cosine per category (LazyMAR Fig. 1: does t-1 drift most?);
* ``cfg``: adjacent-step MSE of the conditional and unconditional outputs and their residual, and the ratios:
  of the step-averaged MSEs, and the median over steps of the per-step ratio (LazyMAR Fig. 2 reports the
  residual about 35.5x more stable);
* ``selection``: how well the attention of the generating tokens at ``layer`` (MARché) and LazyMAR's V-cosine
  criterion find the tokens whose K drifts at each later layer, against chance;
* ``overlap``: top-K attention overlap of each layer with ``layer`` (MARché reports 66.8% for its Layer 2);
* with ``claims=True`` (``mar-probe analyze --claims``, :mod:`~mar_probe.analysis.claims`): ``skippable``, the share
  of the tokens LazyMAR's token cache could skip whose V cosine exceeds each threshold of a sweep (LazyMAR: ~84%),
  and ``cfg_lags``, the ratio of the branch outputs' lag-MSE to the CFG residual's at lags 1..8 for every
  estimator, over all tokens and over the tokens the head reads.

Every value is first reduced per sample (pooled over steps and tokens), then averaged over samples with a
t-interval (:func:`~mar_probe.analysis.aggregate`), clipped to the quantity's range (proportions to [0, 1]);
seeds are a coordinate of ``sample``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from ._checks import check_layer, check_values, require, require_completed
from .categories import token_categories
from .claims import (ESTIMATORS, SWEEP_THRESHOLDS, aggregate_ratio, available_lags, cfg_residual_ratio_per_sample,
                     default_prune_layer, skippable_sweep)
from .cfg import cfg_residual_mse
from .overlap import topk_overlap_layers
from .selection import attention_selector, lazymar_selector, selection_vs_drift
from .stability import cosine_stability, drift, summarize_stability
from .stats import aggregate

STABILITY_VARS = ("dec_k", "dec_v", "dec_resid_post")
COLUMNS = ("section", "quantity", "var", "layer", "category", "selector", "k", "threshold", "lag", "estimator", "mean",
           "lo", "hi", "n")
REPORTED_CATEGORIES = ("t", "t-1", "<t-1", ">t", "buffer")


def _cond(x: xr.DataArray, branch: str = "cond") -> xr.DataArray:
    check_values(x, "branch", branch)
    return x.sel(branch=branch, drop=True)


def _stability_parts(ds, cats, threshold: float, variables) -> dict:
    parts = {}
    for v in variables:
        cos = cosine_stability(_cond(ds[v]))
        by_layer = summarize_stability(cos, cats, dim=("token", "step"), thresholds=(threshold,),
                                       names=REPORTED_CATEGORIES)
        pooled = summarize_stability(cos, cats, dim=("token", "step", "layer"), thresholds=(threshold,),
                                     names=REPORTED_CATEGORIES)
        parts[("stability", f"share_cos>{threshold:g}", v, None)] = by_layer["share"].squeeze("threshold", drop=True)
        parts[("stability", "mean_cos", v, None)] = pooled["mean"]
        gap = pooled["mean"] - pooled["mean"].sel(category="t-1", drop=True)
        parts[("stability", "mean_cos_minus_t-1", v, None)] = gap.sel(category=gap["category"] != "t-1")
    return parts


def _cfg_parts(ds) -> dict:
    per_step = cfg_residual_mse(ds)
    mse = per_step.mean("step", skipna=True)
    out = {("cfg", f"mse_{q}", "z", None): mse[q] for q in ("cond", "uncond", "residual")}
    out[("cfg", "ratio_cond/residual", "z", None)] = mse["cond"] / mse["residual"]
    out[("cfg", "ratio_uncond/residual", "z", None)] = mse["uncond"] / mse["residual"]
    ratio = per_step["ratio_cond"]
    ratio = ratio.chunk({"step": -1}) if ratio.chunks is not None else ratio
    out[("cfg", "median_step_ratio_cond/residual", "z", None)] = ratio.median("step", skipna=True)
    return out


def _selectors(ds, layer: int, lazymar_layer: int | None) -> dict:
    sels = {f"attention@layer{layer}": attention_selector(ds, layer)}
    if "dec_v" in ds.data_vars:
        lz = layer if lazymar_layer is None else lazymar_layer
        sels[f"lazymar_vcos@layer{lz}"] = lazymar_selector(ds, lz)
    return sels


def _selection_parts(ds, cats, layer: int, lazymar_layer, k: int, threshold: float, var: str) -> dict:
    actual = drift(_cond(ds[var]))
    check_values(actual, "layer", layer)
    later = actual.sel(layer=actual["layer"] > layer)
    if later.sizes["layer"] == 0:
        raise ValueError(f"no {var} layer after the selection layer {layer!r}; the store has layer "
                         f"{actual['layer'].values.tolist()!r}")
    parts = {}
    for name, sel in _selectors(ds, layer, lazymar_layer).items():
        top = selection_vs_drift(sel, later, cats, k=[k]).squeeze("k", drop=True).mean("step", skipna=True)
        thr = selection_vs_drift(sel, later, cats, k=[k], threshold=1 - threshold).squeeze("k", drop=True)
        thr = thr.mean("step", skipna=True)
        parts[("selection", "precision_topk_drift", var, name)] = top["precision"]
        parts[("selection", f"precision_cos<{threshold:g}", var, name)] = thr["precision"]
        parts[("selection", f"recall_cos<{threshold:g}", var, name)] = thr["recall"]
    parts[("selection", "precision_topk_drift", var, "random")] = top["random_precision"]
    parts[("selection", f"precision_cos<{threshold:g}", var, "random")] = thr["random_precision"]
    parts[("selection", f"recall_cos<{threshold:g}", var, "random")] = thr["random_recall"]
    return parts


def _overlap_parts(ds, layer: int, k: int) -> dict:
    ov = topk_overlap_layers(ds, k=k, ref_layer=layer).mean("step", skipna=True)
    return {("overlap", f"topk_overlap_with_layer{layer}", "attn_gen", None): ov.sel(layer=ov["layer"] != layer)}


def _skippable_parts(ds, lazymar_layer, threshold) -> dict:
    lz = default_prune_layer(ds) if lazymar_layer is None else lazymar_layer
    thresholds = sorted(set(SWEEP_THRESHOLDS) | {threshold})
    return {("skippable", "share_skippable_vcos", "dec_v", None):
            skippable_sweep(ds, thresholds, layer=[lz], per_sample=True)}


def _cfg_lag_parts(ds) -> dict:
    lags = available_lags(ds)
    return {("cfg_lags", f"ratio_branches/residual_{tokens}_tokens", "z", None):
            cfg_residual_ratio_per_sample(ds, lags, ESTIMATORS, tokens) for tokens in ("all", "head")}


def _sections(ds, *, layer, lazymar_layer, k, threshold, variables, var, claims=False) -> tuple[dict, dict]:
    """Lazy per-sample parts of every section that the store allows; skipped sections with the reason."""
    cats = token_categories(ds)
    builders = {
        "stability": lambda: _stability_parts(ds, cats, threshold, _present(ds, variables)),
        "cfg": lambda: _cfg_parts(ds),
        "selection": lambda: _selection_parts(ds, cats, layer, lazymar_layer, k, threshold, var),
        "overlap": lambda: _overlap_parts(ds, layer, k),
    }
    if claims:
        builders["skippable"] = lambda: _skippable_parts(ds, lazymar_layer, threshold)
        builders["cfg_lags"] = lambda: _cfg_lag_parts(ds)
    parts, skipped = {}, {}
    for name, build in builders.items():
        try:
            parts.update(build())
        except (KeyError, ValueError) as exc:
            skipped[name] = str(exc.args[0] if isinstance(exc, KeyError) else exc)
    return parts, skipped


def _present(ds, variables) -> list[str]:
    found = [v for v in variables if v in ds.data_vars]
    if not found:
        require(ds, variables[0])
    return found


def _bounds(quantity: str) -> tuple[float, float] | None:
    """The range of a quantity, to clip its t-interval: proportions in [0, 1], cosines in [-1, 1]."""
    if quantity.startswith(("share", "precision", "recall", "topk_overlap")):
        return (0.0, 1.0)
    if quantity == "mean_cos":
        return (-1.0, 1.0)
    # a median over steps of a per-step ratio is a ratio too (its interval reached -1.3 on a 4-sample store)
    return (0.0, np.inf) if quantity.startswith(("mse", "ratio", "median_step_ratio")) else None


def _rows(key, agg: xr.Dataset) -> pd.DataFrame:
    section, quantity, var, selector = key
    agg = agg.drop_vars([c for c in agg.coords if c not in agg.dims])
    # rows in the order of the values' dims: a Dataset's dims follow its coordinates, and the order of those of a
    # store opened from zarr varies between processes (zarr lists a group's members in no fixed order)
    df = (agg.to_dataframe(dim_order=list(agg["mean"].dims)).reset_index() if agg.dims
          else pd.DataFrame([{v: agg[v].item() for v in agg}]))
    df = df.assign(section=section, quantity=quantity, var=var, selector=selector)
    for col in COLUMNS:
        if col not in df:
            df[col] = None
    return df[list(COLUMNS)]


def run_summary(ds: xr.Dataset, *, layer: int = 1, lazymar_layer: int | None = None, k: int = 64,
                threshold: float = 0.95, level: float = 0.95, variables=STABILITY_VARS, var: str = "dec_k",
                scheduler=None, claims: bool = False) -> tuple[pd.DataFrame, dict]:
    """The redundancy measurements of a run as one tidy table with confidence intervals over samples.

    Parameters
    ----------
    ds : xarray.Dataset
        A run (:func:`mar_probe.store.open_run`) or several (:func:`combine_runs`).
    layer : int
        Selection layer, 0-based (MARché's "Layer 2" is 1); drift is measured at every later layer.
    lazymar_layer : int, optional
        Layer of LazyMAR's V-cosine criterion (default: ``layer``. LazyMAR prunes at index 3 of MAR-B's 12
        decoder layers, a quarter of the depth, which is index 1 of a 4-layer decoder).
    k : int
        Refresh budget K of the selection and overlap measurements.
    threshold : float
        Cosine threshold: share of tokens above it; tokens below it count as drifting in the selection section.
    level : float
        Confidence level of the t-intervals.
    variables : sequence of str
        Variables of the stability section (those present are used).
    var : str
        The variable whose drift the selection section predicts (``dec_k`` or ``dec_v``).
    scheduler : str or distributed.Client, optional
        Where the single compute runs: a dask scheduler name (``"threads"``, ``"synchronous"``), a
        :class:`distributed.Client` (:func:`~mar_probe.analysis.cluster.dask_cluster`: its workers read their
        own chunks), or None: dask's default (the threads of this process unless a default Client is active).
        The graph, and so the table, is the same on every scheduler.
    claims : bool
        Add the ``skippable`` (at layer ``lazymar_layer``, default
        :func:`~mar_probe.analysis.claims.default_prune_layer`) and ``cfg_lags`` sections of
        :mod:`~mar_probe.analysis.claims`.

    Returns
    -------
    (pandas.DataFrame, dict)
        Rows with columns :data:`COLUMNS`; sections that the store cannot support -> the reason (which
        ``mar-probe record`` flags would capture what they need).
    """
    import dask
    from .cluster import using_scheduler
    with using_scheduler(scheduler):  # every compute, the checks' reads of the done flags included
        _check_summary_args(ds, layer, lazymar_layer, k, threshold)
        parts, skipped = _sections(ds, layer=layer, lazymar_layer=lazymar_layer, k=k, threshold=threshold,
                                   variables=variables, var=var, claims=claims)
        keys = list(parts)
        values = dask.compute(*[parts[key] for key in keys])
    frames = [_rows(key, aggregate_ratio(v, level=level) if key[0] == "cfg_lags"  # ratios may be +inf
                    else aggregate(v, "sample", level=level, bounds=_bounds(key[1])))
              for key, v in zip(keys, values)]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(COLUMNS))
    table.attrs.update(level=level, layer=layer, k=k, threshold=threshold, samples=int(ds.sizes["sample"]),
                       claims=claims)
    return table, skipped


def _check_summary_args(ds, layer, lazymar_layer, k, threshold) -> None:
    """Nonsense is refused before any compute (issue 19: --layer 99 and --k 0 printed 'skipped' and exit 0)."""
    require_completed(ds)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer (a refresh budget), got {k!r}")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must lie in (0, 1) (a cosine), got {threshold!r}")
    check_layer(ds, layer, "layer")
    if lazymar_layer is not None:
        check_layer(ds, lazymar_layer, "lazymar_layer")


def _ci(row, fmt: str = ".3f") -> str:
    if row is None or not np.isfinite(row["mean"]):
        return "n/a"
    lo, hi = row["lo"], row["hi"]
    ci = f" [{lo:{fmt}}, {hi:{fmt}}]" if np.isfinite(lo) and np.isfinite(hi) else " [n/a: one sample]"
    return f"{row['mean']:{fmt}}{ci}"


def _pick(table: pd.DataFrame, **match) -> pd.DataFrame:
    sel = np.ones(len(table), bool)
    for col, val in match.items():
        sel &= (table[col] == val).to_numpy()
    return table[sel]


def _one(table, **match):
    rows = _pick(table, **match)
    return rows.iloc[0] if len(rows) else None


def _headline_drift(table) -> list[str]:
    for var in ("dec_resid_post", "dec_v", "dec_k"):
        gaps = _pick(table, quantity="mean_cos_minus_t-1", var=var)
        if len(gaps):
            break
    else:
        return []
    t1 = _one(table, quantity="mean_cos", var=var, category="t-1")
    closest = gaps.loc[gaps["mean"].idxmin()] if gaps["mean"].notna().any() else None
    if closest is None:
        return []
    verdict = "yes" if (gaps["lo"] > 0).all() else ("no" if (gaps["hi"] < 0).any() else "not resolved")
    return [f"t-1 drifts most ({var}, adjacent-step cosine): {verdict}. mean cos t-1 = {_ci(t1)}; closest category "
            f"{closest['category']!r} is higher by {_ci(closest)}"]


def _headline_cfg(table) -> list[str]:
    r = _one(table, quantity="ratio_cond/residual")
    u = _one(table, quantity="ratio_uncond/residual")
    m = _one(table, quantity="median_step_ratio_cond/residual")
    if r is None:
        return []
    return [f"CFG residual: adjacent-step MSE cond/residual = {_ci(r, '.2f')}x, uncond/residual = {_ci(u, '.2f')}x "
            f"(step-averaged MSEs); median over steps of the per-step ratio cond/residual = {_ci(m, '.1f')}x "
            "(LazyMAR reports ~35.5x)"]


def _headline_selection(table, k, threshold) -> list[str]:
    out = []
    for quantity, what in (("precision_topk_drift", f"precision = recall vs the top-{k} drifting tokens"),
                           (f"recall_cos<{threshold:g}", f"recall of tokens with cos < {threshold:g}")):
        rows = _pick(table, section="selection", quantity=quantity)
        for layer in sorted(rows["layer"].dropna().unique()):
            at = rows[rows["layer"] == layer]
            parts = [f"{r['selector']} {_ci(r)}" for _, r in at.iterrows()]
            out.append(f"selection K={k}, {what} at layer {int(layer)}: " + "; ".join(parts))
    return out


def _headline_claims(table, threshold) -> list[str]:
    out = []
    rows = _pick(table, section="skippable")
    if len(rows):
        r = rows[np.isclose(rows["threshold"].astype(float), threshold)].iloc[0]
        out.append(f"LazyMAR token cache: share of the tokens it could skip with V cosine > {threshold:g} at layer "
                   f"{int(r['layer'])} = {_ci(r)} (LazyMAR: ~84%; sweep in [skippable])")
    for quantity, rows in _pick(table, section="cfg_lags").groupby("quantity", sort=False):
        lags = sorted(rows["lag"].dropna().unique())
        ends = [lags[0], lags[-1]] if len(lags) > 1 else lags
        parts = [f"lag {int(lag)}: " + ", ".join(f"{e} {_ci(_one(rows, lag=lag, estimator=e), '.1f')}x"
                                                 for e in ESTIMATORS) for lag in ends]
        out.append(f"CFG residual {quantity}: " + "; ".join(parts) + " (LazyMAR ~35.5x; all lags in [cfg_lags])")
    return out


def headlines(table: pd.DataFrame) -> list[str]:
    """One line per claim of the papers, read off a :func:`run_summary` table."""
    k, threshold = table.attrs.get("k", 64), table.attrs.get("threshold", 0.95)
    return (_headline_drift(table) + _headline_cfg(table) + _headline_selection(table, k, threshold)
            + _headline_claims(table, threshold))


def _pivot_text(rows: pd.DataFrame, index: str, columns: str, fmt: str = ".3f") -> str:
    cells = rows.assign(cell=[_ci(r, fmt) for _, r in rows.iterrows()])
    grid = cells.pivot(index=index, columns=columns, values="cell")
    order = [c for c in list(REPORTED_CATEGORIES) + sorted(map(str, grid.columns)) if c in grid.columns]
    grid = grid[list(dict.fromkeys(order))]
    return grid.to_string()


def format_summary(table: pd.DataFrame, skipped: dict | None = None) -> str:
    """The summary as text: headlines, then one block per section (mean [lo, hi] over samples)."""
    level = table.attrs.get("level", 0.95)
    lines = [f"mar-probe analyze: {table.attrs.get('samples', '?')} samples; mean [{level:.0%} t-interval] "
             "over samples", ""] + [f"* {h}" for h in headlines(table)] + [""]
    for (quantity, var), rows in table[table["section"] == "stability"].groupby(["quantity", "var"], sort=False):
        index = "layer" if rows["layer"].notna().any() else "quantity"
        lines += [f"[stability] {quantity} of {var} (cond branch), per layer and token category",
                  _pivot_text(rows, index, "category"), ""]
    for section in ("cfg", "selection", "overlap", "skippable", "cfg_lags"):
        rows = table[table["section"] == section]
        if len(rows):
            lines += [f"[{section}]"] + [_row_text(r) for _, r in rows.iterrows()] + [""]
    for name, why in (skipped or {}).items():
        lines += [f"[{name}] skipped: {why}"]
    return "\n".join(lines).rstrip() + "\n"


def _row_text(r) -> str:
    where = " ".join(f"{c}={int(r[c]) if c in ('layer', 'lag') else r[c]}"
                     for c in ("selector", "layer", "threshold", "lag", "estimator")
                     if c in r and r[c] is not None and r[c] == r[c])
    fmt = ".3g" if r["quantity"].startswith("mse") else ".3f"
    return f"  {r['quantity']:<28s} {where:<34s} {_ci(r, fmt)}  (n={int(r['n'])})"


SOURCE_ATTRS = ("runs", "model_preset", "checkpoint_sha256", "weights_sha256", "sampling", "strategy")
"""Run attributes a summary file keeps, so that it says which model, weights and settings it measured (issue 15:
every result file records the command, the model's SHA-256 and the machine)."""


def summary_json(table: pd.DataFrame, skipped: dict | None = None, *, ds: xr.Dataset | None = None,
                 command: str | None = None) -> dict:
    """The summary as a JSON-able dict: settings, headlines, rows and skipped sections, and its ``source``: the
    command, the machine and, from ``ds`` (the runs measured), :data:`SOURCE_ATTRS`."""
    from ..machine import machine
    rows = table.astype(object).where(table.notna(), None).to_dict(orient="records")
    attrs = {} if ds is None else {k: ds.attrs[k] for k in SOURCE_ATTRS if k in ds.attrs}
    return {"source": {"command": command, "machine": machine(), **attrs}, "settings": dict(table.attrs),
            "headlines": headlines(table), "rows": rows, "skipped": skipped or {}}
