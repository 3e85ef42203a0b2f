"""Finding and marking damage in a run store: chunks of finished steps that are missing or cannot be decoded.

A store's ``done``/``complete`` flags say which data were written; they cannot say whether the files are still
there and intact. A deleted chunk reads as fill values (NaN) without any error, and a chunk with garbage bytes
stops every read that touches it (issue 19). Two checks, two costs:

* :func:`missing_chunks` lists each variable's folder and compares it with the chunks that the flags say were
  written: no chunk is read, so :func:`~mar_probe.store.open_run` runs it on every open.
* :func:`verify` also decodes every such chunk (checksums included: new stores carry a crc32c per chunk, see
  :func:`~mar_probe.store.writer.compressors`), and reads the flags chunk by chunk so that damaged flags are
  found too.

:func:`mark_for_repair` clears the flags of what a report found damaged (whole chunks, so nothing is read), after
which ``record --resume`` re-records those samples and rewrites every one of their chunks: the repaired store
equals an undamaged run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import zarr

from .location import StoreLocation
FLAG_VARIABLES = ("done", "complete")


@dataclass(frozen=True)
class Damage:
    """One damaged chunk: ``variable``'s chunk of store row ``row`` (and step block ``block``, per-step ones)."""
    variable: str
    row: int
    block: int | None
    kind: Literal["missing", "corrupt"]
    detail: str = ""


@dataclass(frozen=True)
class IntegrityReport:
    """What :func:`verify` or :func:`missing_chunks` found; ``pairs`` are the damaged (sample, step) pairs."""
    path: str
    damages: tuple[Damage, ...]
    chunks_checked: int
    decoded: bool
    pairs: tuple[tuple[int, int], ...] = field(default=())
    samples: tuple[int, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.damages

    def format(self) -> str:
        how = "listed and decoded" if self.decoded else "listed"
        if self.ok:
            return f"{self.path}: ok ({self.chunks_checked} chunks of finished steps and samples {how})"
        lines = [f"{self.path}: DAMAGED: {len(self.damages)} of {self.chunks_checked} chunks {how} are damaged; "
                 f"{len(self.pairs)} finished (sample, step) pairs and {len(self.samples)} samples are affected "
                 f"(samples {list(self.samples)[:8]!r})"]
        for d in self.damages[:20]:
            where = f"row {d.row}" + (f", step block {d.block}" if d.block is not None else "")
            lines.append(f"  {d.kind:8s} {d.variable} ({where}){': ' + d.detail if d.detail else ''}")
        if len(self.damages) > 20:
            lines.append(f"  ... and {len(self.damages) - 20} more")
        lines.append("repair: `mar-probe record ... --resume --repair` with the run's settings re-records the "
                     "affected samples")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Var:
    name: str
    array: object  # zarr.Array
    per_step: bool


def data_variables(root) -> list[_Var]:
    """The arrays written per (sample, step block) or per sample, flags excluded, coordinates excluded."""
    coords = set(str(root.attrs.get("coordinates", "")).split())
    out = []
    for name, arr in root.arrays():
        dims = tuple(arr.metadata.dimension_names or ())
        if name in coords or name in dims or name in FLAG_VARIABLES or not dims or dims[0] != "sample":
            continue
        out.append(_Var(name, arr, len(dims) > 1 and dims[1] == "step"))
    return out


def _expected(var: _Var, done: np.ndarray, complete: np.ndarray):
    """(row, block or None, chunk coordinates) of every chunk the flags say was written."""
    rest = (0,) * (var.array.ndim - (2 if var.per_step else 1))
    if var.per_step:
        rows, steps = np.nonzero(done)
        for row, block in sorted(set(zip(rows.tolist(), (steps // var.array.chunks[1]).tolist()))):
            yield row, block, (row, block) + rest
    else:
        for row in np.flatnonzero(complete):
            yield int(row), None, (int(row),) + rest


def _listing(path: StoreLocation, name: str) -> set[str]:
    """Chunk keys present under a variable's folder (flat keys and older nested ones alike)."""
    return {k for k in path.keys(name) if k != "zarr.json"}


def _flags(root, report: list[Damage]) -> tuple[np.ndarray, np.ndarray]:
    """done [sample, step] and complete [sample], read chunk by chunk: an undecodable chunk counts as not done
    (and not complete), and is reported."""
    out = []
    for name in FLAG_VARIABLES:
        arr = root[name]
        try:
            out.append(np.asarray(arr[...]))
            continue
        except (RuntimeError, ValueError):  # some chunk is damaged: find which
            pass
        values = np.zeros(arr.shape, dtype=bool)
        for coords in np.ndindex(*_grid(arr)):
            sel = tuple(slice(c * n, (c + 1) * n) for c, n in zip(coords, arr.chunks))
            try:
                values[sel] = arr[sel]
            except Exception as exc:  # noqa: BLE001 - any decode failure is damage to report
                report.append(Damage(name, coords[0], coords[1] if len(coords) > 1 else None, "corrupt",
                                     f"{type(exc).__name__}: {exc}"))
        out.append(values)
    return out[0], out[1]


def _grid(arr) -> tuple[int, ...]:
    return tuple(-(-s // c) for s, c in zip(arr.shape, arr.chunks))


def _open(path) -> tuple[StoreLocation, object]:
    from .reader import read_attrs
    path = StoreLocation.of(path)
    read_attrs(path)  # a clear error when this is no run store
    return path, zarr.open_group(path.zarr_store(read_only=True), mode="r", use_consolidated=False)


def missing_chunks(path) -> IntegrityReport:
    """Chunks of finished steps and samples that are absent from the store (a listing: nothing is decoded)."""
    return _check(path, decode=False)


def verify(path) -> IntegrityReport:
    """Every chunk of finished steps and samples present and decodable, the flags themselves included."""
    return _check(path, decode=True)


def _check(path, decode: bool) -> IntegrityReport:
    path, root = _open(path)
    damages: list[Damage] = []
    done, complete = _flags(root, damages)  # small: always decoded, chunk by chunk
    checked = 0
    for var in data_variables(root):
        present = _listing(path, var.name)
        for row, block, coords in _expected(var, done, complete):
            checked += 1
            if var.array.metadata.encode_chunk_key(coords) not in present:
                damages.append(Damage(var.name, row, block, "missing"))
            elif decode:
                damages.extend(_decode(var, row, block, coords))
    return _report(path, damages, checked, decode, done, complete, root)


def _decode(var: _Var, row: int, block: int | None, coords) -> list[Damage]:
    sel = tuple(slice(c * n, (c + 1) * n) for c, n in zip(coords, var.array.chunks))
    try:
        var.array[sel]
    except Exception as exc:  # noqa: BLE001 - any decode failure is damage to report
        return [Damage(var.name, row, block, "corrupt", f"{type(exc).__name__}: {exc}")]
    return []


def _report(path, damages, checked, decoded, done, complete, root) -> IntegrityReport:
    size = root["done"].chunks[1]
    pairs, samples = set(), set()
    sample_ids = np.asarray(root["sample"][...])
    step_ids = np.asarray(root["step"][...])
    for d in damages:
        samples.add(int(sample_ids[d.row]))
        if d.block is None:
            steps = np.flatnonzero(done[d.row]) if d.variable != "complete" else []
        else:
            span = np.arange(d.block * size, min((d.block + 1) * size, done.shape[1]))
            steps = span[done[d.row, span]] if d.variable != "done" else span
        pairs.update((int(sample_ids[d.row]), int(step_ids[s])) for s in steps)
    return IntegrityReport(str(path), tuple(damages), checked, decoded, tuple(sorted(pairs)), tuple(sorted(samples)))


def mark_for_repair(path, report: IntegrityReport) -> list[int]:
    """Clear ``done`` of every step block and ``complete`` of every row that ``report`` found damaged, so that
    ``record --resume`` re-records those rows; returns the rows. Whole flag chunks are written, none is read."""
    root = zarr.open_group(StoreLocation.of(path).zarr_store(), mode="r+", use_consolidated=False)
    done = root["done"]
    rows = sorted({d.row for d in report.damages})
    size, steps = done.chunks[1], done.shape[1]
    for row in rows:
        for start in range(0, steps, size):
            done[row:row + 1, start:start + size] = np.zeros((1, min(size, steps - start)), dtype=bool)
        root["complete"][row:row + 1] = np.zeros(1, dtype=bool)
    return rows
