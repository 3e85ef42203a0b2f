"""Input checks shared by the analysis functions: clear errors for missing variables, layers and steps."""
from __future__ import annotations

import xarray as xr

from ..store.variables import VARIABLES

RECORD_HINT = "`mar-probe record --vars {vars}`"
RECORD_FLAGS = {"layer": "--layers", "step": "--steps", "branch": "--branches", "sample": "--samples"}



class MissingVariableError(KeyError, ValueError):
    """A measurement needs variables the store lacks (a KeyError for mapping-style callers, a ValueError for the
    CLI's expected errors); its message is plain text, not KeyError's quoted repr."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

def require(ds: xr.Dataset, *names: str) -> None:
    """Raise a KeyError naming the ``mar-probe record`` flag that would capture each missing variable.

    Parameters
    ----------
    ds : xarray.Dataset
        A run opened with :func:`mar_probe.store.open_run` (or a dataset of the same schema).
    *names : str
        Variables the caller needs.
    """
    missing = [n for n in names if n not in ds.data_vars]
    if missing:
        have = sorted(str(v) for v in ds.data_vars)
        raise MissingVariableError(f"the store lacks variable(s) {missing!r}; record them with "
                       f"{RECORD_HINT.format(vars=','.join(missing))} (this store has {have!r})")


def check_values(obj, dim: str, values) -> None:
    """Raise a ValueError listing what the store has when a value of ``dim`` is absent.

    Parameters
    ----------
    obj : xarray.Dataset or xarray.DataArray
    dim : str
        A dimension with a coordinate (``layer``, ``step``, ``branch``, ...).
    values : scalar or sequence
        The wanted coordinate values.
    """
    if dim not in obj.dims:
        raise ValueError(f"expected a dimension {dim!r}, got dims {tuple(obj.dims)!r}")
    wanted = list(values) if isinstance(values, (list, tuple)) else [values]
    have = [v.item() if hasattr(v, "item") else v for v in obj[dim].values]
    bad = [w for w in wanted if w not in have]
    if bad:
        flag = RECORD_FLAGS.get(dim)
        hint = f" (a store holds the {dim}s chosen by `mar-probe record {flag}`)" if flag else ""
        raise ValueError(f"{dim} {bad!r} not in the store; it has {dim} {have!r}{hint}")


def feature_dims(x: xr.DataArray, dims=None) -> tuple[str, ...]:
    """The feature dims to reduce over: ``dims`` if given, else those of (head, d_head, d_model) present."""
    if dims is not None:
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        bad = [d for d in dims if d not in x.dims]
        if bad:
            raise ValueError(f"feature dim(s) {bad!r} not in {x.name!r}; it has dims {tuple(x.dims)!r}")
        return dims
    found = tuple(d for d in x.dims if d.endswith(("head", "d_head", "d_model")))
    if not found:
        raise ValueError(f"{x.name!r} has no feature dims (head, d_head, d_model); got dims {tuple(x.dims)!r}")
    return found


def require_completed(ds: xr.Dataset) -> None:
    """Raise a ValueError when no (sample, step) of the run is flagged done: every measurement would be NaN."""
    if "done" in ds.data_vars and not bool(ds["done"].any()):
        raise ValueError("the run has no completed step (no (sample, step) is flagged done), so there is nothing to "
                         "measure; complete it with `mar-probe record ... --resume`")


def check_layer(ds: xr.Dataset, layer, name: str = "layer") -> None:
    """Raise a ValueError unless ``layer`` is a decoder layer the run recorded (0-based), naming those it has."""
    var = next((v for v in ds.data_vars if v in VARIABLES and VARIABLES[v].layered and VARIABLES[v].stack == "dec"),
               None)                                                 # any per-layer decoder variable holds the layers
    if var is None:
        return
    dim = next(d for d in ds[var].dims if d.endswith("layer"))
    have = [int(v) for v in ds[dim].values]
    if not isinstance(layer, int) or isinstance(layer, bool) or layer not in have:
        raise ValueError(f"{name} {layer!r} is not a decoder layer of this run; it recorded layers {have!r} "
                         "(0-based: MARche's 'layer 2' is 1)")
