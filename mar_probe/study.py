"""The toolkit's main job: record runs of a model, then write their image grid, figures and summary.

``mar-probe study`` (the README's main command) calls :func:`run_study`, which chains the library:
:func:`mar_probe.probe.record.record` (one store per seed) -> :func:`mar_probe.analysis.open_runs` ->
:func:`mar_probe.plot.report.write_figures` and :func:`mar_probe.analysis.run_summary`. Its defaults fit a
few minutes on 2 CPU cores with the embedded model; the papers' setting (64 steps, CFG 3.0) is kept and the
sample count is the lever.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ._config import checked_fields

STUDY_VARIABLES = ("dec_k", "dec_v", "dec_resid_post", "z", "z_cfg_resid", "attn_gen")
"""What the figures and the summary need. With ``branches=("cond",)`` the unconditional output is
``z - z_cfg_resid``, so the conditional branch suffices and the store is half the size."""


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"StudyConfig.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """What :func:`run_study` records and reports.

    Parameters
    ----------
    out : str
        Output folder or fsspec URL: ``seed{S}.zarr`` stores, ``grid.png``, ``figures/``, ``summary.txt``/``.json``,
        ``study.json``.
    samples_per_seed : int
        Images per seed; sample i of the j-th seed has class ``(j * samples_per_seed + i) % num_classes``.
    seeds : tuple of int
        Run seeds, one store each (their samples are pooled; intervals are over all samples).
    num_iter, cfg, cfg_schedule : sampling settings (the papers': 64 steps, CFG 3.0, linear schedule).
    temperature : float, optional
        Diffusion temperature (default: the checkpoint's recommended value, else 1.0).
    variables, branches : what the stores hold (see :data:`STUDY_VARIABLES`).
    layer, k : selection layer (0-based; MARché's Layer 2 is 1) and budget K of the summary.
    formats : image formats of the figures.
    overwrite : replace existing stores instead of reusing complete ones.
    """
    out: str = "runs/study"
    # 1 since issue 14's MAR-B-shaped default: at 2 per seed its study took well over a minute on 2 cores, at 1 less
    # than one (benchmarks/results/study_time_b128*.json); the issue says "shrink the study, not the model"
    samples_per_seed: int = 1
    seeds: tuple[int, ...] = (0, 1)
    num_iter: int = 64
    cfg: float = 3.0
    cfg_schedule: str = "linear"
    temperature: float | None = None
    variables: tuple[str, ...] = STUDY_VARIABLES
    branches: tuple[str, ...] = ("cond",)
    layer: int = 1
    k: int = 64
    formats: tuple[str, ...] = ("png",)
    overwrite: bool = False

    def __post_init__(self):
        for name in ("seeds", "variables", "branches", "formats"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        for name in ("samples_per_seed", "num_iter", "k"):
            _positive(name, getattr(self, name))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(
                not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"StudyConfig.seeds must be distinct non-negative integers, got {self.seeds!r}")
        self.sampling  # noqa: B018  (validates the sampling fields)
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"StudyConfig.layer must be a non-negative integer, got {self.layer!r}")
        if self.cfg == 1.0 and "z_cfg_resid" in self.variables:
            raise ValueError("StudyConfig.cfg must differ from 1.0 to measure the CFG residual, got 1.0")

    @property
    def sampling(self):
        """The sampling fields as the engine's :class:`~mar_probe.engine.SamplingConfig` (temperature None: the
        checkpoint's recommended one, else the official default)."""
        from .engine.sampling import SamplingConfig
        return SamplingConfig.of(self)

    def to_dict(self) -> dict:
        """Plain JSON-able dict (lists for tuples)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> StudyConfig:
        """Build from :meth:`to_dict`'s output, with a clear error for unknown keys."""
        return cls(**checked_fields(cls, data))

    def labels(self, seed_index: int, num_classes: int):
        """Class labels of the ``seed_index``-th seed's samples."""
        import numpy as np
        first = seed_index * self.samples_per_seed
        return (np.arange(first, first + self.samples_per_seed) % num_classes).astype(np.int64)


@dataclass
class StudyResult:
    """What :func:`run_study` wrote, its summary table and the seconds each stage took (``out``: a folder, or the
    URL the study was written to; ``figures`` name the files as written before an upload)."""
    out: Path | str
    stores: list
    figures: dict
    skipped: dict
    summary: object
    summary_skipped: dict
    seconds: dict


def record_stores(model, config: StudyConfig, *, checkpoint=None, progress: bool = True) -> list:
    """Record the study's stores: one per seed under ``config.out`` (a folder or a URL), a complete store of the
    same settings reused (``record``'s resume). Returns their paths (local) or URLs, for
    :func:`mar_probe.analysis.open_runs`.

    Public so that other recorders of the study's stores (``benchmarks/training_stages.py``) call this one
    function: a change of its arguments then breaks them visibly instead of silently (the private helper it
    replaces broke that benchmark once, issue 14).
    """
    from .probe.record import record
    from .store.location import StoreLocation, join
    from .store.spec import SelectionSpec
    spec = SelectionSpec(variables=config.variables, branches=config.branches)
    stores = []
    for j, seed in enumerate(config.seeds):
        path = StoreLocation.of(join(config.out, f"seed{seed}.zarr"))
        res = record(model, config.labels(j, model.num_classes), path, spec, sampling=config.sampling, seed=seed,
                     batch_size=config.samples_per_seed, checkpoint=checkpoint,
                     resume=path.exists() and not config.overwrite, overwrite=config.overwrite, progress=progress)
        stores.append(path.local_path if path.is_local else res.path.url)
    return stores


def _write_grid(ds, path: Path) -> Path | None:
    from .plot.grid import save_image_grid
    if "images" not in ds.data_vars:
        return None
    return save_image_grid(ds["images"].values, path, labels=ds["label"].values)


def _write_index(out: Path, written, skipped: dict, fmt: str) -> None:
    """``index.html``: the whole study on one page (issue 15): the image grid, the summary and every figure."""
    from .plot.report import IndexEntry, figure_entries, index_html
    entries = [IndexEntry("images", "the generated images, one row per sample", "grid.png")] \
        if (out / "grid.png").is_file() else []
    entries.append(IndexEntry("summary", "the measurements with 95% intervals over samples (summary.txt)",
                              values="summary.json", text=(out / "summary.txt").read_text()))
    (out / "index.html").write_text(index_html("mar-probe study", entries + figure_entries(
        written, skipped, fmt, folder="figures/")))


def _write_summary(ds, config: StudyConfig, out: Path):
    from .analysis import format_summary, run_summary, summary_json
    table, skipped = run_summary(ds, layer=config.layer, k=config.k)
    (out / "summary.txt").write_text(format_summary(table, skipped))
    (out / "summary.json").write_text(json.dumps(summary_json(table, skipped, ds=ds), indent=2, default=str))
    return table, skipped


def run_study(config: StudyConfig | None = None, model=None, *, checkpoint=None, progress: bool = True) -> StudyResult:
    """Record ``config.seeds`` runs, then write ``grid.png``, ``figures/`` and ``summary.txt``/``.json``.

    Parameters
    ----------
    config : StudyConfig, optional
        What to record and report (default: :class:`StudyConfig`'s defaults).
    model : MAR, optional
        The model (default: the embedded Fashion-MNIST model, :func:`mar_probe.load_model`).
    checkpoint : path, optional
        The checkpoint the model came from (its SHA-256 goes into the stores); default: the embedded one.
    progress : bool
        Show progress bars.

    Returns
    -------
    StudyResult
    """
    from .analysis import open_runs
    from .models.checkpoints import DEFAULT_CHECKPOINT, load_model
    from .plot.report import write_figures
    config = config or StudyConfig()
    if model is None:
        model, checkpoint = load_model(), checkpoint or DEFAULT_CHECKPOINT
    from .store.location import StoreLocation, output_folder
    seconds, t0 = {}, time.perf_counter()
    stores = record_stores(model, config, checkpoint=checkpoint, progress=progress)
    seconds["record"], t0 = time.perf_counter() - t0, time.perf_counter()
    ds = open_runs(stores)
    with output_folder(config.out) as out:  # a URL: written here, uploaded at the end (store/location.py)
        out.mkdir(parents=True, exist_ok=True)
        _write_grid(ds, out / "grid.png")
        written, skipped = write_figures(ds, out / "figures", formats=config.formats, progress=progress)
        seconds["figures"], t0 = time.perf_counter() - t0, time.perf_counter()
        table, summary_skipped = _write_summary(ds, config, out)
        seconds["summary"] = time.perf_counter() - t0
        (out / "study.json").write_text(json.dumps({"config": config.to_dict(), "stores": [str(s) for s in stores],
                                                    "seconds": seconds}, indent=2))
        _write_index(out, written, skipped, config.formats[0])
    where = StoreLocation.of(config.out)
    return StudyResult(where.local_path if where.is_local else where.url, stores, written, skipped, table,
                       summary_skipped, seconds)
