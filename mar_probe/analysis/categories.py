"""Token categories per (sample, step), as in LazyMAR's Fig. 1."""
from __future__ import annotations

import numpy as np
import xarray as xr

from ._checks import require

CATEGORIES = ("t", "t-1", "<t-1", ">t", "buffer", "unknown")
"""Category names in code order: generating now, decoded at the previous step, decoded earlier, still masked
after this step, buffer rows, and ``unknown`` (an image token known before the step whose previous step is not
in the store, so t-1 and <t-1 cannot be told apart)."""


def token_categories(ds: xr.Dataset) -> xr.DataArray:
    """Category code of every token at every (sample, step) (lazy).

    Parameters
    ----------
    ds : xarray.Dataset
        A run with ``mask`` (unknown before the step), ``pred`` (generated at the step) and the ``row``
        coordinate of ``token`` (-1 on buffer rows).

    Returns
    -------
    xarray.DataArray
        int8 codes ``(sample, step, token)`` indexing :data:`CATEGORIES`; ``attrs["categories"]`` holds
        the names.
    """
    require(ds, "mask", "pred")
    mask, pred = ds["mask"], ds["pred"]
    steps = ds["step"].values
    has_prev = xr.DataArray(np.isin(steps - 1, steps), dims="step", coords={"step": steps})
    prev = pred.reindex(step=steps - 1, fill_value=False).assign_coords(step=steps)
    buffer = ds["row"] < 0 if "row" in ds.coords else xr.zeros_like(ds["token"], dtype=bool)
    code = xr.full_like(mask, CATEGORIES.index("<t-1"), dtype=np.int8)
    code = code.where(~(~mask & ~has_prev), CATEGORIES.index("unknown"))
    code = code.where(~(prev & has_prev), CATEGORIES.index("t-1"))
    code = code.where(~(mask & ~pred), CATEGORIES.index(">t"))
    code = code.where(~pred, CATEGORIES.index("t"))
    code = code.where(~buffer, CATEGORIES.index("buffer")).astype(np.int8)
    return code.rename("category").assign_attrs(categories=list(CATEGORIES))


def category_masks(codes: xr.DataArray, names=None) -> xr.DataArray:
    """Boolean masks with a ``category`` dimension from the codes of :func:`token_categories`.

    Parameters
    ----------
    codes : xarray.DataArray
        Output of :func:`token_categories`.
    names : sequence of str, optional
        Categories to keep (default: all but ``unknown``).
    """
    names = list(names) if names is not None else list(CATEGORIES[:-1])
    bad = [n for n in names if n not in CATEGORIES]
    if bad:
        raise ValueError(f"unknown token categor(ies) {bad!r}; expected some of {CATEGORIES!r}")
    wanted = xr.DataArray([CATEGORIES.index(n) for n in names], dims="category", coords={"category": names})
    return codes == wanted
