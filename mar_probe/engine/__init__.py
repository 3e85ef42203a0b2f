"""The engine: the sampling loop and its contract with everything that plugs into it (issue 18).

- :mod:`~mar_probe.engine.sampling`: :class:`SamplingConfig`, the one source of sampling settings and their defaults;
- :mod:`~mar_probe.engine.loop`: the step loop (:class:`Sampler`), the step state (:class:`StepState`) and its typed
  outputs (:class:`StepOutputs`), the random sources (:class:`SampleRNG`);
- :mod:`~mar_probe.engine.strategy`: the strategy interface (:class:`Strategy`), its step plan (:class:`StepPlan`),
  the baseline (:class:`FullStrategy`, the reference every strategy's exactness is defined against) and the
  :class:`Timer`;
- :mod:`~mar_probe.engine.cost`: the FLOP formulas.

Strategies (:mod:`mar_probe.strategies`) and the probe depend on the engine, never the reverse
(``tests/test_layers.py``).
"""
from .loop import SampleRNG, Sampler, StepOutputs, StepState, plan_step
from .sampling import (CFG_SCHEDULES, OFFICIAL, RNG_MODES, SamplingConfig, check_guidance, head_steps_applied,
                       sampling_config)
from .strategy import FullStrategy, StepPlan, Strategy, Timer

__all__ = ["CFG_SCHEDULES", "OFFICIAL", "RNG_MODES", "FullStrategy", "SampleRNG", "Sampler", "SamplingConfig",
           "StepOutputs", "StepPlan", "StepState", "Strategy", "Timer", "check_guidance", "head_steps_applied",
           "plan_step", "sampling_config"]
