"""Strategy results as the comparison widget reads them: one entry per strategy, images and scalar metrics.

Accepted inputs (:func:`load_results`):

- a folder written by ``mar-probe compare`` / ``sweep`` or :func:`mar_probe.compare.write_results` (its
  ``results.json``, whose ``samples_path`` entries point at the images), or the path of such a JSON file;
- a mapping ``{strategy name: entry}`` or a sequence of entries that name themselves (``"strategy"`` or
  ``"name"``; a strategy given as a dict uses its ``"name"``); a JSON object may wrap the sequence under
  ``"strategies"`` or ``"results"``.

An entry holds scalar metrics (numbers, or intervals ``{"mean", "lo", "hi"}``, possibly nested: nested keys are
joined with dots, e.g. ``speedup.time``) and optionally images: ``"images"`` (uint8 [N, H, W(, C)]) or a
path to a ``.npz`` with an ``images`` array (``"images"``, ``"samples"``, ``"samples_path"`` or
``"images_path"``, relative to the results file). Descriptions (``config``, ``options``, ``settings``,
``machine``, ``per_seed``) are not metrics. Metrics are never recomputed here; the widget only reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_KEYS = ("images", "samples", "samples_path", "images_path")
NAME_KEYS = ("strategy", "name", "label")
SKIP_KEYS = ("config", "options", "settings", "machine", "per_seed")  # descriptions, not metrics
LO_KEYS = ("lo", "ci_lo", "low", "lower")
HI_KEYS = ("hi", "ci_hi", "high", "upper")
SPEED_HINTS = ("speedup_time", "speedup.time", "time_speedup", "speedup", "speedup_flops", "flops_speedup",
               "seconds")
FIDELITY_HINTS = ("psnr", "ssim", "token_cos", "cos", "token_mse", "mse", "accuracy", "frechet", "fid")


@dataclass(frozen=True)
class Metric:
    """A scalar with an optional interval."""
    mean: float
    lo: float | None = None
    hi: float | None = None

    def format(self, digits: int = 3) -> str:
        text = f"{self.mean:.{digits}g}"
        if self.lo is not None and self.hi is not None:
            text += f" [{self.lo:.{digits}g}, {self.hi:.{digits}g}]"
        return text


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy's results: its label, scalar metrics and images (uint8 [N, H, W, C] or None)."""
    name: str
    metrics: dict = field(default_factory=dict)
    images: np.ndarray | None = None


def _as_metric(value) -> Metric | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return Metric(float(value))
    if isinstance(value, dict) and isinstance(value.get("mean"), (int, float)):
        lo = next((float(value[k]) for k in LO_KEYS if isinstance(value.get(k), (int, float))), None)
        hi = next((float(value[k]) for k in HI_KEYS if isinstance(value.get(k), (int, float))), None)
        if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
            lo = hi = None  # no interval (e.g. one seed)
        return Metric(float(value["mean"]), lo, hi)
    return None


def flatten_metrics(entry: dict, prefix: str = "") -> dict[str, Metric]:
    """Scalar metrics of an entry, nested dicts joined with dots (intervals kept whole)."""
    out = {}
    for key, value in entry.items():
        if key in IMAGE_KEYS or key in NAME_KEYS or key in SKIP_KEYS:
            continue
        name = f"{prefix}{key}"
        metric = _as_metric(value)
        if metric is not None:
            out[name] = metric
        elif isinstance(value, dict):
            out.update(flatten_metrics(value, name + "."))
    return out


def _images(entry: dict, base: Path | None) -> np.ndarray | None:
    for key in IMAGE_KEYS:
        value = entry.get(key)
        if value is None:
            continue
        if isinstance(value, (str, Path)):
            path = Path(value) if base is None or Path(value).is_absolute() else base / value
            if not path.is_file():
                raise FileNotFoundError(f"images of strategy {_name(entry, '?')!r} not found at {str(path)!r}")
            with np.load(path) as f:
                value = f["images"]
        arr = np.asarray(value)
        if arr.dtype != np.uint8 or arr.ndim not in (3, 4):
            raise ValueError(f"images of strategy {_name(entry, '?')!r} must be uint8 [N, H, W(, C)], got "
                             f"{arr.dtype} {arr.shape!r}")
        return arr[..., None] if arr.ndim == 3 else arr
    return None


def _name(entry: dict, default: str) -> str:
    for key in NAME_KEYS:
        value = entry.get(key)
        if isinstance(value, dict):
            value = value.get("name")
        if isinstance(value, str):
            return value
    return default


def _entries(obj) -> list[tuple[str, dict]]:
    if isinstance(obj, dict):
        for wrapper in ("strategies", "results"):
            if isinstance(obj.get(wrapper), (list, dict)):
                return _entries(obj[wrapper])
        return [(_name(v, str(k)), v) for k, v in obj.items() if isinstance(v, dict)]
    if isinstance(obj, (list, tuple)):
        return [(_name(v, f"strategy {i}"), v) for i, v in enumerate(obj) if isinstance(v, dict)]
    raise TypeError(f"expected results as a path, mapping or list of entries, got {type(obj).__name__!r}")


def load_results(results) -> list[StrategyEntry]:
    """Normalise strategy results (see the module docstring) into :class:`StrategyEntry` objects.

    Parameters
    ----------
    results : str, Path, dict or list
        A ``mar-probe compare`` output folder or ``results.json``, or results in memory.

    Returns
    -------
    list of StrategyEntry
    """
    base = None
    if isinstance(results, (str, Path)):
        path = Path(results)
        path = path / "results.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"results {str(path)!r} not found; expected the folder or results.json "
                                    "written by `mar-probe compare`")
        base, results = path.parent, json.loads(path.read_text())
    entries = [StrategyEntry(name, flatten_metrics(e), _images(e, base)) for name, e in _entries(results)]
    if not entries:
        raise ValueError("no strategy entries found in the results; expected a mapping {strategy: metrics} or a "
                         "list of entries with a 'strategy' or 'name'")
    return entries


def pick_metric(names, hints) -> str | None:
    """The first metric whose name matches a hint (exact, then as a substring), in hint order."""
    names = list(names)
    for hint in hints:
        if hint in names:
            return hint
    for hint in hints:
        found = [n for n in names if hint in n.lower()]
        if found:
            return found[0]
    return names[0] if names else None
