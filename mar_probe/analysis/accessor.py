"""``ds.probe``: a thin accessor forwarding to the analysis functions."""
from __future__ import annotations

import xarray as xr

from . import cfg, categories, overlap, selection, stability
from ._checks import require


@xr.register_dataset_accessor("probe")
class ProbeAccessor:
    """``ds.probe.categories()``, ``ds.probe.cosine("dec_k")``, ``ds.probe.cfg_mse()``, ...; see
    :mod:`mar_probe.analysis` for the functions and their parameters."""

    def __init__(self, ds: xr.Dataset):
        self._ds = ds

    def categories(self) -> xr.DataArray:
        """:func:`~mar_probe.analysis.token_categories`."""
        return categories.token_categories(self._ds)

    def cosine(self, var: str, lag: int = 1, dim=None) -> xr.DataArray:
        """:func:`~mar_probe.analysis.cosine_stability` of variable ``var``."""
        require(self._ds, var)
        return stability.cosine_stability(self._ds[var], lag, dim)

    def drift(self, var: str, lag: int = 1, metric: str = "cos", dim=None) -> xr.DataArray:
        """:func:`~mar_probe.analysis.drift` of variable ``var``."""
        require(self._ds, var)
        return stability.drift(self._ds[var], lag, metric, dim)

    def stability_summary(self, var: str, lag: int = 1, dim=("token",), **kw) -> xr.Dataset:
        """:func:`~mar_probe.analysis.summarize_stability` of ``var``'s cosine by category."""
        return stability.summarize_stability(self.cosine(var, lag), self.categories(), dim, **kw)

    def cfg_mse(self, lag: int = 1, var: str = "z") -> xr.Dataset:
        """:func:`~mar_probe.analysis.cfg_residual_mse`."""
        return cfg.cfg_residual_mse(self._ds, lag, var)

    def selection_vs_drift(self, var: str = "dec_k", layer: int = 1, k=(8, 16, 32, 64), **kw) -> xr.Dataset:
        """Attention at ``layer`` vs drift of ``var`` (cond branch) at every later layer."""
        require(self._ds, var)
        actual = stability.drift(self._ds[var].sel(branch="cond", drop=True))
        actual = actual.sel(layer=actual["layer"] > layer)
        return selection.selection_vs_drift(selection.attention_selector(self._ds, layer), actual,
                                            self.categories(), k, **kw)

    def topk_overlap(self, k=64, ref_layer: int = 1) -> xr.DataArray:
        """:func:`~mar_probe.analysis.topk_overlap_layers`."""
        return overlap.topk_overlap_layers(self._ds, k, ref_layer)
