"""``fewer-steps``: MAR with fewer decoding steps, the naive way to the same speed as a cache."""
from __future__ import annotations

from dataclasses import dataclass

from .._config import check_ints
from . import register
from ..engine.strategy import FullStrategy


@dataclass(frozen=True, kw_only=True)
class FewerStepsConfig:
    """Options of :class:`FewerStepsStrategy`.

    ``num_iter`` decoding steps replace the requested count (never more than requested). The default 28 is
    64 / 2.3, the step count that matches LazyMAR's end-to-end speed-up target on the transformer.
    """
    num_iter: int = 28

    def __post_init__(self):
        check_ints("fewer-steps", self, (("num_iter", 1),))


@register("fewer-steps")
class FewerStepsStrategy(FullStrategy):
    """Full computation at every step, but ``min(num_iter, requested)`` steps on MAR's cosine schedule.

    At the requested step count it is :class:`FullStrategy` exactly.
    """

    name = "fewer-steps"
    Config = FewerStepsConfig

    def __init__(self, **options):
        self.config = FewerStepsConfig(**options)

    @classmethod
    def exact_options(cls, num_iter):
        return {"num_iter": num_iter}

    def num_steps(self, requested: int) -> int:
        return min(self.config.num_iter, requested)
