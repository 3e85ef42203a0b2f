"""LazyMAR's condition redundancy: adjacent-step MSE of the CFG branches and of their residual."""
from __future__ import annotations

import numpy as np
import xarray as xr

from ._checks import require
from .stability import step_pairs


def adjacent_mse(x: xr.DataArray, lag: int = 1, dim=("token", "d_model")) -> xr.DataArray:
    """Mean squared change of ``x`` between step s and s - lag, averaged over ``dim`` (NaN rows skipped).

    Parameters
    ----------
    x : xarray.DataArray
        A quantity with a ``step`` dim.
    lag : int
        Step distance.
    dim : sequence of str
        Dims to average over (default: every token and feature).
    """
    cur, prev = step_pairs(x.astype(np.float32), lag)
    return ((cur - prev) ** 2).mean(list(dim), skipna=True)


def cfg_residual_mse(ds: xr.DataArray | xr.Dataset, lag: int = 1, var: str = "z",
                     dim=("token", "d_model")) -> xr.Dataset:
    """Adjacent-step MSE of the conditional and unconditional output, of their residual, and the ratios.

    Parameters
    ----------
    ds : xarray.Dataset
        A run with ``var``: both CFG branches, or (for ``z``) the conditional branch and ``z_cfg_resid``,
        from which the unconditional output is ``cond - z_cfg_resid``. The residual is ``z_cfg_resid`` when
        stored, else ``cond - uncond``.
    lag : int
        Step distance.
    var : str
        The decoder output to use (default ``z``).
    dim : sequence of str
        Dims to average over.

    Returns
    -------
    xarray.Dataset
        ``cond``, ``uncond``, ``residual`` MSEs and ``ratio_cond`` = cond / residual, ``ratio_uncond`` =
        uncond / residual (LazyMAR reports about 35.5), per (sample, step).
    """
    require(ds, var)
    cond, uncond, resid = _branches(ds, var)
    out = xr.Dataset({"cond": adjacent_mse(cond, lag, dim), "uncond": adjacent_mse(uncond, lag, dim),
                      "residual": adjacent_mse(resid, lag, dim)})
    out["ratio_cond"] = out["cond"] / out["residual"]
    out["ratio_uncond"] = out["uncond"] / out["residual"]
    return out.assign_attrs(lag=lag, var=var)


def _branches(ds: xr.Dataset, var: str) -> tuple[xr.DataArray, xr.DataArray, xr.DataArray]:
    """(cond, uncond, cond - uncond) of ``var``; uncond derived from ``z_cfg_resid`` when only cond is stored."""
    x = ds[var]
    has_resid = var == "z" and "z_cfg_resid" in ds.data_vars
    if "branch" not in x.dims:
        raise ValueError(f"expected {var!r} with a 'branch' dim, got dims {tuple(x.dims)!r}")
    have = [str(b) for b in x["branch"].values]
    if "cond" not in have or ("uncond" not in have and not has_resid):
        raise ValueError(f"the CFG residual MSE needs {var!r} of branches ['cond', 'uncond'] (or 'cond' and "
                         f"z_cfg_resid); the store has branch {have!r} and "
                         f"{'z_cfg_resid' if has_resid else 'no z_cfg_resid'}. Record a run with cfg != 1 and "
                         f"`mar-probe record --vars z,z_cfg_resid` (or `--branches cond,uncond`)")
    cond = x.sel(branch="cond", drop=True)
    if has_resid:
        resid = ds["z_cfg_resid"]
        derived = cond.astype(np.float32) - resid.astype(np.float32)
        uncond = x.sel(branch="uncond", drop=True) if "uncond" in have else derived
        return cond, uncond, resid
    uncond = x.sel(branch="uncond", drop=True)
    return cond, uncond, cond.astype(np.float32) - uncond.astype(np.float32)
