"""The engine's contract with everything that plugs into the sampling loop (issue 18): today the sampling settings
(:class:`SamplingConfig`, the one source of their defaults)."""
from .sampling import (CFG_SCHEDULES, OFFICIAL, RNG_MODES, SamplingConfig, check_guidance, head_steps_applied,
                       sampling_config)

__all__ = ["CFG_SCHEDULES", "OFFICIAL", "RNG_MODES", "SamplingConfig", "check_guidance", "head_steps_applied",
           "sampling_config"]
