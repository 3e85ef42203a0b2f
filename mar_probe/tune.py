"""Tuning a strategy to a quality target: ``mar-probe tune`` (issue 17, item 3).

:func:`tune` takes a strategy family (a registered strategy name), a fidelity target against ``full``
(:class:`FidelityTarget`, e.g. ``psnr>=30`` or ``token_mse<=0.01``, paired per image as ``compare`` measures it),
calibration seeds and held-out seeds, and:

1. searches the candidates of a search space (per option a list of values; :data:`KNOBS` holds each family's
   default grid and the direction that makes every option cheaper) on the calibration seeds, every candidate
   paired image by image against ``full`` (same labels, seeds, orders and noise; ``full`` runs once per seed);
2. picks the fastest candidate meeting the target: the highest FLOPs speed-up over ``full`` (counted, so
   deterministic; the measured seconds are reported beside, not used);
3. runs that configuration on the held-out seeds and reports whether the target held there, with intervals.

The statistic compared with the target is the mean over images (``statistic="mean"``), or the conservative end
of its 95% Student-t interval (``statistic="bound"``: the lower bound for a ``>=`` target, the upper bound for
``<=``).

Search (``search``): ``"bisect"`` (default) assumes that along the option with a known direction that comes last
in the space, fidelity only worsens as the run gets cheaper; it groups the candidates into rows (one per
combination of the other options: a coordinate search in two dimensions), orders each row cheapest first and
bisects it for the cheapest candidate meeting the target (about log2(n) evaluations per row instead of n), then
picks the fastest of the rows' winners by measured FLOPs. An option whose direction is unknown or whose values
are not all numbers is enumerated. ``"exhaustive"`` evaluates every candidate: the brute force, exact whatever
the shape of the trade-off. When fidelity is monotone along the bisected option both give the same choice.

A target that no evaluated candidate meets raises :class:`TargetUnreachableError` (a ``ValueError``) naming the
closest configuration found and its fidelity; the error's ``result`` holds every calibration evaluation.

The online variant: ``family="marche-drift"`` searches MARché's ``refresh_threshold`` (its default space), the
per-step refresh decision from a cheap drift signal (the mean relative change of the selection layer's output
since the last refresh, computed anyway; ``refresh_period`` 16 is only a cap): the calibration sets the highest
threshold, hence the fewest refreshes, that still meets the target.

:func:`write_report` writes ``tune.json`` (:meth:`TuneResult.to_dict`: ``format = "mar_probe.tune"``,
``version = 1``, ``config``, ``model``, ``candidates``, ``chosen``, ``heldout``, ``met``) and ``tune.png``
(:func:`mar_probe.plot.tune.tune_plot`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from ._config import checked_fields
from .compare import FIDELITY, HIGHER_IS_BETTER, CompareConfig, SeedRun, StrategyRun, run_strategy
from .engine.sampling import SamplingConfig
from .quality.paired import paired_fidelity, summarize

FORMAT, VERSION = "mar_probe.tune", 1
Op = Literal[">=", "<="]
Statistic = Literal["mean", "bound"]
Search = Literal["bisect", "exhaustive"]
Faster = Literal["higher", "lower"]
OPS: tuple[str, ...] = typing.get_args(Op)
STATISTICS: tuple[str, ...] = typing.get_args(Statistic)
SEARCHES: tuple[str, ...] = typing.get_args(Search)
ONLINE_FAMILY = "marche-drift"


@dataclass(frozen=True, kw_only=True)
class Knob:
    """An option :func:`tune` can search: the direction of its values that makes a run cheaper, and its default
    candidates (empty: searched only when a space names it)."""
    faster: Faster
    grid: tuple = ()


# The one place of the search spaces: per family, the options with a known direction; those with a grid make the
# family's default space (at most two per family, the last one bisected).
KNOBS: dict[str, dict[str, Knob]] = {
    "marche": {"budget": Knob(faster="lower", grid=(16, 32, 48, 64)),
               "refresh_period": Knob(faster="higher", grid=(2, 3, 4, 6)),
               "refresh_threshold": Knob(faster="higher"), "refresh_mass": Knob(faster="lower"),
               "selection_layer": Knob(faster="lower")},
    "marche-oracle": {"budget": Knob(faster="lower", grid=(16, 32, 48, 64)),
                      "refresh_period": Knob(faster="higher", grid=(2, 3, 4, 6))},
    "marche-drift": {"refresh_threshold": Knob(faster="higher", grid=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0)),
                     "refresh_period": Knob(faster="higher"), "budget": Knob(faster="lower")},
    "marche-adaptive": {"refresh_mass": Knob(faster="lower", grid=(0.2, 0.35, 0.5, 0.7, 0.9)),
                        "budget": Knob(faster="lower"), "refresh_period": Knob(faster="higher")},
    "lazymar": {"refresh_interval": Knob(faster="higher", grid=(3, 5, 7, 9, 12)),
                "head_interval": Knob(faster="higher", grid=(1, 3, 5, 7, 10)),
                "warmup_steps": Knob(faster="lower"), "min_extra_tokens": Knob(faster="lower"),
                "prune_layer": Knob(faster="lower")},
    "compose": {"head_interval": Knob(faster="higher", grid=(1, 3, 5, 7, 10)),
                "condition_warmup": Knob(faster="lower")},
    "disa": {"upper": Knob(faster="lower", grid=(10, 20, 30, 50)), "lower": Knob(faster="lower", grid=(2, 3, 5))},
    # issue 17's screen varied these two around the named composition (refresh 9 / 16, upper 25 / 50)
    "lazymar-disa": {"refresh_interval": Knob(faster="higher", grid=(9, 12, 16, 20)),
                     "upper": Knob(faster="lower", grid=(15, 25, 35, 50)),
                     "head_interval": Knob(faster="higher"), "warmup_steps": Knob(faster="lower"),
                     "lower": Knob(faster="lower")},
    "fewer-steps": {"num_iter": Knob(faster="lower")},
}


def default_space(family: str) -> tuple[tuple[str, tuple], ...]:
    """The default search space of ``family``: ``((option, candidates), ...)`` from :data:`KNOBS`."""
    space = tuple((k, knob.grid) for k, knob in KNOBS.get(family, {}).items() if knob.grid)
    if not space:
        from .strategies import describe, options
        if not options(family):
            raise ValueError(f"strategy {family!r} has no options to tune; expected a strategy with options, e.g. "
                             f"one of {sorted(KNOBS)!r}")
        have = sorted(f for f, knobs in KNOBS.items() if any(k.grid for k in knobs.values()))
        raise ValueError(f"strategy {family!r} has no default search space (the families with one: {have!r}); give "
                         f"one (--param KEY=V1,V2,...) with KEY among its options: {describe(family)}")
    return space


@dataclass(frozen=True, kw_only=True)
class Interval:
    """A mean with its 95% Student-t interval over ``n`` values (``lo == hi == mean`` for one value)."""
    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values) -> Interval:
        s = summarize(np.asarray(values, dtype=np.float64))
        if s["n"] == 0:
            raise ValueError("no finite value to summarise")
        return cls(mean=s["mean"], lo=s["lo"], hi=s["hi"], n=s["n"])

    def __str__(self) -> str:
        if self.lo == self.hi:
            return f"{self.mean:.4g} (n={self.n})"
        return f"{self.mean:.4g} [{self.lo:.4g}, {self.hi:.4g}] (n={self.n})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> Interval:
        return cls(**checked_fields(cls, data))


_TARGET = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=)\s*(\S+)\s*$")


@dataclass(frozen=True, kw_only=True)
class FidelityTarget:
    """What a configuration must reach against ``full``: ``metric op value`` for the ``statistic`` over images.

    metric : one of the paired fidelity metrics ``token_mse``, ``token_cos``, ``psnr``, ``ssim``.
    op : ``">="`` for the metrics where higher is better (``token_cos``, ``psnr``, ``ssim``), ``"<="`` for
        ``token_mse``: a target bounds a metric from its bad side.
    value : the bound (finite).
    statistic : ``"mean"`` over images, or ``"bound"``: the conservative end of its 95% interval (the lower bound
        for ``>=``, the upper bound for ``<=``).
    """
    metric: str
    op: Op
    value: float
    statistic: Statistic = "mean"

    def __post_init__(self):
        if self.metric not in FIDELITY:
            raise ValueError(f"unknown fidelity metric {self.metric!r}; expected one of {FIDELITY!r}")
        if self.op not in OPS:
            raise ValueError(f"unknown comparison {self.op!r} in a fidelity target; expected one of {OPS!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ValueError(f"the target value must be a finite number, got {self.value!r}")
        object.__setattr__(self, "value", float(self.value))
        want = ">=" if HIGHER_IS_BETTER[self.metric] else "<="
        if self.op != want:
            kind = "higher" if want == ">=" else "lower"
            raise ValueError(f"target '{self.metric}{self.op}{self.value:g}' bounds {self.metric} from the wrong "
                             f"side: {kind} is better, so expected '{self.metric}{want}{self.value:g}'")
        if self.statistic not in STATISTICS:
            raise ValueError(f"unknown target statistic {self.statistic!r}; expected one of {STATISTICS!r}")

    @classmethod
    def parse(cls, text: str, statistic: Statistic = "mean") -> FidelityTarget:
        """``"psnr>=30"`` or ``"token_mse<=0.01"`` -> a target."""
        m = _TARGET.match(str(text))
        if m is None:
            raise ValueError(f"malformed fidelity target {text!r}; expected METRIC>=VALUE or METRIC<=VALUE with "
                             f"METRIC one of {FIDELITY!r}, e.g. 'psnr>=30' or 'token_mse<=0.01'")
        metric, op, value = m.groups()
        if metric not in FIDELITY:
            raise ValueError(f"unknown fidelity metric {metric!r} in target {text!r}; expected one of {FIDELITY!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"the value of fidelity target {text!r} is not a number: {value!r}") from None
        return cls(metric=metric, op=op, value=number, statistic=statistic)

    @property
    def describe(self) -> str:
        """E.g. ``"psnr>=30 (mean over images)"``."""
        which = "mean over images" if self.statistic == "mean" else \
            f"{'lower' if self.op == '>=' else 'upper'} end of the 95% interval of the mean over images"
        return f"{self.metric}{self.op}{self.value:g} ({which})"

    def statistic_of(self, interval: Interval) -> float:
        """The number compared with :attr:`value`."""
        if self.statistic == "mean":
            return interval.mean
        return interval.lo if self.op == ">=" else interval.hi

    def score(self, evaluation: Evaluation) -> float:
        """The statistic of ``evaluation`` signed so that higher is better."""
        s = self.statistic_of(evaluation.metric(self.metric))
        return s if self.op == ">=" else -s

    def met_by(self, evaluation: Evaluation) -> bool:
        s = self.statistic_of(evaluation.metric(self.metric))
        return s >= self.value if self.op == ">=" else s <= self.value

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> FidelityTarget:
        return cls(**checked_fields(cls, data))


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One searched option: its candidates and the direction that makes a run cheaper (None: unknown, or values
    that are not all numbers; such an axis is enumerated)."""
    option: str
    values: tuple
    faster: Faster | None

    def cheapest_first(self) -> tuple:
        return tuple(sorted(self.values, reverse=self.faster == "higher"))


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _seeds(name: str, seeds) -> tuple[int, ...]:
    out = tuple(seeds)
    if not out or len(set(out)) != len(out) or not all(isinstance(s, int) and not isinstance(s, bool) for s in out):
        raise ValueError(f"{name} must be distinct integers, at least one; got {out!r}")
    return out


def parse_seeds(text: str, flag: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``; the message of a bad value names ``flag``."""
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _json_value(v):
    """Option values read back from JSON: lists were tuples."""
    return tuple(_json_value(x) for x in v) if isinstance(v, list) else v


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """What :func:`tune` searches (see the module docstring).

    family : the registered strategy to tune (e.g. ``marche``, ``lazymar``, ``disa``; ``marche-drift``: the online
        variant).
    target : a :class:`FidelityTarget` or its text (``"psnr>=30"``).
    calibration_seeds, heldout_seeds : disjoint seeds; the search sees only the first, the validation the second.
    space : ``((option, candidates), ...)``; empty: the family's default (:data:`KNOBS`).
    options : fixed options of every candidate (not searched).
    search : ``"bisect"`` or ``"exhaustive"``.
    num_samples, labels : images per seed and their labels (default 0, 1, 2, ... cycled).
    sampling : the sampling settings (left-out fields: the model's recommended, else the official defaults).
    batch_size : images per forward batch.
    """
    family: str
    target: FidelityTarget
    calibration_seeds: tuple[int, ...] = (0, 1)
    heldout_seeds: tuple[int, ...] = (2,)
    space: tuple[tuple[str, tuple], ...] = ()
    options: tuple[tuple[str, object], ...] = ()
    search: Search = "bisect"
    num_samples: int = 8
    labels: tuple[int, ...] | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    batch_size: int = 64

    def __post_init__(self):
        from . import strategies
        if isinstance(self.target, str):
            object.__setattr__(self, "target", FidelityTarget.parse(self.target))
        if not isinstance(self.target, FidelityTarget):
            raise ValueError(f"target must be a FidelityTarget or its text (e.g. 'psnr>=30'), got {self.target!r}")
        valid = strategies.options(self.family)                     # an unknown family lists the registered ones
        self._check_seeds()
        fixed = dict(self.options)
        space = tuple((str(k), tuple(v)) for k, v in (dict(self.space) or dict(default_space(self.family))).items())
        for key in [*fixed, *(k for k, _ in space)]:
            if key not in valid:
                raise ValueError(f"strategy {self.family!r} has no option {key!r}; valid options: "
                                 f"{strategies.describe(self.family)}")
        for key, values in space:
            if not values:
                raise ValueError(f"the search space gives no candidate value for option {key!r}")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"the candidates of option {key!r} repeat a value: {list(values)!r}")
        clash = sorted(set(fixed) & {k for k, _ in space})
        if clash:
            raise ValueError(f"option(s) {clash!r} are both searched and fixed; expected each in one place")
        object.__setattr__(self, "space", space)
        object.__setattr__(self, "options", tuple(sorted(fixed.items())))
        self._check_settings()
        self.candidates()  # noqa: B018  (every candidate is a valid configuration of the family)

    def _check_seeds(self) -> None:
        cal = _seeds("calibration_seeds", self.calibration_seeds)
        held = _seeds("heldout_seeds", self.heldout_seeds)
        both = sorted(set(cal) & set(held))
        if both:
            raise ValueError(f"calibration and held-out seeds overlap in {both!r} (calibration {list(cal)!r}, "
                             f"held-out {list(held)!r}); expected disjoint seeds, so that the held-out check runs on "
                             "images the search never saw")
        object.__setattr__(self, "calibration_seeds", cal)
        object.__setattr__(self, "heldout_seeds", held)

    def _check_settings(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"unknown search {self.search!r}; expected one of {SEARCHES!r}")
        for name in ("num_samples", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {self.sampling!r}")
        if self.labels is not None:
            object.__setattr__(self, "labels", tuple(int(x) for x in self.labels))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The searched options with their directions (:data:`KNOBS`)."""
        knobs = KNOBS.get(self.family, {})
        return tuple(Axis(option=k, values=v, faster=knobs[k].faster if k in knobs and all(map(_numeric, v))
                          else None) for k, v in self.space)

    def run(self, point: dict) -> StrategyRun:
        """The candidate at ``point`` (``{option: value}`` of every axis), labelled ``"budget=16,refresh_period=3"``."""
        label = ",".join(f"{k}={point[k]}" for k, _ in self.space)
        try:
            return StrategyRun(label=label, name=self.family, options=tuple({**dict(self.options), **point}.items()))
        except ValueError as exc:
            raise ValueError(f"candidate {label!r} of {self.family!r} is not a valid configuration: {exc}") from None

    def candidates(self) -> tuple[StrategyRun, ...]:
        """Every candidate of the space, in grid order (the last option varies fastest)."""
        keys = [k for k, _ in self.space]
        return tuple(self.run(dict(zip(keys, p))) for p in itertools.product(*(v for _, v in self.space)))

    def rows(self) -> tuple[tuple[StrategyRun, ...], ...]:
        """The candidates as :func:`tune`'s bisection visits them: one row per combination of the other options,
        ordered cheapest first along the last option with a known direction (rows of one when none has)."""
        axes = self.axes
        k = max((i for i, a in enumerate(axes) if a.faster is not None), default=None)
        if k is None:
            return tuple((run,) for run in self.candidates())
        others = [a for i, a in enumerate(axes) if i != k]
        return tuple(tuple(self.run({**dict(zip((a.option for a in others), point)), axes[k].option: v})
                           for v in axes[k].cheapest_first())
                     for point in itertools.product(*(a.values for a in others)))

    def compare_config(self) -> CompareConfig:
        """The :class:`~mar_probe.compare.CompareConfig` the runs share (sampling, labels, batch size)."""
        s = self.sampling
        return CompareConfig(runs=(), num_samples=self.num_samples, labels=self.labels,
                             seeds=self.calibration_seeds + self.heldout_seeds, num_iter=s.num_iter, cfg=s.cfg,
                             cfg_schedule=s.cfg_schedule, temperature=s.temperature, head_steps=s.head_steps,
                             batch_size=self.batch_size, rng=s.rng)

    def resolved(self, model) -> TuneConfig:
        """This config with every sampling field the model's recommended setting, else the official default."""
        return dataclasses.replace(self, sampling=self.sampling.resolve(model))

    def to_dict(self) -> dict:
        return {"family": self.family, "target": self.target.to_dict(),
                "calibration_seeds": list(self.calibration_seeds), "heldout_seeds": list(self.heldout_seeds),
                "space": {k: list(v) for k, v in self.space}, "options": dict(self.options), "search": self.search,
                "num_samples": self.num_samples, "labels": None if self.labels is None else list(self.labels),
                "sampling": self.sampling.to_dict(), "batch_size": self.batch_size}

    @classmethod
    def from_dict(cls, data) -> TuneConfig:
        data = checked_fields(cls, data)
        data["target"] = FidelityTarget.from_dict(data["target"])
        data["sampling"] = SamplingConfig.from_dict(data.get("sampling", {}))
        data["space"] = tuple((k, tuple(_json_value(x) for x in v)) for k, v in dict(data.get("space", {})).items())
        data["options"] = tuple((k, _json_value(v)) for k, v in dict(data.get("options", {})).items())
        for key in ("calibration_seeds", "heldout_seeds", "labels"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One configuration on some seeds, paired against ``full``: FLOPs and time speed-ups (intervals over seeds)
    and every paired fidelity metric (intervals over all images of all seeds)."""
    run: StrategyRun
    seeds: tuple[int, ...]
    steps: int
    speedup_flops: Interval
    speedup_time: Interval
    fidelity: tuple[tuple[str, Interval], ...]

    @classmethod
    def measure(cls, run: StrategyRun, runs: list[SeedRun], full: list[SeedRun]) -> Evaluation:
        """The evaluation of ``run`` from its per-seed runs and ``full``'s on the same seeds."""
        fid = [paired_fidelity(r.tokens, f.tokens, r.images, f.images) for r, f in zip(runs, full)]
        return cls(run=run, seeds=tuple(r.seed for r in runs), steps=runs[0].steps,
                   speedup_flops=Interval.of([f.flops / r.flops for r, f in zip(runs, full)]),
                   speedup_time=Interval.of([f.seconds / r.seconds for r, f in zip(runs, full)]),
                   fidelity=tuple((k, Interval.of(np.concatenate([d[k].values for d in fid])))
                                  for k in FIDELITY if k in fid[0]))

    def metric(self, name: str) -> Interval:
        """The interval of fidelity metric ``name``."""
        have = dict(self.fidelity)
        if name not in have:
            raise ValueError(f"fidelity metric {name!r} was not measured: it needs decoded images, and this model "
                             f"gave none (an ImageNet checkpoint needs --vae); measured: {sorted(have)!r}")
        return have[name]

    def to_dict(self) -> dict:
        return {"run": self.run.to_dict(), "seeds": list(self.seeds), "steps": self.steps,
                "speedup_flops": self.speedup_flops.to_dict(), "speedup_time": self.speedup_time.to_dict(),
                "fidelity": {k: v.to_dict() for k, v in self.fidelity}}

    @classmethod
    def from_dict(cls, data) -> Evaluation:
        data = checked_fields(cls, data)
        run = dict(data["run"])
        run["options"] = {k: _json_value(v) for k, v in run.get("options", {}).items()}
        return cls(run=StrategyRun.from_dict(run),
                   seeds=tuple(data["seeds"]), steps=int(data["steps"]),
                   speedup_flops=Interval.from_dict(data["speedup_flops"]),
                   speedup_time=Interval.from_dict(data["speedup_time"]),
                   fidelity=tuple((k, Interval.from_dict(v)) for k, v in data["fidelity"].items()))


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What :func:`tune` found: every calibration evaluation (in the order run), the chosen configuration (the
    fastest meeting the target on calibration; None when none did) and its held-out evaluation."""
    config: TuneConfig
    model: str
    candidates: tuple[Evaluation, ...]
    chosen: Evaluation | None = None
    heldout: Evaluation | None = None

    def meets(self, evaluation: Evaluation) -> bool:
        return self.config.target.met_by(evaluation)

    @property
    def met(self) -> bool | None:
        """Whether the target held on the held-out seeds (None: not validated)."""
        return None if self.heldout is None else self.meets(self.heldout)

    @property
    def closest(self) -> Evaluation:
        """The calibration candidate whose statistic is best (nearest the target when none meets it)."""
        return max(self.candidates, key=self.config.target.score)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "config": self.config.to_dict(), "model": self.model,
                "candidates": [dict(e.to_dict(), meets=self.meets(e)) for e in self.candidates],
                "chosen": None if self.chosen is None else self.chosen.run.label,
                "heldout": None if self.heldout is None else self.heldout.to_dict(), "met": self.met}

    @classmethod
    def from_dict(cls, data) -> TuneResult:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} report: format {data.get('format')!r}, version "
                             f"{data.get('version')!r}")
        cands = tuple(Evaluation.from_dict({k: v for k, v in e.items() if k != "meets"}) for e in data["candidates"])
        chosen = next((e for e in cands if e.run.label == data["chosen"]), None)
        held = None if data["heldout"] is None else Evaluation.from_dict(data["heldout"])
        return cls(config=TuneConfig.from_dict(data["config"]), model=data["model"], candidates=cands,
                   chosen=chosen, heldout=held)


class TargetUnreachableError(ValueError):
    """No candidate met the target on the calibration seeds; ``result`` holds what was evaluated (its
    ``closest`` is the configuration named in the message)."""

    def __init__(self, message: str, result: TuneResult):
        super().__init__(message)
        self.result = result


class _Bench:
    """Runs candidates on seeds paired against ``full``, whose run of each seed is made once and kept."""

    def __init__(self, model, config: TuneConfig, vae=None, bar=None):
        self.model, self.vae, self.bar = model, vae, bar
        self.shared = config.compare_config()
        self.labels = self.shared.label_array(model.num_classes)
        self.full: dict[int, SeedRun] = {}
        self.reference = StrategyRun(label="full", name="full")

    def _full(self, seed: int) -> SeedRun:
        if seed not in self.full:
            self.full[seed] = run_strategy(self.model, self.reference, self.labels, seed, self.shared, self.vae)
        return self.full[seed]

    def evaluate(self, run: StrategyRun, seeds) -> Evaluation:
        if self.bar is not None:
            self.bar.set_postfix_str(run.label)
        full = [self._full(s) for s in seeds]
        runs = [run_strategy(self.model, run, self.labels, s, self.shared, self.vae) for s in seeds]
        if self.bar is not None:
            self.bar.update(1)
        return Evaluation.measure(run, runs, full)


def _bisect(row, evaluate, target: FidelityTarget) -> list[Evaluation]:
    """The evaluations that find the first (cheapest) candidate of ``row`` meeting ``target``, assuming fidelity
    improves along the row."""
    lo, hi, done = 0, len(row), []
    while lo < hi:                 # row[:lo] fail, row[hi:] meet (as far as evaluated)
        mid = (lo + hi) // 2
        done.append(evaluate(row[mid]))
        if target.met_by(done[-1]):
            hi = mid
        else:
            lo = mid + 1
    return done


def search(config: TuneConfig, evaluate) -> tuple[Evaluation, ...]:
    """The calibration evaluations of ``config.search`` (``evaluate``: StrategyRun -> Evaluation)."""
    if config.search == "exhaustive":
        return tuple(evaluate(run) for run in config.candidates())
    return tuple(ev for row in config.rows() for ev in _bisect(row, evaluate, config.target))


def fastest_meeting(evaluations, target: FidelityTarget) -> Evaluation | None:
    """The evaluation with the highest FLOPs speed-up among those meeting ``target`` (ties: the better
    statistic, then the first), or None."""
    ok = [e for e in evaluations if target.met_by(e)]
    return max(ok, key=lambda e: (e.speedup_flops.mean, target.score(e)), default=None)


def tune(model, config: TuneConfig, vae=None, progress: bool = True) -> TuneResult:
    """Search ``config``'s space on the calibration seeds for the fastest configuration meeting its target, then
    validate it on the held-out seeds (see the module docstring).

    Raises
    ------
    TargetUnreachableError
        When no evaluated candidate meets the target; its ``result`` holds the calibration evaluations.
    """
    config = config.resolved(model)
    with tqdm(total=len(config.candidates()), desc=f"tune {config.family}", unit="candidate",
              disable=not progress) as bar:
        bench = _Bench(model, config, vae, bar)
        found = search(config, lambda run: bench.evaluate(run, config.calibration_seeds))
        bar.total = bar.n
        bar.refresh()
    chosen = fastest_meeting(found, config.target)
    result = TuneResult(config=config, model=model.config.name, candidates=found, chosen=chosen)
    if chosen is None:
        near = result.closest
        raise TargetUnreachableError(
            f"no candidate of {config.family!r} reaches {config.target.describe} on calibration seeds "
            f"{list(config.calibration_seeds)!r} ({len(found)} of {len(config.candidates())} evaluated, "
            f"search {config.search!r}); the closest is {near.run.label!r} with {config.target.metric} "
            f"{near.metric(config.target.metric)} at a FLOPs speed-up of {near.speedup_flops.mean:.4g}; relax the "
            "target or widen the search space", result)
    bench.bar = None
    return dataclasses.replace(result, heldout=bench.evaluate(chosen.run, config.heldout_seeds))


def format_report(result: TuneResult) -> str:
    """The search as text: the target, one line per calibration candidate, the choice and its held-out check."""
    c, t = result.config, result.config.target
    lines = [f"tune {c.family}: target {t.describe}; search {c.search!r} over "
             + ", ".join(f"{k}={list(v)!r}" for k, v in c.space),
             f"calibration seeds {list(c.calibration_seeds)!r} x {c.num_samples} images: {len(result.candidates)} "
             f"of {len(c.candidates())} candidates evaluated",
             "| candidate | FLOPs speed-up (end to end) | " + t.metric + " | meets |", "|---|---:|---:|---|"]
    for e in sorted(result.candidates, key=lambda e: -e.speedup_flops.mean):
        lines.append(f"| {e.run.label} | {e.speedup_flops.mean:.4g} | {e.metric(t.metric)} | "
                     f"{'yes' if result.meets(e) else 'no'} |")
    if result.chosen is None:
        lines.append(f"no candidate meets the target; closest: {result.closest.run.label}")
        return "\n".join(lines)
    h = result.heldout
    lines.append(f"chosen: {result.chosen.run.label} (FLOPs speed-up {result.chosen.speedup_flops.mean:.4g} end to "
                 "end on calibration)")
    if h is not None:
        lines.append(f"held-out seeds {list(h.seeds)!r}: {t.metric} {h.metric(t.metric)}, end-to-end FLOPs speed-up "
                     f"{h.speedup_flops}, time speed-up {h.speedup_time}: target "
                     f"{'met' if result.met else 'NOT met'} ({t.describe})")
    return "\n".join(lines)


def write_report(result: TuneResult, out) -> Path:
    """Write ``tune.json`` and ``tune.png`` (candidates' speed against fidelity, target line, chosen point)."""
    from .plot.tune import save_tune_plot
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result.to_dict(), indent=2))
    save_tune_plot(result, out / "tune.png")
    return out
