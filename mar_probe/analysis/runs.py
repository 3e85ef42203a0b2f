"""Several runs as one: concatenate stores of the same setting (e.g. one per seed) along ``sample``."""
from __future__ import annotations

import numpy as np
import xarray as xr

SHARED_DIMS = ("step", "branch", "layer", "enc_layer", "dec_layer", "token")


def _check_same(datasets, dim: str) -> None:
    first = datasets[0]
    for i, ds in enumerate(datasets[1:], 1):
        if (dim in first.dims) != (dim in ds.dims):
            raise ValueError(f"run {i} {'lacks' if dim in first.dims else 'has'} dimension {dim!r} unlike run 0; "
                             "expected runs of the same selection")
        if dim in first.dims and not np.array_equal(first[dim].values, ds[dim].values):
            raise ValueError(f"run {i} has {dim} {ds[dim].values.tolist()!r}, run 0 has "
                             f"{first[dim].values.tolist()!r}; expected the same {dim}s in every run")


def _tag(ds: xr.Dataset, i: int) -> xr.Dataset:
    n = ds.sizes["sample"]
    return ds.assign_coords(sample_in_run=("sample", ds["sample"].values), run=("sample", np.full(n, i)),
                            run_seed=("sample", np.full(n, int(ds.attrs.get("seed", -1))))).drop_vars("sample")


def combine_runs(datasets, names=None) -> xr.Dataset:
    """Concatenate runs along ``sample`` so that statistics pool their samples (and seeds).

    Parameters
    ----------
    datasets : sequence of xarray.Dataset
        Runs from :func:`mar_probe.store.open_run` with the same variables, steps, branches, layers and
        tokens (e.g. the same ``mar-probe record`` command with different ``--seed``).
    names : sequence of str, optional
        A name per run (e.g. its path), kept in the ``run`` coordinate of ``sample``.

    Returns
    -------
    xarray.Dataset
        Samples renumbered 0..N-1; coordinates ``run`` (index into ``datasets``), ``run_seed`` (the run's
        ``--seed``) and ``sample_in_run`` beside the runs' ``label`` and ``seed``. Attributes are the first
        run's, with ``runs`` listing ``names``. A single run is returned unchanged.
    """
    datasets = list(datasets)
    if not datasets:
        raise ValueError("expected at least one run, got none")
    if len(datasets) == 1:
        return datasets[0]
    for dim in SHARED_DIMS:
        _check_same(datasets, dim)
    have = [sorted(map(str, ds.data_vars)) for ds in datasets]
    if any(h != have[0] for h in have):
        raise ValueError(f"runs hold different variables {have!r}; expected the same selection in every run")
    parts = [_tag(ds, i) for i, ds in enumerate(datasets)]
    out = xr.concat(parts, dim="sample", data_vars="minimal", coords="minimal", compat="override", join="exact",
                    combine_attrs="drop_conflicts")
    out = out.assign_coords(sample=np.arange(out.sizes["sample"]))
    names = list(names) if names is not None else [str(i) for i in range(len(datasets))]
    offsets = np.cumsum([0] + [ds.sizes["sample"] for ds in datasets])
    incomplete = [(int(offsets[i] + np.flatnonzero(ds["sample"].values == s)[0]), step)
                  for i, ds in enumerate(datasets) for s, step in ds.attrs.get("incomplete", [])]
    return out.assign_attrs({**datasets[0].attrs, "runs": names, "incomplete": incomplete})


def stream_chunks(ds: xr.Dataset, max_bytes: float = 32e6) -> xr.Dataset:
    """Rechunk dask-backed per-step variables to several steps per chunk, at most ``max_bytes`` each.

    Grouping steps cuts dask's per-task overhead (about half the analysis time on a small model) while every
    chunk stays small enough to stream a store larger than memory. The steps of a dask chunk are a multiple of
    the steps of a stored chunk (``steps_per_chunk``), so no stored chunk is read twice; a stored chunk larger than
    ``max_bytes`` stays whole.

    Parameters
    ----------
    ds : xarray.Dataset
        A run from :func:`mar_probe.store.open_run`.
    max_bytes : float
        Largest chunk of any variable (as stored, per sample).
    """
    per_step = [v for v in ds.data_vars.values() if "step" in v.dims and v.chunks is not None]
    if not per_step:
        return ds
    step_bytes = max(int(np.prod([n for d, n in v.sizes.items() if d not in ("sample", "step")])) * v.dtype.itemsize
                     for v in per_step)
    stored = max(c for v in per_step for c in v.chunks[v.dims.index("step")])
    steps = int(max(1, min(ds.sizes["step"], max_bytes // max(step_bytes, 1))))
    return ds.chunk({"sample": 1, "step": max(stored, steps // stored * stored)})


def open_runs(paths, max_bytes: float = 32e6) -> xr.Dataset:
    """Open one or several run stores as one lazy dataset (:func:`combine_runs`, :func:`stream_chunks`).

    Parameters
    ----------
    paths : str, Path or sequence of them
        Stores written by ``mar-probe record`` with the same selection (e.g. one per ``--seed``).
    max_bytes : float
        Largest dask chunk (see :func:`stream_chunks`).
    """
    from ..store import open_run
    paths = [paths] if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__") else list(paths)
    runs = [stream_chunks(open_run(p), max_bytes) for p in paths]
    return combine_runs(runs, names=[str(p) for p in paths])
