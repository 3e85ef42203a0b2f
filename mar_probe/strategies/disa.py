"""``disa``: DiSA, diffusion step annealing (Zhao et al., arXiv 2505.20297), as its paper and released code
(Qinyu-Allen-Zhao/DiSA, folder ``MAR_DiSA``; line numbers below are of commit 283fa59) do it for MAR.

The transformer runs in full at every step (as ``full``); only the diffusion head's number of reverse steps changes
from one MAR step to the next: many steps while few tokens are known, fewer as the image fills in (the paper's
observation that later tokens follow more constrained distributions). At step ``s`` of an ``S``-step run, with
``span = upper - lower`` and ``last = S - 1``, the head samples with ``K(s)`` evenly respaced steps:

* ``linear``: ``K = lower + int((last - s) / last * span)``;
* ``cosine``: ``K = lower + int((cos(pi * s / last) + 1) / 2 * span)``;
* ``two-stage``: ``K = upper`` while ``s < last / 2``, then ``lower``;
* ``constant``: ``K = lower`` at every step (the code's baseline schedule).

The formulas are the released code's (``MAR_DiSA/models/diffloss.py`` lines 95-105, ``DiffLoss.sample``: the
index into its list of diffusions built for ``lower..upper`` steps, lines 50-54, so ``K = lower + index``),
evaluated in the same float64 order and truncated by ``int()`` as there: e.g. ``S=16, upper=80, lower=5, s=4``
gives ``int(11 / 15 * 75) = 54`` (float64 lands just below the exact 55), so ``K = 59``. The schedule depends on
the step index over the run's step count (``MAR_DiSA/models/mar.py`` line 325 passes ``step`` and ``num_iter``),
not on the fraction of tokens generated. A head with ``K`` steps is exactly the official head with
``num_sampling_steps=str(K)`` (``DiffLoss.diffusion_for``), apart from the clamp below.

Every constant of the released code is an option with the code's default:

* ``upper`` 50 and ``lower`` 5: the defaults of ``DiffLoss`` and ``MAR`` (``MAR_DiSA/models/diffloss.py`` line 13,
  ``MAR_DiSA/models/mar.py`` lines 40-41) and the README's evaluation commands for MAR-B, MAR-L and MAR-H alike
  (``README.md`` lines 56, 69, 82: ``--diff_upper_steps 50 --diff_lower_steps 5``, with ``--num_iter 64``, replacing
  the official ``--num_iter 256 --num_sampling_steps 100``, line 88); the paper's abstract: "using 50 steps at the
  beginning and gradually decreasing to 5 steps at later stages". (``MAR_DiSA/main_mar.py``'s argparse default
  for the upper bound is 25, line 92; every published command sets 50.) None means the head's own step count
  (``num_sampling_steps``, or the run's ``head_steps``). Both must be at least 2: a one-step reverse process has
  no posterior variance (its table in the code is empty, and sampling with it fails).
* ``schedule`` ``"linear"``: the same defaults (``diffloss.py`` line 13, ``mar.py`` line 42, ``main_mar.py`` line
  94) and commands; ``cosine``, ``two-stage`` and ``constant`` are the code's other schedules (``diffloss.py``
  lines 98-103): the paper compares two-stage, linear and cosine time schedulers, ``constant`` is the code's
  fixed-``lower`` baseline. (The Harmon port, ``Harmon_DiSA/src/models/mar/diffloss.py``, has no ``two-stage``.)
* ``clip_timestep`` 950: the code's DiSA sampler builds each of its diffusions with ``create_diffusion``'s
  default ``clip_timesteps=950`` (``MAR_DiSA/diffusion/__init__.py`` lines 20 and 32; the Harmon port hard-codes
  the same 950, ``Harmon_DiSA/src/models/mar/diffusion/__init__.py`` line 31): the kept timesteps are clamped to
  at most 950, those above it merging into one, so the reverse process starts from timestep 950 and 50 steps
  evaluate the network 48 times (100: 96). Its ``default`` sampler (the official MAR) passes 1001, no clamp
  (``diffloss.py`` line 56). None turns the clamp off: the official respacing.

The CFG scales and step count of the README's commands (MAR-B 2.9, MAR-L 3.0, MAR-H 3.3, linear CFG schedule,
64 steps, temperature 1.0) are sampling settings (``SamplingConfig``), not options of this strategy.

Where the code has no behaviour this follows the obvious extension: in a one-step run (where the code's ``linear``
and ``cosine`` divide by zero) the single step uses ``upper``, the value step 0 has in every longer run
(``two-stage`` and ``constant`` keep their formulas, which give ``lower`` there). With ``upper = lower =`` the
head's own steps and no clamp (:meth:`DiSAStrategy.exact_options`) it is ``full`` bit for bit.

The schedule itself (formulas, options, checks) lives in :mod:`mar_probe.strategies.head_schedule`
(:class:`~mar_probe.strategies.head_schedule.DiSASchedule`), a part that ``compose`` holds too.
"""
from __future__ import annotations

from . import register
from ..engine.strategy import FullStrategy, sample_head
from .head_schedule import SCHEDULES, DiSASchedule, DiSAScheduleConfig, Schedule, annealed_steps

__all__ = ["SCHEDULES", "DiSAConfig", "DiSAStrategy", "Schedule", "annealed_steps"]

DiSAConfig = DiSAScheduleConfig
"""Options of :class:`DiSAStrategy`: exactly those of its head-step schedule
(:class:`~mar_probe.strategies.head_schedule.DiSAScheduleConfig`; ``compose`` takes the same as ``head_opts``)."""


@register("disa")
class DiSAStrategy(FullStrategy):
    """DiSA: the full transformer and a head whose diffusion steps anneal over the run (see the module docstring).

    The schedule is a :class:`~mar_probe.strategies.head_schedule.DiSASchedule` part, the one ``compose`` holds
    with ``head_schedule="disa"``."""

    name = "disa"
    Config = DiSAConfig

    def __init__(self, **options):
        self.config = DiSAConfig(**options)
        self.schedule = DiSASchedule(self.config)

    @classmethod
    def exact_options(cls, num_iter):
        return {"upper": None, "lower": None, "clip_timestep": None}

    def bounds(self, model) -> tuple[int, int]:
        """(upper, lower) head steps for ``model`` (:meth:`DiSASchedule.bounds`)."""
        return self.schedule.bounds(model)

    def steps(self, model, num_iter: int) -> list[int]:
        """Head steps of every step of a ``num_iter``-step run on ``model``."""
        return self.schedule.steps(model, num_iter)

    def begin(self, model, batch_size, num_iter):
        self.schedule.bounds(model)                    # a bad schedule fails before the first step

    def head_steps(self, model, state):
        return self.schedule.head_steps(model, state)

    def head_sample(self, model, z, state, rng):
        return sample_head(model, z, state, rng, clip_timestep=self.schedule.clip_timestep)
