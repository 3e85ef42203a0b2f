"""Creating a run store and writing it off the sampling thread.

:func:`create_store` writes all metadata (arrays, coordinates, attrs) once, before any data; shards and
resumed runs open it with :class:`StoreWriter`. Every chunk holds one (sample, step) or one sample, so every
write covers whole chunks: no chunk is read, modified and written back, and writers of disjoint samples
never touch the same file. zarr's local store writes each chunk to a temporary file and renames it into
place, so a killed writer leaves no torn chunk. The ``done`` flag of a (sample, step) is written only after
that step's data, and ``complete`` of a sample only after all of its data.
"""
from __future__ import annotations

import errno
import json
import queue
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from .schema import RunLayout, coordinates

_STOP = object()


def compressors():
    """The codec chain of every data variable: Blosc zstd with byte shuffle (good on float16 activations)."""
    return (BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"),)


class StoreExistsError(FileExistsError, ValueError):
    """The store exists and neither resuming nor overwriting was asked for."""


def create_store(path: str | Path, layout: RunLayout, *, labels, seeds, attrs: dict, overwrite: bool = False):
    """Create the store at ``path`` with every array, coordinate and attribute, and no data.

    Raises
    ------
    StoreExistsError
        When ``path`` exists and ``overwrite`` is False.
    """
    path = Path(path)
    if path.exists():
        if not overwrite:
            raise StoreExistsError(f"store {str(path)!r} already exists; pass --resume to complete it or "
                                  "--overwrite to replace it")
        shutil.rmtree(path)
    coords = coordinates(layout, labels, seeds)
    root = zarr.open_group(str(path), mode="w-", zarr_format=3)
    extra = {"coordinates": " ".join(k for k, (d, _) in coords.items() if k != d)}
    root.attrs.update({**{k: _jsonable(v) for k, v in attrs.items()}, **extra})
    for name, (dim, values) in coords.items():
        _create(root, name, np.asarray(values).shape, np.asarray(values).shape, values.dtype, _coord_fill(values),
                (dim,), {}).__setitem__(Ellipsis, values)
    for v in layout.variables.values():
        _create(root, v.name, v.shape, v.chunks, v.dtype, v.fill, v.dims, v.attrs)
    with warnings.catch_warnings():  # metadata never changes after creation, so consolidating is safe
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    return path


def _coord_fill(values):
    return "" if values.dtype == object else 0


def _create(root, name, shape, chunks, dtype, fill, dims, attrs):
    text = np.dtype(dtype) == object
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return root.create_array(name, shape=shape, chunks=chunks, dtype=str if text else dtype, fill_value=fill,
                                 dimension_names=dims, attributes=attrs, compressors="auto" if text else compressors())


def _jsonable(v):
    if isinstance(v, (dict, list, tuple)):
        return json.loads(json.dumps(v, default=str))
    return v


class WriteError(RuntimeError):
    """Writing the store failed (e.g. the disk is full); steps not flagged done are redone by --resume."""


def describe_os_error(exc: BaseException) -> str:
    """``Type: message``, with a hint when the disk is full."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text += " (the disk is full: free space or choose another --out)"
    return text


class StoreWriter:
    """Writes step records and per-sample results to an existing store from a background thread.

    Parameters
    ----------
    path : str or Path
        A store made by :func:`create_store`.
    layout : RunLayout
        The layout the store was created with.
    queue_size : int
        Records held in memory at most; the sampler blocks when the queue is full.
    """

    def __init__(self, path, layout: RunLayout, *, queue_size: int = 8):
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size!r}")
        self.path, self.layout = Path(path), layout
        root = zarr.open_group(str(self.path), mode="r+", use_consolidated=False)
        self._arrays = {name: root[name] for name in layout.variables}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self.bytes_logical = 0
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="mar-probe-writer", daemon=True)
        self._thread.start()

    def put_step(self, record) -> None:
        """Queue a :class:`~mar_probe.probe.StepRecord` (blocks while the queue is full)."""
        self._put(("step", record))

    def put_sample(self, row: int, arrays: dict) -> None:
        """Queue the per-sample arrays (order, tokens, images) of store row ``row``; ``complete`` follows."""
        self._put(("sample", (row, arrays)))

    def _put(self, item) -> None:
        self._raise_if_failed()
        t0 = time.perf_counter()
        self._queue.put(item)
        self.wait_s += time.perf_counter() - t0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise WriteError(f"writing the store {str(self.path)!r} failed: {describe_os_error(err)}; the store stays "
                             "consistent: steps written so far are flagged done, the others are masked as incomplete "
                             "and redone by `mar-probe record --resume` with the same settings") from err

    def close(self, *, raise_error: bool = True) -> None:
        """Wait until everything queued is written; raise :class:`WriteError` if a write failed."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        if raise_error:
            self._raise_if_failed()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain so that the producer never blocks forever
            try:
                self._write(*item)
            except BaseException as exc:  # noqa: BLE001 - reported to the sampling thread
                self._error = exc

    def _write(self, kind: str, payload) -> None:
        if kind == "step":
            rec = payload
            for i, row in enumerate(rec.rows):
                for name, arr in rec.arrays.items():
                    self._arrays[name][row, rec.step_pos] = arr[i]
                    self.bytes_logical += arr[i].nbytes
                self._arrays["done"][row, rec.step_pos] = True
            return
        row, arrays = payload
        for name, arr in arrays.items():
            if name in self._arrays:
                self._arrays[name][row] = arr
                self.bytes_logical += arr.nbytes
        self._arrays["complete"][row] = True


def read_flags(path) -> tuple[np.ndarray, np.ndarray]:
    """(done [sample, step], complete [sample]) of a store, as numpy arrays."""
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    return np.asarray(root["done"][...]), np.asarray(root["complete"][...])
