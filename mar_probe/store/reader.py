"""Opening a recorded run as a lazy ``xarray.Dataset``."""
from __future__ import annotations

import json
import warnings

import numpy as np
import zarr

from .location import StoreLocation
from .schema import READABLE_VERSIONS, SCHEMA_VERSION
from .writer import CREATING_ATTR

JSON_ATTRS = ("model_config", "selection", "sampling", "strategy", "versions")
VARIABLE_ORDER = ("enc_computed", "dec_computed", "derived", "mask", "pred", "cfg", "done", "order", "tokens", "images",
                  "complete")


class IncompleteRunWarning(UserWarning):
    """The store has (sample, step) pairs whose data were not (completely) written."""


class DamagedRunWarning(UserWarning):
    """Chunks of finished steps or samples are missing from the store (they would read as fill values)."""


class SchemaError(ValueError):
    """The path is not a mar_probe run store of a schema version this code reads."""


def read_attrs(path) -> dict:
    """Root attributes of a run store (a folder or an fsspec URL), after checking that it is one of a readable
    schema version."""
    path = StoreLocation.of(path)
    path.check_reachable()  # an unreachable endpoint is named within a timeout, not retried for minutes
    if not path.exists():
        raise FileNotFoundError(f"run store {str(path)!r} not found; expected a folder written by `mar-probe record`")
    _check_metadata(path)
    try:
        attrs = dict(zarr.open_group(path.zarr_store(read_only=True), mode="r", use_consolidated=False).attrs)
    except Exception as exc:  # noqa: BLE001 - zarr raises several types for a non-store
        raise SchemaError(f"{str(path)!r} is not a zarr v3 group ({type(exc).__name__}: {exc}); expected a run "
                          "store written by `mar-probe record`") from exc
    version = attrs.get("schema_version")
    if version is None and attrs.get(CREATING_ATTR):
        raise SchemaError(f"run store {str(path)!r} is still being created, or its creation was killed (it has no "
                          "'schema_version' yet); rerun the `mar-probe record` command with --resume to recreate it")
    if version is None:
        raise SchemaError(f"{str(path)!r} has no 'schema_version' attribute; expected a run store written by "
                          f"`mar-probe record` (schema version {SCHEMA_VERSION})")
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"run store {str(path)!r} has schema version {version!r}, this mar_probe reads versions "
                          f"{READABLE_VERSIONS!r}; open it with the mar_probe version that wrote it "
                          f"({attrs.get('mar_probe_version')!r})")
    return attrs


def _check_metadata(path: StoreLocation) -> None:
    """Every ``zarr.json`` of the store parses: a truncated one is named instead of failing deep in zarr."""
    for key in path.metadata_keys():
        meta = f"{path.url.rstrip('/')}/{key}"
        try:
            text = path.read_text(key)
            if text is not None:
                json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SchemaError(f"run store {str(path)!r} is damaged: its metadata file {str(meta)!r} is not valid "
                              f"JSON ({exc}); metadata is written once when the store is created, so the store "
                              "cannot be repaired: record it again with --overwrite") from None


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def open_run(path, *, mask_incomplete: bool = True, warn: bool = True):
    """Open a run store as a lazy ``xarray.Dataset`` (dask-backed when dask is installed).

    bfloat16 variables are decoded to float32; JSON attributes (``model_config``, ``selection``, ...) are
    parsed. Per-step float variables of (sample, step) pairs without their ``done`` flag, and per-sample
    ones of samples without ``complete``, are masked with NaN; ``ds.attrs["incomplete"]`` lists the
    incomplete (sample, step) pairs and a :class:`IncompleteRunWarning` reports them.

    Parameters
    ----------
    path : str, Path or StoreLocation
        A store written by :func:`mar_probe.record` / ``mar-probe record``: a folder or an fsspec URL
        (``s3://bucket/run.zarr``; credentials and endpoint as :mod:`mar_probe.store.location` says).
    mask_incomplete : bool
        Mask data of incomplete steps and samples with NaN (default True).
    warn : bool
        Warn when the run is incomplete (default True).

    Raises
    ------
    SchemaError
        When the path is not a run store or has another schema version.
    """
    import xarray as xr
    path = StoreLocation.of(path)
    read_attrs(path)  # raises SchemaError unless a run store of a readable version
    try:
        import dask  # noqa: F401
        chunks = {}
    except ImportError:
        chunks = None
    ds = xr.open_zarr(path.zarr_store(read_only=True), consolidated=False, chunks=chunks, mask_and_scale=False)
    if chunks is not None:
        ds = _checked_reads(ds, path)
    for name in list(ds.data_vars):
        if ds[name].attrs.get("mar_probe_dtype") == "bfloat16":
            dec = xr.apply_ufunc(_bf16_to_f32, ds[name], dask="parallelized", output_dtypes=[np.float32])
            ds[name] = dec.assign_attrs({k: v for k, v in ds[name].attrs.items() if k != "mar_probe_dtype"})
    for key in JSON_ATTRS:
        if isinstance(ds.attrs.get(key), str):
            ds.attrs[key] = json.loads(ds.attrs[key])
    order = [v for v in ds.attrs.get("selection", {}).get("variables", []) if v in ds.data_vars]
    ds = ds[order + [v for v in VARIABLE_ORDER if v in ds.data_vars and v not in order]
            + sorted(v for v in ds.data_vars if v not in order and v not in VARIABLE_ORDER)]
    return _mark_incomplete(ds, path, mask_incomplete, warn)


class _CheckedChunks:
    """A zarr array whose failed chunk reads raise :class:`~mar_probe.store.writer.StoreDamagedError` naming the
    variable, the chunk and the fix, instead of a codec's bare traceback (issue 19)."""

    def __init__(self, array, name: str, path):
        self.array, self.name, self.path = array, name, path
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, key):
        try:
            return self.array[key]
        except (RuntimeError, ValueError) as exc:  # blosc, checksum and codec failures
            from .writer import StoreDamagedError, damaged_message
            starts = tuple(k.start or 0 for k in key) if isinstance(key, tuple) else ()
            chunk = tuple(s // c for s, c in zip(starts, self.array.chunks))
            raise StoreDamagedError(damaged_message(self.path, f"chunk {chunk!r} of {self.name!r}", exc)) from exc


def _checked_reads(ds, path):
    """Re-back every dask variable by :class:`_CheckedChunks` with the same chunks."""
    import dask.array as da
    root = zarr.open_group(path.zarr_store(read_only=True), mode="r", use_consolidated=False)
    for name in list(ds.data_vars):
        data = ds[name].data
        if hasattr(data, "dask") and data.ndim:
            checked = da.from_array(_CheckedChunks(root[name], name, path), chunks=data.chunks, asarray=True,
                                    lock=False, fancy=False, name=f"mar-probe-{name}-{data.name}")
            ds[name] = ds[name].copy(data=checked)
    return ds


def _missing(path, warn: bool) -> list:
    """The (sample, step) pairs whose chunks are absent (a listing: no data chunk is read); warns about them."""
    from .integrity import missing_chunks
    report = missing_chunks(path)
    if warn and not report.ok:
        warnings.warn(f"run {str(path)!r} is damaged: {len(report.damages)} chunks of finished steps or samples are "
                      f"missing or unreadable ({len(report.pairs)} (sample, step) pairs of samples "
                      f"{list(report.samples)[:8]!r}); they read as fill values (NaN). `mar-probe verify {path}` "
                      "lists them; `mar-probe record ... --resume --repair` re-records them.", DamagedRunWarning,
                      stacklevel=4)
    return [list(p) for p in report.pairs]


def _mark_incomplete(ds, path, mask: bool, warn: bool):
    from .writer import read_flags
    done, complete = read_flags(path)
    ds.attrs["damaged"] = _missing(path, warn)
    bad = np.argwhere(~done)
    samples = ds["sample"].values
    ds.attrs["incomplete"] = [(int(samples[i]), int(ds["step"].values[j])) for i, j in bad]
    ds.attrs["incomplete_samples"] = [int(s) for s in samples[~complete]]
    if mask and (len(bad) or (~complete).any()):
        for name, var in ds.data_vars.items():
            if var.dtype.kind != "f":
                continue
            if "step" in var.dims:
                ds[name] = var.where(ds["done"])
            elif "sample" in var.dims:
                ds[name] = var.where(ds["complete"])
    if warn and (len(bad) or (~complete).any()):
        first = ds.attrs["incomplete_samples"][:8] or sorted({s for s, _ in ds.attrs["incomplete"]})[:8]
        warnings.warn(f"run {str(path)!r} is incomplete: {len(bad)} of {done.size} (sample, step) pairs and "
                      f"{int((~complete).sum())} of {complete.size} samples lack their completion flag "
                      f"(first samples affected {first!r}); their data are masked with NaN. "
                      "Complete the run with `mar-probe record --resume`.", IncompleteRunWarning, stacklevel=3)
    return ds
