"""The one source of sampling settings (issue 18, item 2).

Before this module the defaults lived in five places and disagreed (CFG 1.0 in the API, 3.0 in the CLI, 2.0 in
the size estimate; temperature 1.0 in ``CompareConfig`` against a checkpoint's recommended 0.6), so ``sample()``
and ``mar-probe generate`` gave different images on a checkpoint without recommended settings. Now every entry
point (``sample``, ``record``, ``compare``, ``study``, the CLI) builds a :class:`SamplingConfig` and calls
:meth:`SamplingConfig.resolve`, which fills what was left out in one order:

1. the value given;
2. the model's recommended setting (a checkpoint's ``sampling_defaults``, as the official MAR README recommends a
   CFG scale and temperature per model; :func:`~mar_probe.models.checkpoints.load_model` puts them on
   ``model.sampling_defaults``);
3. :data:`OFFICIAL`, the defaults of the official ``main_mar.py`` (64 steps, CFG 1.0, linear, temperature 1.0);
   the head's steps default to the model's own (its config's ``num_sampling_steps``).
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from .._config import checked_fields
from ..models.checkpoints import SAMPLING_KEYS
from ..models.diffusion import parse_spacing

CFG_SCHEDULES = ("linear", "constant")
RNG_MODES = ("own", "official", "stepwise")  # loop.SampleRNG says what each draws
# main_mar.py's argparse defaults: --num_iter 64, --cfg 1.0, --cfg_schedule linear, --temperature 1.0
OFFICIAL = {"num_iter": 64, "cfg": 1.0, "cfg_schedule": "linear", "temperature": 1.0}


def check_guidance(cfg, temperature) -> None:
    """The one check of CFG scale and temperature: finite, CFG >= 1 and temperature > 0 (issue 19: NaN passed)."""
    for name, value, ok, want in (("cfg", cfg, lambda v: v >= 1.0, ">= 1"),
                                  ("temperature", temperature, lambda v: v > 0, "> 0")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not ok(value):
            raise ValueError(f"{name} must be a finite number {want}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How MAR samples: decoding steps, CFG scale and schedule, temperature, head steps and random layout.

    A field left as None means "the model's recommended setting, else the official default" and is filled by
    :meth:`resolve`; a resolved config has no None left.

    Parameters
    ----------
    num_iter : int, optional
        MAR decoding steps (``sample_tokens``' ``num_iter``).
    cfg : float, optional
        Classifier-free guidance scale (1.0: no unconditional branch).
    cfg_schedule : {"linear", "constant"}, optional
        The CFG ramp over steps (Muse's linear ramp, or constant).
    temperature : float, optional
        The diffusion head's sampling temperature.
    head_steps : str, optional
        Diffusion steps of the head's reverse process (``num_sampling_steps``, e.g. ``"100"``; default: the
        model's).
    rng : {"own", "official", "stepwise"}
        ``"official"`` consumes random numbers exactly as the official code after
        ``np.random.seed(seed); torch.manual_seed(seed)``; ``"own"`` uses the run's own generators;
        ``"stepwise"`` gives the head's noise of each step generators of their own, so that strategies that draw
        different amounts of noise (head-step schedules) still share every step's initial noise (issue 17).
    """
    num_iter: int | None = None
    cfg: float | None = None
    cfg_schedule: Literal["linear", "constant"] | None = None
    temperature: float | None = None
    head_steps: str | None = None
    rng: Literal["own", "official", "stepwise"] = "own"

    def __post_init__(self):
        if self.head_steps is not None and not isinstance(self.head_steps, str):
            object.__setattr__(self, "head_steps", str(self.head_steps))  # 50 and "50" are the same setting
        n = self.num_iter
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_iter must be a positive integer, got {n!r}")
        if self.cfg_schedule is not None and self.cfg_schedule not in CFG_SCHEDULES:
            raise ValueError(f"unknown cfg_schedule {self.cfg_schedule!r}; expected one of {CFG_SCHEDULES!r}")
        if self.rng not in RNG_MODES:
            raise ValueError(f"unknown rng mode {self.rng!r}; expected one of {RNG_MODES!r}")
        check_guidance(1.0 if self.cfg is None else self.cfg, 1.0 if self.temperature is None else self.temperature)
        if self.head_steps is not None:
            parse_spacing(self.head_steps)  # "100" or "25,25"; the error names what was given

    @property
    def resolved(self) -> bool:
        """True when no field is left to the model's or the official default."""
        return all(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def replace(self, **changes) -> SamplingConfig:
        """A copy with ``changes``; a change of None keeps the current value (so unset CLI flags change nothing)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def resolve(self, model) -> SamplingConfig:
        """Every field filled: given, else the model's recommended setting, else :data:`OFFICIAL` (module doc)."""
        recommended = dict(getattr(model, "sampling_defaults", None) or {})
        unknown = sorted(set(recommended) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"the model recommends unknown sampling setting(s) {unknown!r}; expected some of "
                             f"{SAMPLING_KEYS!r}")
        base = {**OFFICIAL, **recommended, "head_steps": str(model.diffloss.num_sampling_steps)}
        out = dataclasses.replace(self, **{k: v for k, v in base.items() if getattr(self, k) is None})
        if out.num_iter > model.seq_len:
            raise ValueError(f"num_iter {out.num_iter!r} exceeds the {model.seq_len} tokens to generate")
        return out

    def to_dict(self) -> dict:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> SamplingConfig:
        """Build from :meth:`to_dict`'s output, with a clear error for unknown keys."""
        return cls(**checked_fields(cls, data))

    @classmethod
    def of(cls, config) -> SamplingConfig:
        """The sampling fields that another config (``CompareConfig``, ``StudyConfig``) holds under the same names;
        a field it does not hold keeps this class's default. The field list is this class's alone, so a new
        sampling setting is added here and in the configs that expose it, never listed again by hand."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)})


def sampling_config(sampling: SamplingConfig | None = None, **given) -> SamplingConfig:
    """``sampling`` (default: all left to the model) with the fields ``given`` (not None) replaced."""
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__!r}")
    return (sampling or SamplingConfig()).replace(**given)


@contextmanager
def head_steps_applied(model, head_steps: str | None):
    """Sample with the head's reverse process respaced to ``head_steps`` for the duration, then restore it."""
    old = str(model.diffloss.num_sampling_steps)
    if head_steps is None or str(head_steps) == old:
        yield
        return
    model.diffloss.set_sampling_steps(head_steps)
    try:
        yield
    finally:
        model.diffloss.set_sampling_steps(old)
