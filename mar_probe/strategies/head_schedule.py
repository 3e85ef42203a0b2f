"""Head-step schedules: how many respaced reverse steps the diffusion head takes at each MAR step, as a part that a
strategy holds (issue 17): ``disa`` holds one and so does ``compose`` (``head_schedule="disa"``).

A schedule answers :meth:`~mar_probe.engine.strategy.Strategy.head_steps` (the sampler records the answer in
``StepPlan.head_steps``) and names the timestep clamp of the respaced processes (``clip_timestep``), which the head
sampler passes to :meth:`~mar_probe.models.diffloss.DiffLoss.diffusion_for`: the plain head
(:func:`~mar_probe.engine.strategy.sample_head`) and LazyMAR's head cache
(:class:`~mar_probe.strategies.head_cache.HeadCache`) both honour it.

:class:`DiSASchedule` is DiSA's annealing (Zhao et al., arXiv 2505.20297); its formulas, defaults and their sources
are documented in :mod:`mar_probe.strategies.disa`, the strategy made of the full transformer and this schedule.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["linear", "cosine", "two-stage", "constant"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)


def annealed_steps(step: int, num_iter: int, upper: int, lower: int, schedule: str = "linear") -> int:
    """Head steps ``K`` at ``step`` of a ``num_iter``-step run annealed from ``upper`` to ``lower`` (the released
    DiSA code's formulas, see :mod:`mar_probe.strategies.disa`)."""
    if not 0 <= step < num_iter:
        raise ValueError(f"disa step {step!r} is outside a run of {num_iter!r} steps")
    if schedule not in SCHEDULES:
        raise ValueError(f"disa schedule must be one of {SCHEDULES!r}, got {schedule!r}")
    last, span = num_iter - 1, upper - lower
    if schedule == "constant":
        return lower
    if schedule == "two-stage":
        return upper if step < last / 2 else lower
    if last == 0:                                      # one-step run: the code divides by zero
        return upper
    if schedule == "linear":
        return lower + int((last - step) / last * span)
    return lower + int((math.cos(math.pi * step / last) + 1) / 2 * span)


@dataclass(frozen=True, kw_only=True)
class DiSAScheduleConfig:
    """Options of DiSA's schedule (all of ``disa``'s options), defaults from the released code.

    upper : head steps at the first step (None: the head's own).
    lower : head steps at the last step (None: the head's own); at most ``upper``.
    schedule : ``linear``, ``cosine``, ``two-stage`` or ``constant``.
    clip_timestep : clamp of the kept diffusion timesteps (None: none, the official respacing).
    """
    upper: int | None = 50
    lower: int | None = 5
    schedule: Schedule = "linear"
    clip_timestep: int | None = 950

    def __post_init__(self):
        for name, low in (("upper", 2), ("lower", 2), ("clip_timestep", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                kind = "a positive integer" if low == 1 else f"an integer >= {low} (a reverse process of one step " \
                    "has no posterior variance: the official code cannot sample with one)"
                raise ValueError(f"disa {name} must be {kind} or None, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"disa schedule must be one of {SCHEDULES!r}, got {self.schedule!r}")
        if self.upper is not None and self.lower is not None and self.lower > self.upper:
            raise ValueError(f"disa lower={self.lower!r} exceeds upper={self.upper!r}: the head's steps anneal "
                             f"from upper down to lower (expected 2 <= lower <= upper)")


class DiSASchedule:
    """DiSA's head-step schedule: ``K(s)`` respaced steps at step ``s``, annealed from ``upper`` to ``lower``."""

    name = "disa"
    Config = DiSAScheduleConfig

    def __init__(self, config: DiSAScheduleConfig | None = None):
        self.config = DiSAScheduleConfig() if config is None else config

    @property
    def clip_timestep(self) -> int | None:
        """The clamp of the kept timesteps of every respaced process (None: the official respacing)."""
        return self.config.clip_timestep

    def to_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self.config)}

    def bounds(self, model) -> tuple[int, int]:
        """(upper, lower) head steps for ``model``: None resolved to its head's own count, checked against the
        head's diffusion (a respacing of its T training timesteps takes 2 to T steps)."""
        diff = model.diffloss
        own, limit = diff.gen_diffusion.num_timesteps, diff.train_diffusion.num_timesteps
        c = self.config
        upper = own if c.upper is None else c.upper
        lower = own if c.lower is None else c.lower
        if upper > limit:
            raise ValueError(f"disa head-step schedule {upper}->{lower} is outside the head's steps: upper="
                             f"{c.upper!r}, but a respacing of its {limit}-step diffusion takes 2 to {limit} steps")
        if lower > upper:
            raise ValueError(f"disa lower={c.lower!r} ({lower} steps) exceeds upper={c.upper!r} ({upper} steps; "
                             f"None is the head's own {own}): expected 2 <= lower <= upper")
        return upper, lower

    def steps(self, model, num_iter: int) -> list[int]:
        """Head steps of every step of a ``num_iter``-step run on ``model``."""
        upper, lower = self.bounds(model)
        return [annealed_steps(s, num_iter, upper, lower, self.config.schedule) for s in range(num_iter)]

    def head_steps(self, model, state) -> int:
        """Head steps at the step of ``state`` (what :meth:`Strategy.head_steps` answers)."""
        upper, lower = self.bounds(model)
        return annealed_steps(state.step, state.num_iter, upper, lower, self.config.schedule)


HEAD_SCHEDULES: dict[str, type] = {"disa": DiSASchedule}
"""Head-step schedules by name; each one's options are those of the registered strategy of the same name."""
