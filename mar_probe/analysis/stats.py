"""Aggregation over samples (and seeds, a coordinate of ``sample``) with confidence intervals, vectorised over the
other dims. One 1-D sample with any statistic (median, tail, worst), clipped and flagged:
:func:`mar_probe.quality.paired.interval`."""
from __future__ import annotations

import numpy as np
import xarray as xr


def _t_interval(x: xr.DataArray, dim: str, level: float) -> tuple[xr.DataArray, xr.DataArray]:
    """The t half width of :func:`mar_probe.quality.paired.t_half_width` (the package's one t formula), NaN for
    fewer than two values."""
    from ..quality.paired import t_half_width
    n = x.notnull().sum(dim)
    half = xr.apply_ufunc(lambda s, m: t_half_width(s, np.maximum(m, 2), level) * np.where(m > 1, 1.0, np.nan),
                          x.std(dim, ddof=1, skipna=True), n)
    return half, half


def _bootstrap(x: xr.DataArray, dim: str, level: float, n_boot: int, seed: int):
    vals = x.transpose(..., dim).values
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, vals.shape[-1], size=(n_boot, vals.shape[-1]))
    with np.errstate(all="ignore"):
        means = np.nanmean(vals[..., idx], axis=-1)                       # [..., n_boot]
    lo, hi = np.nanpercentile(means, [50 - 50 * level, 50 + 50 * level], axis=-1)
    dims = [d for d in x.dims if d != dim]
    return xr.DataArray(lo, dims=dims), xr.DataArray(hi, dims=dims)


def aggregate(x: xr.DataArray, dim: str = "sample", level: float = 0.95, method: str = "t",
              n_boot: int = 1000, seed: int = 0, bounds: tuple[float, float] | None = None) -> xr.Dataset:
    """Mean over ``dim`` with a confidence interval (computes ``x``; pass an already reduced summary).

    Parameters
    ----------
    x : xarray.DataArray
        Per-sample values (NaN are skipped).
    dim : str
        The dim to aggregate over (``sample``; seeds are a coordinate of it).
    level : float
        Confidence level.
    method : {"t", "bootstrap"}
        Student-t interval or percentile bootstrap of the mean.
    n_boot, seed : int
        Bootstrap resamples and their seed.
    bounds : (float, float), optional
        The range the quantity lives in (e.g. (0, 1) for shares and precisions); the interval is clipped to it.

    Returns
    -------
    xarray.Dataset
        ``mean``, ``lo``, ``hi`` and ``n`` (non-NaN values), without ``dim``.
    """
    if dim not in x.dims:
        raise ValueError(f"cannot aggregate over {dim!r}: {x.name!r} has dims {tuple(x.dims)!r}")
    x = x.compute()
    mean = x.mean(dim, skipna=True)
    if method == "t":
        lo_w, hi_w = _t_interval(x, dim, level)
        lo, hi = mean - lo_w, mean + hi_w
    elif method == "bootstrap":
        lo, hi = _bootstrap(x, dim, level, n_boot, seed)
        lo, hi = lo.assign_coords(mean.coords), hi.assign_coords(mean.coords)
    else:
        raise ValueError(f"method must be 't' or 'bootstrap', got {method!r}")
    if bounds is not None:
        lo, hi = lo.clip(*bounds), hi.clip(*bounds)
    return xr.Dataset({"mean": mean, "lo": lo, "hi": hi, "n": x.notnull().sum(dim)}).assign_attrs(
        level=level, method=method, dim=dim)
