"""Judging strategies side by side: ``mar-probe compare`` and ``mar-probe sweep``.

:func:`compare` runs chosen strategies on the same samples — same labels, seeds, generation orders and noise as
``full`` (see :mod:`mar_probe.quality.paired`) — and reports per strategy, with intervals over seeds or images:

* speed over ``full``: time (seconds spent in the encoder, decoder and head, from the strategy's own timer) and
  FLOPs (counted by the strategy), each a ratio per seed;
* paired fidelity against ``full``'s images: token MSE and cosine, pixel PSNR and SSIM, per image;
* distribution quality: class-conditional accuracy and the Fréchet distance of the Fashion-MNIST classifier's
  features (28x28 grayscale models such as the embedded default), or FID/IS for RGB images when InceptionV3 weights
  (and reference statistics, for FID) are given; absent otherwise;
* optionally (``shadow=True``) the mean shadow errors of what the strategy used (see :mod:`mar_probe.probe.shadow`);
* optionally (``paired_against=LABEL``) every other strategy's per-image fidelity minus LABEL's, so that two
  strategies are compared image by image rather than through two overlapping intervals.

:func:`write_results` lays the result out as ``results.json`` (format below), ``results.csv`` (one row per
strategy), ``samples/LABEL.npz`` (images, labels, tokens [N, seq_len, dim] of the first seed, as
``mar-probe generate`` writes them) and ``grid.png`` (strategies in rows).
With ``partial=DIR`` every finished (strategy, seed) run is kept in DIR (:class:`PartialRuns`), and ``resume=True``
reuses them after an interruption. :func:`sweep` runs one strategy over a grid of one or two options with the same
machinery and adds the Pareto front of speed against fidelity.

``results.json`` (``format = "mar_probe.compare"``, ``version = 1``)::

    {"format", "version", "command": the command line or None, "settings": CompareConfig.to_dict(),
     "machine": {...}, "model", "weights_sha256", "speed_scope": SPEED_SCOPE (what the speed-ups cover),
     "ranks": {"world_size", "spread"} under torchrun, else None (with spread "runs" a seed's speed-ups compare
              seconds measured by different processes),
     "unrelated_floor": {"against", "seed_pairs", "token_mse": I, "token_cos": I, "psnr": I, "ssim": I} or None
                        (full's images of each seed against the previous seed's: :func:`unrelated_floor`),
     "strategies": {LABEL: {
         "label", "config": strategy.to_dict(), "steps", "samples_path": "samples/LABEL.npz",
         "seconds": I, "gflops": I, "speedup": {"time": I, "flops": I},
         "fidelity": {"token_mse": D, "token_cos": D, "psnr": D, "ssim": D},
         "quality": {"class_accuracy": I, "frechet_distance": I} or {"fid": I, "inception_score": I} or {},
         "quality_vs_full": {"against": "full", "frechet_distance": P} or {"against": "full", "fid": P}
                            (with a quality judge),
         "shadow": {"dec_kv_err": I, "enc_kv_err": I, "z_err": I} (with shadow=True),
         "paired": {"against": LABEL, "token_mse": I, "token_cos": I, "psnr": I, "ssim": I,
                    "frechet_distance": P or "fid": P (with a quality judge)} (with paired_against),
         "per_seed": [{"seed", "seconds", "flops", "frechet_distance", ...}, ...]}}}

where ``I = {"mean", "lo", "hi", "n", "clipped"}`` is a mean with its 95% Student-t interval over seeds (speed,
Fréchet distance, FID, IS) or images (accuracy, shadow, paired differences); ``D`` adds ``median``, ``q05``, ``q95``,
``min``, ``max`` over all images of all seeds and ``statistics``: ``{"mean", "median", "tail", "worst"}``, each an
:class:`~mar_probe.quality.paired.Interval` dict (``estimate``, ``low``, ``high``, ``n``, ``statistic``, ``method``,
``level``, ``clipped``): the mean's t-interval and percentile-bootstrap intervals over images of the median, the bad
tail (``p5`` where higher is better, ``p95`` for ``token_mse``) and the worst image (``min``, or ``max`` for
``token_mse``). ``P`` is a Fréchet distance compared seed by seed: ``I`` of the per-seed differences
``FD(strategy, seed) - FD(against, seed)`` over seeds, ``against`` and ``per_seed: [{"seed", "difference"}]``.
Every interval is clipped to its quantity's range (:data:`METRICS`; differences to the range of a difference) and
``clipped`` says when that moved an end. One value (one seed, one image) gives no interval: ``lo = hi = None``
and ``note`` says so. ``full``'s own fidelity is exact (MSE 0, PSNR 100 dB = identical).
Version 1 readers keep working: the keys above were added, none removed or renamed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from tqdm.auto import tqdm

from ._config import checked_fields
from .engine.sampling import SamplingConfig
from .launch import Ranks, gather, on_rank0
from .machine import machine
from .quality.paired import PSNR_IDENTICAL, difference_bounds, interval, paired_fidelity, summarize

FORMAT, VERSION = "mar_probe.compare", 1
FIDELITY = ("token_mse", "token_cos", "psnr", "ssim")
Spread = Literal["seeds", "runs"]  # how torchrun's ranks share the (seed, strategy) jobs: _rank_jobs
SPREADS: tuple[str, ...] = get_args(Spread)


@dataclass(frozen=True)
class MetricSpec:
    """A reported quantity's range (intervals are clipped to it) and direction (``tail``/``worst``, Pareto)."""
    bounds: tuple[float, float]
    higher_is_better: bool


_POSITIVE = (0.0, np.inf)
# Every quantity compare reports, declared once: fidelity (cosine and SSIM live in [-1, 1]; PSNR in [0, the cap
# PSNR_IDENTICAL] for uint8 images), distribution quality (IS >= 1: the exponential of a KL divergence), speed and
# the shadow errors (relative errors >= 0).
METRICS = {"token_mse": MetricSpec(_POSITIVE, False), "token_cos": MetricSpec((-1.0, 1.0), True),
           "psnr": MetricSpec((0.0, PSNR_IDENTICAL), True), "ssim": MetricSpec((-1.0, 1.0), True),
           "class_accuracy": MetricSpec((0.0, 1.0), True), "frechet_distance": MetricSpec(_POSITIVE, False),
           "fid": MetricSpec(_POSITIVE, False), "inception_score": MetricSpec((1.0, np.inf), True),
           "speedup": MetricSpec(_POSITIVE, True), "seconds": MetricSpec(_POSITIVE, False),
           "gflops": MetricSpec(_POSITIVE, False), "dec_kv_err": MetricSpec(_POSITIVE, False),
           "enc_kv_err": MetricSpec(_POSITIVE, False), "z_err": MetricSpec(_POSITIVE, False)}
SEED_PAIRED = ("frechet_distance", "fid")  # per-seed quality compared seed by seed
CLIPPED_NOTE = "* interval clipped to the metric's range"
#: what compare's speed-ups cover (issue 15 item 7: every speed-up says whether it is end to end or one part; the
#: papers' headline speed-ups are end to end). The engine's timer wraps exactly these phases of every step.
SPEED_SCOPE = ("end to end: encoder + decoder + diffusion head over every step (the whole step loop; "
               "decoding tokens into images is outside)")
SPEED_NOTE = f"speedup_time, speedup_flops: over full in the same rounds, {SPEED_SCOPE}"


@dataclass(frozen=True, kw_only=True)
class StrategyRun:
    """One column of a comparison: a registered strategy ``name`` with ``options``, shown as ``label``."""
    label: str
    name: str
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        from . import strategies
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in dict(self.options).items())))
        strategies.create(self.name, **dict(self.options))                  # fail early on names and options

    def create(self):
        from . import strategies
        return strategies.create(self.name, **dict(self.options))

    def to_dict(self) -> dict:
        return {"label": self.label, "name": self.name, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, data: dict) -> StrategyRun:
        return cls(label=data["label"], name=data["name"], options=tuple(dict(data.get("options", {})).items()))


def parse_runs(text: str, opt_pairs) -> tuple:
    """Strategy runs from command-line text.

    Parameters
    ----------
    text : comma-separated ``NAME`` or ``LABEL=NAME`` entries, e.g. ``"full,marche,oracle=marche"``.
    opt_pairs : ``LABEL.KEY=VALUE`` strings, e.g. ``["oracle.selection=oracle"]``, typed by the strategy.

    Returns
    -------
    tuple of StrategyRun, in the order given.
    """
    from .strategies import parse_options
    entries = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        label, sep, name = item.partition("=")
        if any(label == have for have, _ in entries):
            raise ValueError(f"--strategies gives the label {label!r} twice in {text!r}; each run needs its own "
                             "label (e.g. 'marche,m64=marche')")
        entries.append((label, name if sep else label))
    names = dict(entries)
    opts: dict = {label: {} for label in names}
    for pair in opt_pairs:
        label, sep, kv = pair.partition(".")
        if not sep or label not in names:
            raise ValueError(f"--strategy-opt expects LABEL.KEY=VALUE with LABEL one of {list(names)!r}, got {pair!r}")
        opts[label].update(parse_options(names[label], [kv]))
    return tuple(StrategyRun(label=lab, name=names[lab], options=tuple(opts[lab].items())) for lab in names)


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """What :func:`compare` runs. ``full`` is added first when absent (it is the reference)."""
    runs: tuple[StrategyRun, ...]
    num_samples: int = 20
    labels: tuple[int, ...] | None = None
    seeds: tuple[int, ...] = (0,)
    # sampling settings: None is the model's recommended setting, else the official default (SamplingConfig)
    num_iter: int | None = None
    cfg: float | None = None
    cfg_schedule: str | None = None
    temperature: float | None = None
    head_steps: str | None = None
    batch_size: int = 64
    rng: str = "own"
    grid_images: int = 8
    shadow: bool = False
    inception_weights: str | None = None
    inception_reference: str | None = None
    paired_against: str | None = None

    def __post_init__(self):
        runs = tuple(self.runs)
        if not any(r.label == "full" for r in runs):
            runs = (StrategyRun(label="full", name="full"),) + runs
        labels = [r.label for r in runs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"strategy labels must be unique, got {labels!r}")
        full = next(r for r in runs if r.label == "full")
        if full.name != "full" or full.options:
            raise ValueError(f"the label 'full' is the reference and must be the plain full strategy, got {full!r}")
        object.__setattr__(self, "runs", runs)
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds!r}")
        for name in ("num_samples", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        self.sampling  # noqa: B018  (validates the sampling fields)
        if self.grid_images < 0:
            raise ValueError(f"grid_images must be >= 0, got {self.grid_images!r}")
        if self.paired_against is not None and self.paired_against not in labels:
            raise ValueError(f"paired_against must be one of the strategy labels {labels!r}, "
                             f"got {self.paired_against!r}")

    @property
    def sampling(self) -> SamplingConfig:
        """The sampling fields as the engine's :class:`~mar_probe.engine.SamplingConfig`."""
        return SamplingConfig.of(self)

    def resolved(self, model) -> CompareConfig:
        """This config with every sampling field the model's recommended setting, else the official default."""
        return dataclasses.replace(self, **self.sampling.resolve(model).to_dict())

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["runs"] = [r.to_dict() for r in self.runs]
        d["labels"] = list(self.labels) if self.labels is not None else None
        d["seeds"] = list(self.seeds)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> CompareConfig:
        data = checked_fields(cls, data)
        data["runs"] = tuple(StrategyRun.from_dict(r) for r in data["runs"])
        for key in ("labels", "seeds"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    def label_array(self, num_classes: int) -> np.ndarray:
        base = np.array(self.labels if self.labels is not None else range(num_classes), dtype=np.int64)
        return np.resize(base, self.num_samples)


@dataclass
class SeedRun:
    """One strategy on one seed: what :func:`compare` keeps of a sampling run."""
    seed: int
    seconds: float
    flops: int
    steps: int
    tokens: np.ndarray
    images: np.ndarray | None
    labels: np.ndarray
    shadow: dict = field(default_factory=dict)


def run_strategy(model, run: StrategyRun, labels, seed: int, config: CompareConfig, vae=None) -> SeedRun:
    """Sample ``labels`` with one strategy and seed; keeps tokens, images, seconds and FLOPs."""
    from .api import sample
    from .probe.shadow import sample_with_shadow
    kw = dict(sampling=config.sampling, seed=seed, batch_size=config.batch_size, strategy=run.create(), vae=vae)
    shadow = {}
    if config.shadow:
        res, ds = sample_with_shadow(model, labels, **kw)
        shadow = {v: ds[v].values for v in ("enc_kv_err", "dec_kv_err", "z_err")}
    else:
        res = sample(model, labels, **kw)
    tot = res.cost["totals"]
    return SeedRun(seed, float(tot["seconds_total"]), int(tot["flops_total"]), len(res.cost["steps"]),
                   res.tokens.numpy(), res.images, np.asarray(res.labels), shadow)


class PartialRuns:
    """The finished runs of an interrupted :func:`compare`: ``LABEL.seedS.npz`` beside ``config.json``.

    A new comparison (``resume=False``) empties the folder; a resumed one checks that ``config.json`` holds the
    same settings and weights, so runs of another comparison are never mixed in. The strategies and seeds may
    differ (a run depends on its own strategy and seed alone): a resumed comparison may add strategies (a screen's
    next arms beside the ``full`` and reference runs it has already) or seeds (a screen confirmed on more), and
    loads the saved runs of the labels it shares when their strategy and options are the same; a label whose
    strategy or options changed is refused (it would load another strategy's runs). ``config.json`` then lists
    every label whose runs the folder holds. A resumed run keeps the seconds measured by the process that ran it.
    """

    def __init__(self, folder, config: CompareConfig, weights_sha256: str, resume: bool):
        self.folder = Path(folder)
        ident = json.loads(json.dumps({"settings": config.to_dict(), "weights_sha256": weights_sha256},
                                      default=_json_default))
        stamp = self.folder / "config.json"
        if resume and stamp.is_file():
            ident = self._resumed_stamp(json.loads(stamp.read_text()), ident)
        elif self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(ident, indent=1))

    def _resumed_stamp(self, have: dict, ident: dict) -> dict:
        """The stamp of a resumed comparison: ``ident`` with the runs of ``have`` it does not name, after checking
        that the two share the weights and every setting but the strategies and seeds, and give a shared label the
        same strategy and options."""
        settings = have.get("settings", {})
        diff = sorted(k for k in set(settings) | set(ident["settings"])
                      if k not in ("runs", "seeds") and settings.get(k) != ident["settings"].get(k))
        if diff or have.get("weights_sha256") != ident["weights_sha256"]:
            raise ValueError(f"cannot resume from {str(self.folder)!r}: it holds runs of another comparison "
                             f"(settings that differ: {diff or ['weights_sha256']!r}); expected the same "
                             "settings and model, or run without --resume to start afresh")
        new = {r["label"]: r for r in ident["settings"]["runs"]}
        for run in settings.get("runs", []):
            if run["label"] in new and new[run["label"]] != run:
                raise ValueError(f"cannot resume from {str(self.folder)!r}: its runs labelled {run['label']!r} are "
                                 f"{run['name']!r} with options {run['options']!r}, now {new[run['label']]['name']!r}"
                                 f" with options {new[run['label']]['options']!r}; give the new arm another label, "
                                 "or run without --resume to start afresh")
        kept = [r for r in settings.get("runs", []) if r["label"] not in new]
        return {**ident, "settings": {**ident["settings"], "runs": ident["settings"]["runs"] + kept}}

    def _path(self, label: str, seed: int) -> Path:
        return self.folder / f"{_file_label(label)}.seed{seed}.npz"

    def load(self, label: str, seed: int) -> SeedRun | None:
        """The saved run of ``label`` on ``seed``, or None."""
        path = self._path(label, seed)
        if not path.is_file():
            return None
        with np.load(path) as f:
            shadow = {k[len("shadow_"):]: f[k] for k in f.files if k.startswith("shadow_")}
            return SeedRun(int(f["seed"]), float(f["seconds"]), int(f["flops"]), int(f["steps"]), f["tokens"],
                           f["images"] if "images" in f.files else None, f["labels"], shadow)

    def save(self, label: str, run: SeedRun) -> None:
        """Write ``run`` (to a temporary file, then renamed: a killed process leaves no torn file)."""
        arrays = dict(seed=run.seed, seconds=run.seconds, flops=run.flops, steps=run.steps, tokens=run.tokens,
                      labels=run.labels, **{f"shadow_{k}": v for k, v in run.shadow.items()})
        if run.images is not None:
            arrays["images"] = run.images
        tmp = self.folder / f".{_file_label(label)}.seed{run.seed}.tmp.npz"
        np.savez_compressed(tmp, **arrays)  # the images' flat background compresses: a zoo's 45 runs fit in git
        os.replace(tmp, self._path(label, run.seed))


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`compare`; its message says how many runs are saved and how to resume."""


@dataclass
class CompareResult:
    """What :func:`compare` returns: ``results`` (the ``results.json`` dict) and the ``runs`` per label and seed."""
    results: dict
    runs: dict


def compare(model, config: CompareConfig, vae=None, progress: bool = True, partial=None,
            resume: bool = False, ranks: Ranks | None = None, spread: Spread = "seeds",
            command: str | None = None) -> CompareResult:
    """Run every strategy of ``config`` on every seed (strategies interleaved per seed, so that a busy machine
    slows all alike) and judge them against ``full`` (see the module docstring).

    With ``partial`` (a folder), every finished (strategy, seed) run is saved there as it completes (see
    :class:`PartialRuns`); with ``resume`` the runs already there are loaded instead of run again.
    Under torchrun (``ranks``, the process group joined: :mod:`mar_probe.launch`) the jobs are spread over the
    ranks as ``spread`` says (see :func:`_rank_jobs`) and the runs are gathered: every rank returns the same
    result. ``command`` (the command line that asked for it) is recorded in the results beside the settings, the
    machine and the weights' SHA-256, so a result file says how to make it again (issue 15)."""
    from .probe.record import image_shape, weights_sha256
    config = config.resolved(model)  # results and the resume stamp hold the settings actually used
    if image_shape(model, vae) == (28, 28, 1) and config.num_samples < 2:  # checked before anything is sampled
        raise ValueError(f"num_samples must be >= 2 for the Frechet distance of Fashion-MNIST images (a covariance "
                         f"of classifier features), got {config.num_samples!r}")
    if spread not in SPREADS:
        raise ValueError(f"unknown spread {spread!r}; expected one of {SPREADS!r}")
    sha = weights_sha256(model)
    saved = _partial_runs(partial, config, sha, resume, ranks)
    jobs = [(seed, r) for seed in config.seeds for r in config.runs]
    done = _run_jobs(model, config, vae, saved, _rank_jobs(jobs, config.seeds, ranks, spread), len(jobs), progress)
    if ranks is not None:  # every rank gets every run, so each can judge; only rank 0 writes (the CLI)
        done = {k: v for part in gather(done) for k, v in part.items()}
    runs = {r.label: [done[r.label, seed] for seed in config.seeds] for r in config.runs}
    strategies = _judge(config, runs)
    results = {"format": FORMAT, "version": VERSION, "command": command, "settings": config.to_dict(),
               "machine": machine(), "model": model.config.name, "weights_sha256": sha, "speed_scope": SPEED_SCOPE,
               "ranks": None if ranks is None else {"world_size": ranks.world_size, "spread": spread},
               "unrelated_floor": unrelated_floor(runs["full"]), "strategies": strategies}
    return CompareResult(results, runs)


def _run_jobs(model, config: CompareConfig, vae, saved: PartialRuns | None, mine: list, of: int,
              progress: bool) -> dict[tuple[str, int], SeedRun]:
    """Run (or, from ``saved``, load) this rank's ``mine`` (seed, run) jobs of the ``of`` in all; Ctrl-C raises
    :class:`CompareInterrupted`, which says how many runs are kept and how to resume."""
    labels = config.label_array(model.num_classes)
    done: dict[tuple[str, int], SeedRun] = {}
    try:
        for seed, r in tqdm(mine, desc="compare", disable=not progress):
            got = saved.load(r.label, seed) if saved is not None else None
            if got is None:
                got = run_strategy(model, r, labels, seed, config, vae)
                if saved is not None:
                    saved.save(r.label, got)
            done[r.label, seed] = got
    except KeyboardInterrupt:
        where = (f" are saved in {str(saved.folder)!r}: rerun with --resume to continue" if saved is not None
                 else " were not saved (no partial folder)")
        raise CompareInterrupted(f"interrupted; {len(done)} of {of} (strategy, seed) runs{where}") from None
    return done


def _judge(config: CompareConfig, runs: dict[str, list[SeedRun]]) -> dict:
    """The ``strategies`` entries of ``results.json``: every strategy's runs (per seed) against ``full``'s, and
    against ``config.paired_against``'s image by image and seed by seed."""
    judge = QualityJudge.for_images(runs["full"][0].images, config)
    fid = {label: [paired_fidelity(s.tokens, f.tokens, s.images, f.images) for s, f in zip(seeds, runs["full"])]
           for label, seeds in runs.items()}
    strategies = {r.label: summarize_runs(r, runs[r.label], runs["full"], judge, fid[r.label]) for r in config.runs}
    for entry in strategies.values():
        vs_full = seed_paired_difference(entry["per_seed"], strategies["full"]["per_seed"], "full")
        if len(vs_full) > 1:
            entry["quality_vs_full"] = vs_full
    if config.paired_against is not None:
        ref = strategies[config.paired_against]
        for label, entry in strategies.items():
            if label != config.paired_against:
                entry["paired"] = paired_difference(fid[label], fid[config.paired_against], config.paired_against)
                entry["paired"].update({k: v for k, v in seed_paired_difference(
                    entry["per_seed"], ref["per_seed"], config.paired_against).items() if k != "against"})
    return strategies


def _rank_jobs(jobs: list, seeds, ranks: Ranks | None, spread: Spread) -> list:
    """This rank's (seed, run) jobs. ``seeds``: seed ``k`` of ``seeds`` goes to rank ``k mod WORLD_SIZE``, all
    strategies of a seed on one rank, so that each per-seed speed ratio compares runs of one process on one device.
    ``runs``: job ``k`` of ``jobs`` (seed-major) goes to rank ``k mod WORLD_SIZE``, which keeps every rank busy
    when the seeds do not divide evenly (3 seeds on 2 ranks leave one rank idle a third of the time, issue 17's
    zoo), at the price of per-seed speed ratios across processes: for callers whose speed comes from elsewhere."""
    if ranks is None:
        return jobs
    if spread == "runs":
        return jobs[ranks.rank::ranks.world_size]
    mine = {seed for k, seed in enumerate(seeds) if k % ranks.world_size == ranks.rank}
    return [(seed, r) for seed, r in jobs if seed in mine]


def _partial_runs(partial, config, sha: str, resume: bool, ranks: Ranks | None) -> PartialRuns | None:
    """The partial-runs folder; under torchrun rank 0 prepares it (and empties it, without ``resume``) while the
    others wait, then they check its stamp."""
    if partial is None:
        return None
    if ranks is None:
        return PartialRuns(partial, config, sha, resume)
    saved = on_rank0(lambda: PartialRuns(partial, config, sha, resume), repr(str(partial)))
    return saved if saved is not None else PartialRuns(partial, config, sha, resume=True)


def write_results(result: CompareResult, out) -> Path:
    """Write ``results.json``, ``results.csv``, ``samples/LABEL.npz`` (first seed) and ``grid.png`` to ``out``."""
    from .plot.compare import save_strategy_grid
    out = Path(out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    images = {}
    for label, seeds in result.runs.items():
        first = seeds[0]
        tokens = first.tokens.reshape(first.tokens.shape[0], first.tokens.shape[1], -1).transpose(0, 2, 1)
        arrays = dict(labels=first.labels, tokens=tokens)                 # tokens [N, seq_len, dim] as generate
        if first.images is not None:
            arrays["images"] = images[label] = first.images
        path = out / "samples" / f"{_file_label(label)}.npz"
        np.savez(path, **arrays)
        if first.images is not None:
            result.results["strategies"][label]["samples_path"] = str(path.relative_to(out))
    (out / "results.json").write_text(json.dumps(result.results, indent=2, default=_json_default))
    results_frame(result.results).to_csv(out / "results.csv", index=False)
    n = result.results["settings"]["grid_images"]
    if images and n:
        save_strategy_grid({k: v[:n] for k, v in images.items()}, out / "grid.png", result.results)
    return out


def _file_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def _json_default(obj):
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__!r}")


COLUMNS = (("speedup.time", "speedup_time"), ("speedup.flops", "speedup_flops"), ("seconds", "seconds"),
           ("gflops", "gflops"), ("fidelity.token_mse", "token_mse"), ("fidelity.token_cos", "token_cos"),
           ("fidelity.psnr", "psnr"), ("fidelity.ssim", "ssim"), ("quality.class_accuracy", "class_accuracy"),
           ("quality.frechet_distance", "frechet_distance"), ("quality.fid", "fid"),
           ("quality.inception_score", "inception_score"), ("shadow.dec_kv_err", "shadow_dec_kv_err"),
           ("shadow.z_err", "shadow_z_err"), ("paired.psnr", "psnr_minus_ref"),
           ("paired.token_mse", "token_mse_minus_ref"),
           ("quality_vs_full.frechet_distance", "frechet_distance_minus_full"),
           ("quality_vs_full.fid", "fid_minus_full"), ("paired.frechet_distance", "frechet_distance_minus_ref"),
           ("paired.fid", "fid_minus_ref"))
ROBUST = ("median", "tail", "worst")  # fidelity statistics beside the mean, CSV columns METRIC_STAT(_lo/_hi/_clipped)


def _lookup(entry: dict, dotted: str):
    for key in dotted.split("."):
        entry = entry.get(key) if isinstance(entry, dict) else None
    return entry


def results_frame(results: dict):
    """One row per strategy: label, strategy config, steps and ``METRIC``/``METRIC_lo``/``METRIC_hi``/
    ``METRIC_clipped``/``METRIC_n`` columns (``lo``/``hi`` empty without an interval), and per fidelity metric the
    same for its median, bad tail and worst image (``psnr_tail``, ``token_mse_worst``, ...)."""
    import pandas as pd
    rows = []
    for label, e in results["strategies"].items():
        row = {"label": label, "strategy": e["config"]["name"], "options": json.dumps(
            {k: v for k, v in e["config"].items() if k != "name"}, default=_json_default), "steps": e["steps"]}
        for dotted, col in COLUMNS:
            val = _lookup(e, dotted)
            if isinstance(val, dict):
                row.update({col: val["mean"], f"{col}_lo": val["lo"], f"{col}_hi": val["hi"],
                            f"{col}_clipped": bool(val.get("clipped", False)), f"{col}_n": val.get("n")})
        for metric in FIDELITY:
            stats = _lookup(e, f"fidelity.{metric}.statistics") or {}
            for name in ROBUST:
                if isinstance(stats.get(name), dict):
                    s, col = stats[name], f"{metric}_{name}"
                    row.update({col: s["estimate"], f"{col}_lo": s["low"], f"{col}_hi": s["high"],
                                f"{col}_clipped": bool(s["clipped"]), f"{col}_n": s["n"]})
        rows.append(row)
    return pd.DataFrame(rows)


def format_table(results: dict) -> str:
    """The comparison as a Markdown table: mean [95% interval] per metric; ``*`` marks an interval clipped to the
    metric's range (footnote below the table), ``(n=1)`` a value without an interval."""
    df = results_frame(results)
    cols = [c for _, c in COLUMNS if c in df.columns and c not in ("seconds", "gflops")]
    lines = ["| strategy | steps | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for _, row in df.iterrows():
        cells = [_cell(row, c) for c in cols]
        lines.append(f"| {row['label']} | {row['steps']} | " + " | ".join(cells) + " |")
    if any(c.startswith("speedup") for c in cols):
        lines += ["", SPEED_NOTE]
    if any(cell.endswith("*") for line in lines[2:] for cell in line.split(" | ")):
        lines += ["", CLIPPED_NOTE]
    return "\n".join(lines)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def _cell(row, col: str) -> str:
    val = row.get(col)
    if _missing(val):
        return "-"
    lo, hi, n = row.get(f"{col}_lo"), row.get(f"{col}_hi"), row.get(f"{col}_n")
    fmt = "{:.3g}"
    if _missing(lo) or _missing(hi):
        return f"{fmt.format(val)} (n=1)" if not _missing(n) and n == 1 else fmt.format(val)
    clipped = row.get(f"{col}_clipped")
    star = "*" if not _missing(clipped) and bool(clipped) else ""
    if lo == hi:
        return fmt.format(val) + star
    return f"{fmt.format(val)} [{fmt.format(lo)}, {fmt.format(hi)}]{star}"


def _interval(values, bounds: tuple[float, float] | None = None) -> dict:
    """``I``: the mean of ``values`` with its t-interval clipped to ``bounds`` (see the module docstring)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if not np.isfinite(x).any():
        return {"mean": None, "lo": None, "hi": None, "n": 0, "clipped": False, "note": "no finite value"}
    i = interval(x, statistic="mean", method="t", bounds=bounds)
    out = {"mean": i.estimate, "lo": i.low, "hi": i.high, "n": i.n, "clipped": i.clipped}
    if i.low is None:
        out["note"] = "one value: no interval (n = 1)"
    return out


def paired_difference(fid: list, ref: list, against: str) -> dict:
    """Per-image difference of every fidelity metric (this strategy minus ``against``), with a t-interval over
    all images of all seeds: both strategies saw the same labels and seeds, so image i of seed s pairs up.

    ``fid`` and ``ref`` are per-seed :func:`~mar_probe.quality.paired.paired_fidelity` results.
    """
    out = {"against": against}
    for k in FIDELITY:
        if k in fid[0] and k in ref[0]:
            out[k] = _interval(np.concatenate([d[k].values - r[k].values for d, r in zip(fid, ref)]),
                               difference_bounds(METRICS[k].bounds))
    return out


def unrelated_floor(full: list[SeedRun]) -> dict | None:
    """The paired fidelity of an unrelated sample: ``full``'s images of each seed against the previous seed's
    (the same labels, other noise and generation orders), over consecutive seeds; None with one seed.

    A strategy whose fidelity against ``full`` is not above it draws images no closer to ``full``'s than another
    sample of the same class is, so a comparison of fidelities near it (issue 17's goal, "at least lazymar's")
    separates nothing: the zoo reports where ``lazymar``'s fidelity lies against it (docs/strategies.md). The
    interval pools the images of every pair; with three or more seeds a middle seed's images enter two pairs, so it
    is somewhat narrower than independent pairs would give."""
    if len(full) < 2:
        return None
    pairs = list(zip(full, full[1:]))
    fid = [paired_fidelity(b.tokens, a.tokens, b.images, a.images) for a, b in pairs]
    out = {"against": "full, the previous seed", "seed_pairs": [[a.seed, b.seed] for a, b in pairs]}
    for k in FIDELITY:
        if k in fid[0]:
            out[k] = _interval(np.concatenate([d[k].values for d in fid]), METRICS[k].bounds)
    return out


def seed_paired_difference(per_seed: list[dict], ref: list[dict], against: str) -> dict:
    """Per-seed quality compared seed by seed: for each of :data:`SEED_PAIRED` in both strategies' ``per_seed``
    records, the differences ``value(seed) - value(against, seed)`` with a t-interval over seeds (``P`` of the
    module docstring; one seed: no interval). Two unpaired means over seeds are never the comparison: a seed's
    labels, orders and noise are shared by both runs, so its Fréchet distances pair up."""
    out = {"against": against}
    ref_by_seed = {r["seed"]: r for r in ref}
    for k in SEED_PAIRED:
        if not all(k in r for r in per_seed) or not all(k in ref_by_seed.get(r["seed"], {}) for r in per_seed):
            continue
        diffs = [{"seed": r["seed"], "difference": float(r[k]) - float(ref_by_seed[r["seed"]][k])} for r in per_seed]
        entry = _interval([d["difference"] for d in diffs], difference_bounds(METRICS[k].bounds))
        if entry["n"] == 1:
            entry["note"] = "one seed: no interval (n = 1); run more seeds for one"
        out[k] = {**entry, "per_seed": diffs}
    return out


def summarize_runs(run: StrategyRun, seeds: list[SeedRun], full: list[SeedRun], judge, fid: list) -> dict:
    """One strategy's entry: speed ratios per seed, paired fidelity over all images, quality, shadow.

    ``fid``: the per-seed :func:`~mar_probe.quality.paired.paired_fidelity` of ``seeds`` against ``full``."""
    fidelity = {k: summarize(np.concatenate([d[k].values for d in fid]), bounds=METRICS[k].bounds,
                             higher_is_better=METRICS[k].higher_is_better, point_interval=False)
                for k in FIDELITY if k in fid[0]}
    per_seed = [{"seed": s.seed, "seconds": s.seconds, "flops": s.flops} for s in seeds]
    quality = judge(seeds, per_seed) if judge is not None else {}
    speed = METRICS["speedup"].bounds
    entry = {"label": run.label, "config": dict(run.create().to_dict()), "steps": seeds[0].steps,
             "seconds": _interval([s.seconds for s in seeds], METRICS["seconds"].bounds),
             "gflops": _interval([s.flops / 1e9 for s in seeds], METRICS["gflops"].bounds),
             "speedup": {"time": _interval([f.seconds / s.seconds for s, f in zip(seeds, full)], speed),
                         "flops": _interval([f.flops / s.flops for s, f in zip(seeds, full)], speed)},
             "fidelity": fidelity, "quality": quality, "per_seed": per_seed}
    if seeds[0].shadow:
        entry["shadow"] = {k: _interval(np.concatenate([np.ravel(s.shadow[k]) for s in seeds]),
                                        METRICS[k].bounds if k in METRICS else None) for k in seeds[0].shadow}
    return entry


class QualityJudge:
    """Distribution quality of one strategy's images per seed: Fashion-MNIST classifier metrics for 28x28
    grayscale images, FID/IS for RGB images when InceptionV3 weights are given."""

    def __init__(self, kind: str, config: CompareConfig):
        self.kind, self.config = kind, config
        if kind == "fashion":
            from .quality import load_classifier, load_reference_stats
            self.classifier, self.reference = load_classifier(), load_reference_stats()
        else:
            from .quality import load_inception
            self.inception = load_inception(config.inception_weights)

    @classmethod
    def for_images(cls, images, config: CompareConfig) -> QualityJudge | None:
        """The judge that fits these images, or None (no images, or RGB without Inception weights)."""
        from .quality.report import _is_grayscale_28
        if images is None:
            return None
        if _is_grayscale_28(images):
            return cls("fashion", config)
        if images.ndim == 4 and images.shape[-1] == 3 and config.inception_weights:
            return cls("imagenet", config)
        return None

    def __call__(self, seeds: list[SeedRun], per_seed: list[dict]) -> dict:
        if self.kind == "fashion":
            return self._fashion(seeds, per_seed)
        return self._imagenet(seeds, per_seed)

    def _fashion(self, seeds, per_seed) -> dict:
        from .quality import classifier_outputs, feature_stats, frechet_distance
        correct, fds = [], []
        for s, rec in zip(seeds, per_seed):
            feats, logits = classifier_outputs(self.classifier, s.images)
            ok = logits.argmax(1) == s.labels
            fd = frechet_distance(*feature_stats(feats), self.reference["mu"], self.reference["sigma"])
            rec.update(class_accuracy=float(ok.mean()), frechet_distance=fd)
            correct.append(ok)
            fds.append(fd)
        return {"class_accuracy": _interval(np.concatenate(correct), METRICS["class_accuracy"].bounds),
                "frechet_distance": _interval(fds, METRICS["frechet_distance"].bounds)}

    def _imagenet(self, seeds, per_seed) -> dict:
        from .quality.report import imagenet_report
        reps = [imagenet_report(s.images, self.inception, self.config.inception_reference) for s in seeds]
        for rec, rep in zip(per_seed, reps):
            rec.update(fid=rep["fid"], inception_score=rep["inception_score"])
        out = {"inception_score": _interval([r["inception_score"] for r in reps], METRICS["inception_score"].bounds)}
        if reps[0]["fid"] is not None:
            out["fid"] = _interval([r["fid"] for r in reps], METRICS["fid"].bounds)
        return out


# ---- sweep ----------------------------------------------------------------------------------------------------
# by CSV column (results_frame), from METRICS
HIGHER_IS_BETTER = {**{k: m.higher_is_better for k, m in METRICS.items()},
                    **{f"shadow_{k}": METRICS[k].higher_is_better for k in ("dec_kv_err", "enc_kv_err", "z_err")},
                    "speedup_time": True, "speedup_flops": True}


def sweep_runs(name: str, grid: dict, options: dict | None = None, baselines=()) -> tuple[StrategyRun, ...]:
    """One :class:`StrategyRun` per point of a grid of one or two options of strategy ``name`` (labels
    ``"budget=16"`` or ``"budget=16,refresh_period=3"``), after ``full`` and the named baseline strategies."""
    if not 1 <= len(grid) <= 2:
        raise ValueError(f"a sweep varies one or two options, got {len(grid)}: {sorted(grid)!r}")
    options = dict(options or {})
    clash = sorted(set(grid) & set(options))
    if clash:
        raise ValueError(f"option(s) {clash!r} are both swept and fixed; expected each in one place")
    keys = list(grid)
    points = [(a,) for a in grid[keys[0]]] if len(keys) == 1 else \
        [(a, b) for a in grid[keys[0]] for b in grid[keys[1]]]
    runs = [StrategyRun(label="full", name="full")]
    runs += [StrategyRun(label=b, name=b) for b in baselines if b != "full"]
    for point in points:
        opts = dict(zip(keys, point))
        label = ",".join(f"{k}={v}" for k, v in opts.items())
        runs.append(StrategyRun(label=label, name=name, options=tuple({**options, **opts}.items())))
    return tuple(runs)


def pareto_front(speed, fidelity, higher_is_better: bool = True) -> np.ndarray:
    """Indices of the points that no other point beats on both speed (higher) and fidelity, sorted by speed."""
    x = np.asarray(speed, dtype=np.float64)
    y = np.asarray(fidelity, dtype=np.float64) * (1 if higher_is_better else -1)
    ok = np.isfinite(x) & np.isfinite(y)
    front = [i for i in np.flatnonzero(ok)
             if not (ok & (x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i]))).any()]
    return np.array(sorted(front, key=lambda i: x[i]), dtype=np.int64)


def sweep_frame(results: dict, grid_keys, speed: str = "speedup_flops", fidelity: str = "psnr"):
    """The results table of a sweep with one column per swept option and an ``on_front`` flag.

    For a paired fidelity metric ``full`` is the reference (identical to itself by definition), not a candidate:
    it is left off the front."""
    df = results_frame(results)
    for key in grid_keys:
        df[key] = [_lookup(results["strategies"][lab], f"config.{key}") if results["strategies"][lab]["config"]
                   ["name"] == results["sweep"]["strategy"] else None for lab in df["label"]]
    on = np.zeros(len(df), dtype=bool)
    if speed in df and fidelity in df:
        cand = np.flatnonzero(~((df["label"] == "full") & (fidelity in FIDELITY)).to_numpy())
        front = pareto_front(df[speed].iloc[cand], df[fidelity].iloc[cand], HIGHER_IS_BETTER.get(fidelity, True))
        on[cand[front]] = True
    df["on_front"] = on
    return df


def write_sweep(result: CompareResult, out, strategy: str, grid: dict, speed: str = "speedup_flops",
                fidelity: str = "psnr") -> Path:
    """:func:`write_results` plus ``sweep.csv`` (with the swept options and the Pareto flag) and ``pareto.png``."""
    from .plot.compare import pareto_plot
    result.results["sweep"] = {"strategy": strategy, "grid": {k: list(v) for k, v in grid.items()},
                               "speed": speed, "fidelity": fidelity}
    out = write_results(result, out)
    df = sweep_frame(result.results, list(grid), speed, fidelity)
    df.to_csv(out / "sweep.csv", index=False)
    if speed in df and fidelity in df:
        ax = pareto_plot(df[(df["label"] != "full") | (fidelity not in FIDELITY)], speed, fidelity,
                         options=list(grid))
        ax.figure.savefig(out / "pareto.png", dpi=120)
        import matplotlib.pyplot as plt
        plt.close(ax.figure)
    return out
