"""Cosine stability and drift of any recorded quantity between step s and step s - lag, per token."""
from __future__ import annotations

import numpy as np
import xarray as xr

from ._checks import feature_dims
from .categories import category_masks

THRESHOLDS = (0.9, 0.95, 0.99)


def step_pairs(x: xr.DataArray, lag: int = 1, dim: str = "step") -> tuple[xr.DataArray, xr.DataArray]:
    """``(current, previous)``: ``x`` at every step s whose step s - lag is also stored, and at s - lag.

    Both carry the coordinate s on ``dim``, so they align. Raises when no step has its partner.
    """
    if lag < 1:
        raise ValueError(f"lag must be a positive number of steps, got {lag!r}")
    steps = x[dim].values
    pairs = [int(s) for s in steps if s - lag in set(steps.tolist())]
    if not pairs:
        raise ValueError(f"no step s with s - {lag} also in the store; it has steps {steps.tolist()!r}")
    cur = x.sel({dim: pairs})
    prev = x.sel({dim: [s - lag for s in pairs]}).assign_coords({dim: pairs})
    return cur, prev


def cosine_stability(x: xr.DataArray, lag: int = 1, dim=None) -> xr.DataArray:
    """Cosine similarity of each token's vector between step s and step s - lag (lazy).

    Parameters
    ----------
    x : xarray.DataArray
        Any recorded quantity with a ``step`` dim (``dec_k``, ``dec_v``, ``dec_resid_post``, ``z``...).
    lag : int
        Step distance (1: adjacent steps).
    dim : str or sequence of str, optional
        Feature dims the vector spans (default: ``head``, ``d_head`` / ``d_model`` present in ``x``); pass
        ``"d_head"`` for one cosine per head.

    Returns
    -------
    xarray.DataArray
        ``x``'s dims without ``dim``, on steps s that have s - lag; NaN where a token is missing at either step.
    """
    dims = feature_dims(x, dim)
    cur, prev = step_pairs(x.astype(np.float32), lag)
    dot = (cur * prev).sum(dims, skipna=False)
    norm = np.sqrt((cur * cur).sum(dims, skipna=False) * (prev * prev).sum(dims, skipna=False))
    return (dot / norm).rename(f"cos_{x.name}").assign_attrs(lag=lag, feature_dims=list(dims))


def drift(x: xr.DataArray, lag: int = 1, metric: str = "cos", dim=None) -> xr.DataArray:
    """How much each token's vector changed from step s - lag to s: ``1 - cos`` or relative L2 (lazy).

    Parameters
    ----------
    x : xarray.DataArray
        A recorded quantity with a ``step`` dim.
    lag : int
        Step distance.
    metric : {"cos", "l2"}
        ``"cos"``: 1 - cosine similarity; ``"l2"``: ``||x_s - x_{s-lag}|| / ||x_{s-lag}||``.
    dim : str or sequence of str, optional
        Feature dims (as in :func:`cosine_stability`).
    """
    if metric == "cos":
        out = 1 - cosine_stability(x, lag, dim)
    elif metric == "l2":
        dims = feature_dims(x, dim)
        cur, prev = step_pairs(x.astype(np.float32), lag)
        out = np.sqrt(((cur - prev) ** 2).sum(dims, skipna=False) / (prev * prev).sum(dims, skipna=False))
    else:
        raise ValueError(f"metric must be 'cos' or 'l2', got {metric!r}")
    return out.rename(f"drift_{x.name}").assign_attrs(lag=lag, metric=metric)


def summarize_stability(cos: xr.DataArray, categories: xr.DataArray, dim=("token",),
                        thresholds=THRESHOLDS, names=None) -> xr.Dataset:
    """Mean cosine and share of tokens above each threshold, per token category (lazy).

    Parameters
    ----------
    cos : xarray.DataArray
        Output of :func:`cosine_stability`.
    categories : xarray.DataArray
        Codes of :func:`~mar_probe.analysis.token_categories` (categorised at step s, the later step).
    dim : sequence of str
        Dims to reduce (default: ``token``; add ``head``, ``branch``, ``layer`` or ``step`` to pool them).
    thresholds : sequence of float
        Share of tokens with cosine strictly above each value.
    names : sequence of str, optional
        Categories to report (default: all but ``unknown``).

    Returns
    -------
    xarray.Dataset
        ``mean``, ``count`` and ``share`` (with a ``threshold`` dim), with a ``category`` dim.
    """
    dim = [dim] if isinstance(dim, str) else list(dim)
    cats = category_masks(categories.sel(step=cos["step"]), names)
    valid = cats & cos.notnull()
    count = valid.sum(dim)
    # a category with no token at a step (t-1 at step 0, say) is NaN there, without numpy's 0/0 warning that
    # `analyze` and `study` used to print once per run
    per = count.where(count > 0)
    mean = cos.where(valid).sum(dim) / per
    th = xr.DataArray(list(thresholds), dims="threshold", coords={"threshold": list(thresholds)})
    share = ((cos > th) & valid).sum(dim) / per
    return xr.Dataset({"mean": mean, "share": share, "count": count})
