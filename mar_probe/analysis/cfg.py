"""LazyMAR's condition redundancy: adjacent-step MSE of the CFG branches and of their residual."""
from __future__ import annotations

import numpy as np
import xarray as xr

from ._checks import check_values, require
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
        A run with ``var`` (both CFG branches); the residual is ``z_cfg_resid`` when stored, else
        ``cond - uncond``.
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
    check_values(ds[var], "branch", ["cond", "uncond"])
    cond, uncond = ds[var].sel(branch="cond", drop=True), ds[var].sel(branch="uncond", drop=True)
    resid = ds["z_cfg_resid"] if var == "z" and "z_cfg_resid" in ds.data_vars else cond - uncond
    out = xr.Dataset({"cond": adjacent_mse(cond, lag, dim), "uncond": adjacent_mse(uncond, lag, dim),
                      "residual": adjacent_mse(resid, lag, dim)})
    out["ratio_cond"] = out["cond"] / out["residual"]
    out["ratio_uncond"] = out["uncond"] / out["residual"]
    return out.assign_attrs(lag=lag, var=var)
