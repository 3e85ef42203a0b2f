"""Selection vs drift: do the tokens a cache policy refreshes coincide with the tokens whose K/V drift?"""
from __future__ import annotations

import numpy as np
import xarray as xr

from ._checks import check_values, require
from .categories import category_masks
from .stability import drift

CANDIDATES = ("<t-1", ">t", "buffer")
"""Tokens a policy may choose to refresh: the generating (t) and just-decoded (t-1) ones are always active."""


def _rank(score: np.ndarray) -> np.ndarray:
    """Descending rank along the last axis (0 = largest); NaN ranks last."""
    s = np.where(np.isnan(score), -np.inf, score)
    return np.argsort(np.argsort(-s, axis=-1, kind="stable"), axis=-1, kind="stable")


def topk_rank(score: xr.DataArray, eligible: xr.DataArray | None = None, dim: str = "token") -> xr.DataArray:
    """Descending rank of ``score`` along ``dim`` among ``eligible`` entries (lazy; others rank last).

    ``topk_rank(score) < k`` is the top-K set; ties are broken by position.
    """
    s = score.astype(np.float64)
    if eligible is not None:
        s = s.where(eligible)
    rank = xr.apply_ufunc(_rank, s, input_core_dims=[[dim]], output_core_dims=[[dim]], dask="parallelized",
                          output_dtypes=[np.int64])
    return rank.transpose(*s.dims)


def ks_array(k) -> xr.DataArray:
    """K values as a DataArray on a ``k`` dim."""
    ks = [int(v) for v in np.atleast_1d(k)]
    if any(v < 1 for v in ks):
        raise ValueError(f"K must be positive integers, got {ks!r}")
    return xr.DataArray(ks, dims="k", coords={"k": ks})


def set_overlap(sel: xr.DataArray, truth: xr.DataArray, eligible: xr.DataArray, dim: str = "token") -> xr.Dataset:
    """Precision, recall, Jaccard of boolean sets ``sel`` against ``truth`` and their random expectations."""
    inter = (sel & truth).sum(dim)
    n_sel, n_true, n = sel.sum(dim), truth.sum(dim), eligible.sum(dim)
    union = n_sel + n_true - inter
    e_inter = _ratio(n_sel * n_true, n)
    return xr.Dataset({"precision": _ratio(inter, n_sel), "recall": _ratio(inter, n_true),
                       "jaccard": _ratio(inter, union), "random_precision": _ratio(n_true, n),
                       "random_recall": _ratio(n_sel, n), "random_jaccard": _ratio(e_inter, n_sel + n_true - e_inter),
                       "n": n})


def _ratio(num: xr.DataArray, den: xr.DataArray) -> xr.DataArray:
    """``num / den``, NaN where ``den`` is 0 (recall when no token drifts at a step is undefined, not 0), without
    numpy's 0/0 warning that `analyze` and `study` used to print once per run."""
    return num / den.where(den > 0)


def selection_vs_drift(selector: xr.DataArray, actual: xr.DataArray, categories: xr.DataArray, k=(8, 16, 32, 64),
                       threshold: float | None = None, candidates=CANDIDATES) -> xr.Dataset:
    """Compare the top-K tokens of a selection score with the tokens that actually drift (lazy).

    Parameters
    ----------
    selector : xarray.DataArray
        Selection score per (sample, step, token), higher = refresh first (e.g. :func:`attention_selector`,
        :func:`lazymar_selector`).
    actual : xarray.DataArray
        True drift per token, e.g. :func:`~mar_probe.analysis.drift` of ``dec_k`` with a ``layer`` dim.
    categories : xarray.DataArray
        Codes of :func:`~mar_probe.analysis.token_categories`.
    k : int or sequence of int
        Refresh budgets K.
    threshold : float, optional
        When given, the drifting set is every candidate with ``actual > threshold`` (precision and recall then
        differ); by default it is the top-K candidates by drift, so precision = recall = overlap / K.
    candidates : sequence of str
        Token categories a policy can choose from (default :data:`CANDIDATES`).

    Returns
    -------
    xarray.Dataset
        ``precision``, ``recall``, ``jaccard`` and their ``random_*`` expectations, with a ``k`` dim.
    """
    check_values(selector, "step", [int(v) for v in actual["step"].values])
    selector = selector.sel(step=actual["step"])
    eligible = category_masks(categories.sel(step=actual["step"]), candidates).any("category")
    eligible = eligible & actual.notnull() & selector.notnull()
    ks = ks_array(k)
    sel = (topk_rank(selector, eligible) < ks) & eligible
    truth = (actual > threshold) if threshold is not None else (topk_rank(actual, eligible) < ks)
    return set_overlap(sel, truth & eligible, eligible).assign_attrs(threshold=threshold,
                                                                     candidates=list(candidates))


def attention_selector(ds: xr.Dataset, layer: int = 1, branch: str = "cond") -> xr.DataArray:
    """MARché's selection score: head-averaged attention from the generating tokens at ``layer``.

    ``layer`` is the store's 0-based decoder layer; MARché's "Layer 2" is ``layer=1``.
    """
    require(ds, "attn_gen")
    check_values(ds["attn_gen"], "layer", layer)
    check_values(ds["attn_gen"], "branch", branch)
    return ds["attn_gen"].sel(layer=layer, branch=branch, drop=True).rename("attn_gen_score")


def lazymar_selector(ds: xr.Dataset, layer: int = 2, var: str = "dec_v", branch: str = "cond",
                     lag: int = 1) -> xr.DataArray:
    """LazyMAR's criterion as a selection score: 1 - cosine of ``var`` (V) to the previous step at ``layer``."""
    require(ds, var)
    check_values(ds[var], "layer", layer)
    check_values(ds[var], "branch", branch)
    return drift(ds[var].sel(layer=layer, branch=branch, drop=True), lag).rename("lazymar_score")
