"""Creating a run store and writing it off the sampling thread.

:func:`create_store` writes all metadata (arrays, coordinates, attrs) once, before any data; shards and resumed runs
open it with :class:`StoreWriter`, which writes the chunks of everything queued concurrently. Every chunk holds one
sample's block of steps (see :func:`~mar_probe.store.schema.auto_steps_per_chunk`) or one sample; the writer
assembles a block in memory (:class:`StepBlocks`) and writes it once it is whole, so every write covers whole
chunks: no chunk is read, modified and written back, and writers of disjoint samples never touch the same file.
zarr's local store (zarr >= 3.1.3) writes each chunk to a temporary file and renames it into place, so a killed
writer leaves no torn chunk. The ``done`` flag of a (sample, step) is written only after that step's data, and
``complete`` of a sample only after all of its data and flags. A block still open when the writer closes (an
interrupted run) is written with the steps it has and fill values elsewhere, its missing steps not flagged done; a
killed process loses at most the open blocks, which ``--resume`` redoes.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zarr
import zarr.core.sync
from zarr.codecs import BloscCodec, Crc32cCodec

from .._io import describe_os_error
from .location import StoreLocation
from .schema import RunLayout, VarLayout, coordinates

_STOP = object()


COMPRESSIONS = ("lz4", "zstd", "none")


def compressors(compression: str = "lz4") -> tuple:
    """The codec chain of every data variable: Blosc with byte shuffle (good on float16 activations).

    Every chain ends with a crc32c checksum of the chunk, so a damaged chunk fails to decode instead of reading
    as other values.
    ``lz4`` (default, clevel 5) costs the least CPU per byte; ``zstd`` (clevel 3) compresses activations about 8%
    smaller at about 1.6x the CPU time (see ``benchmarks/bench_record.py``); ``none`` stores raw chunks.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS!r}")
    checksum = Crc32cCodec()  # last: every chunk carries a crc32c of its stored bytes (issue 19: damage is found)
    if compression == "none":
        return (checksum,)
    level = 5 if compression == "lz4" else 3
    return (BloscCodec(cname=compression, clevel=level, shuffle="shuffle"), checksum)


class StoreExistsError(FileExistsError, ValueError):
    """The store exists and neither resuming nor overwriting was asked for."""


#: Root attribute of a store whose creation is under way (object stores build it in place: issue 16).
CREATING_ATTR = "mar_probe_creating"


def create_store(path, layout: RunLayout, *, labels, seeds, attrs: dict, overwrite: bool = False,
                 compression: str = "lz4"):
    """Create the store at ``path`` (a folder or an fsspec URL) with every array, coordinate and attribute, and no
    data; returns its :class:`~mar_probe.store.location.StoreLocation`.

    ``compression`` names the codec of the data variables (see :func:`compressors`). The root attributes are
    written last: until then they hold only :data:`CREATING_ATTR`, so a creation killed half-way is recognised
    (readers see no ``schema_version``) wherever the store lives.

    Raises
    ------
    StoreExistsError
        When ``path`` exists and ``overwrite`` is False.
    """
    loc, codecs = StoreLocation.of(path), compressors(compression)
    if loc.exists():
        if not overwrite:
            raise StoreExistsError(f"store {str(loc)!r} already exists; pass --resume to complete it or "
                                  "--overwrite to replace it")
        loc.remove()
    coords = coordinates(layout, labels, seeds)
    root = zarr.open_group(loc.zarr_store(), mode="w-", zarr_format=3, attributes={CREATING_ATTR: True})
    for name, (dim, values) in coords.items():
        shape = np.asarray(values).shape  # a coordinate is one chunk
        coord = VarLayout(name=name, dims=(dim,), shape=shape, chunks=shape, dtype=values.dtype,
                          fill=_coord_fill(values), per_step=False)
        _create(root, coord, codecs)[...] = values
    for v in layout.variables.values():
        _create(root, v, codecs)
    extra = {"coordinates": " ".join(k for k, (d, _) in coords.items() if k != d)}
    root.attrs.put({**{k: _jsonable(v) for k, v in attrs.items()}, **extra})  # replaces the marker: one write
    with warnings.catch_warnings():  # metadata never changes after creation, so consolidating is safe
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(loc.zarr_store())
    return loc


def _coord_fill(values):
    return "" if values.dtype == object else 0


def _create(root, var: VarLayout, codecs):
    text = np.dtype(var.dtype) == object
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return root.create_array(var.name, shape=var.shape, chunks=var.chunks, dtype=str if text else var.dtype,
                                 fill_value=var.fill, dimension_names=var.dims, attributes=var.attrs,
                                 compressors="auto" if text else codecs,
                                 chunk_key_encoding={"name": "default", "separator": "."})


def _jsonable(v):
    if isinstance(v, (dict, list, tuple)):
        return json.loads(json.dumps(v, default=str))
    return v


class WriteError(RuntimeError):
    """Writing the store failed (e.g. the disk is full); steps not flagged done are redone by --resume."""


def check_writer_settings(queue_size, threads) -> None:
    """Both must be integers >= 1 (checked before a store is created: issue 19)."""
    for name, value in (("queue_size", queue_size), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class StoreWriter:
    """Writes step records and per-sample results to an existing store from a background thread.

    The thread takes every record queued so far (at most ``queue_size``) and writes their chunks concurrently
    (zarr's async API on the thread's own event loop, compression and file writes on ``threads`` worker threads),
    then, once all of those chunks are on disk, their ``done``/``complete`` flags. Chunks are disjoint, so the
    order of data writes does not matter; a flag is never written before its data.

    Parameters
    ----------
    path : str, Path or StoreLocation
        A store made by :func:`create_store` (a folder or an fsspec URL).
    layout : RunLayout
        The layout the store was created with.
    queue_size : int
        Records held in memory at most; the sampler blocks when the queue is full.
    threads : int
        Worker threads compressing and writing chunks.
    """

    def __init__(self, path, layout: RunLayout, *, queue_size: int = 8, threads: int = 4):
        check_writer_settings(queue_size, threads)
        self.location, self.layout, self.threads = StoreLocation.of(path), layout, threads
        self.path = self.location.url
        root = zarr.open_group(self.location.zarr_store(), mode="r+", use_consolidated=False)
        # every chunk is written once, whole: skip zarr's per-chunk check whether it holds only fill values
        self._arrays = {name: root[name].async_array.with_config({"write_empty_chunks": True})
                        for name in layout.variables}
        self._blocks = StepBlocks(root["done"].chunks[1], root["done"].shape[1],
                                  {k: a.metadata.fill_value for k, a in self._arrays.items()})
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._max_batch = queue_size
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
        loop = asyncio.new_event_loop()
        loop.set_default_executor(ThreadPoolExecutor(self.threads, thread_name_prefix="mar-probe-chunks"))
        # a remote store's client session belongs to zarr's event loop (where the store was opened): its writes
        # run there; local chunks are compressed and written on this thread's loop and its ``threads`` workers
        run = loop.run_until_complete if self.location.is_local else zarr.core.sync.sync
        try:
            stop = False
            while not stop:
                items, stop = self._take()
                if stop:
                    items.append(("flush", None))  # the blocks still open: an interrupted run keeps its steps
                if items and self._error is None:  # after an error: drain, so the producer never blocks
                    try:
                        run(self._write_batch(items))
                    except BaseException as exc:  # noqa: BLE001 - reported to the sampling thread
                        self._error = exc
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def _take(self) -> tuple[list, bool]:
        """Wait for one queued item, then take the others already queued; (items, whether close was asked)."""
        items = [self._queue.get()]
        while len(items) < self._max_batch and items[-1] is not _STOP:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        stop = items[-1] is _STOP
        return (items[:-1] if stop else items), stop

    async def _write_batch(self, items) -> None:
        """Write the whole blocks and per-sample arrays of ``items`` concurrently, then their ``done`` flags,
        then ``complete`` (each stage only once the one before is on disk).

        Writes are collected as (array, selection, value) and become coroutines only when their stage runs: a
        stage that is never reached (its data failed) leaves no coroutine unawaited (issue 19's warning)."""
        data, done, complete, nbytes = [], [], [], 0
        for kind, payload in items:
            if kind == "step":
                blocks = self._blocks.add(payload)
            elif kind == "sample":
                row, arrays = payload
                blocks = self._blocks.flush(row)
                for name, arr in arrays.items():
                    if name in self._arrays:
                        data.append((self._arrays[name], row, arr))
                        nbytes += arr.nbytes
                complete.append((self._arrays["complete"], row, True))
            else:
                blocks = self._blocks.flush()
            for block in blocks:
                sel = (slice(block.row, block.row + 1), slice(block.start, block.start + len(block.got)))
                for name, arr in block.arrays.items():
                    data.append((self._arrays[name], sel, arr))
                    nbytes += arr.nbytes // len(block.got) * int(block.got.sum())  # the steps recorded, not fill
                done.append((self._arrays["done"], sel, block.got[None]))
        await _write_all(data)
        self.bytes_logical += nbytes
        await _write_all(done)
        await _write_all(complete)


@dataclass
class Block:
    """The steps ``start .. start + len(got) - 1`` of store row ``row``: ``arrays[name]`` [1, n, ...]."""
    row: int
    start: int
    arrays: dict
    got: np.ndarray  # [n] bool: which steps arrived


class StepBlocks:
    """Assembles the step records of each (sample row, block of ``steps_per_chunk`` steps) into one chunk.

    Parameters
    ----------
    steps_per_chunk, num_steps : int
        The store's step chunk length and step-axis length.
    fills : dict
        Variable name -> fill value, written at steps that never arrived.
    """

    def __init__(self, steps_per_chunk: int, num_steps: int, fills: dict):
        self.size, self.num_steps, self.fills = steps_per_chunk, num_steps, fills
        self._open: dict[tuple[int, int], Block] = {}

    def add(self, record) -> list[Block]:
        """Copy a :class:`~mar_probe.probe.StepRecord` into its blocks; return the blocks it completed."""
        whole = []
        for i, row in enumerate(record.rows):
            key = (row, record.step_pos // self.size)
            block = self._open.get(key) or self._new(key, record.arrays)
            at = record.step_pos - block.start
            for name, arr in record.arrays.items():
                block.arrays[name][0, at] = arr[i]
            block.got[at] = True
            if block.got.all():
                whole.append(self._open.pop(key))
        return whole

    def _new(self, key: tuple[int, int], arrays: dict) -> Block:
        start = key[1] * self.size
        n = min(self.size, self.num_steps - start)
        block = Block(key[0], start, {k: np.empty((1, n) + a.shape[1:], a.dtype) for k, a in arrays.items()},
                      np.zeros(n, dtype=bool))
        self._open[key] = block
        return block

    def flush(self, row: int | None = None) -> list[Block]:
        """Close the open blocks of ``row`` (None: all), with fill values at the steps that never arrived."""
        keys = [k for k in self._open if row is None or k[0] == row]
        out = [self._open.pop(k) for k in keys]
        for block in out:
            for name, arr in block.arrays.items():
                arr[0, ~block.got] = self.fills[name]
        return out


async def _write_all(writes) -> None:
    """Run every ``(array, selection, value)`` write concurrently and wait for all; then raise the first error."""
    results = await asyncio.gather(*(array.setitem(sel, value) for array, sel, value in writes),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


class StoreDamagedError(ValueError):
    """A chunk of the store cannot be decoded (garbage bytes, a failed checksum)."""


def damaged_message(path, what: str, exc: BaseException) -> str:
    """What to say when a chunk cannot be decoded, and what to do about it."""
    return (f"run store {str(path)!r} is damaged: {what} cannot be decoded ({type(exc).__name__}: {exc}); "
            f"`mar-probe verify {path}` lists every damaged chunk and `mar-probe record ... --resume --repair` "
            "(with the run's settings) re-records the affected samples")


def read_flags(path) -> tuple[np.ndarray, np.ndarray]:
    """(done [sample, step], complete [sample]) of a store, as numpy arrays.

    Raises
    ------
    StoreDamagedError
        When a flag chunk cannot be decoded.
    """
    root = zarr.open_group(StoreLocation.of(path).zarr_store(read_only=True), mode="r", use_consolidated=False)
    try:
        return np.asarray(root["done"][...]), np.asarray(root["complete"][...])
    except (RuntimeError, ValueError) as exc:  # blosc, checksum and codec failures
        raise StoreDamagedError(damaged_message(path, "its done/complete flags", exc)) from exc
