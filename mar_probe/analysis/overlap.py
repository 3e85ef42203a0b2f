"""Top-K attention overlap between layers and across decoding steps (MARché Fig. 12)."""
from __future__ import annotations

import xarray as xr

from ._checks import check_values, require
from .selection import ks_array, topk_rank
from .stability import step_pairs


def _gen_attention(ds: xr.Dataset, branch: str) -> xr.DataArray:
    require(ds, "attn_gen")
    check_values(ds["attn_gen"], "branch", branch)
    return ds["attn_gen"].sel(branch=branch, drop=True)


def topk_overlap_layers(ds: xr.Dataset, k=64, ref_layer: int = 1, branch: str = "cond",
                        exclude_generating: bool = True) -> xr.DataArray:
    """Share of each layer's top-K attended tokens that are also in ``ref_layer``'s top-K (lazy).

    Parameters
    ----------
    ds : xarray.Dataset
        A run with ``attn_gen`` (head-averaged attention from the generating tokens, per decoder layer).
    k : int or sequence of int
        Budget K.
    ref_layer : int
        The selection layer (store's 0-based index; MARché's "Layer 2" is 1).
    branch : str
        CFG branch.
    exclude_generating : bool
        Leave the generating tokens out of the ranking (they are always recomputed).

    Returns
    -------
    xarray.DataArray
        |top-K(layer) ∩ top-K(ref)| / K per (sample, step, layer[, k]).
    """
    attn = _gen_attention(ds, branch)
    check_values(attn, "layer", ref_layer)
    eligible = ~ds["pred"] if exclude_generating else attn.notnull()
    ks = ks_array(k)
    top = topk_rank(attn, eligible) < ks
    ref = top.sel(layer=ref_layer, drop=True)
    out = (top & ref).sum("token") / ks
    return (out if len(ks) > 1 else out.squeeze("k")).rename("overlap").assign_attrs(ref_layer=ref_layer)


def topk_overlap_steps(ds: xr.Dataset, k=64, lag: int = 1, branch: str = "cond") -> xr.DataArray:
    """Share of each layer's top-K attended tokens at step s that were top-K at step s - lag (lazy).

    Returns
    -------
    xarray.DataArray
        |top-K(s) ∩ top-K(s - lag)| / K per (sample, step s, layer[, k]).
    """
    attn = _gen_attention(ds, branch)
    ks = ks_array(k)
    top = topk_rank(attn, attn.notnull()) < ks
    cur, prev = step_pairs(top, lag)
    out = (cur & prev).sum("token") / ks
    return (out if len(ks) > 1 else out.squeeze("k")).rename("overlap_steps").assign_attrs(lag=lag)
