"""MARché's oracle and adaptive policies registered under their own names, so that the shared strategy tests
(tests/test_strategies.py) run each of them like every other strategy. Each is :class:`MARcheStrategy` with other
defaults; every option of ``marche`` stays available.

| name | defaults |
|---|---|
| ``marche-oracle`` | ``selection="oracle"``: refresh the rows of largest true K/V drift (an upper bound) |
| ``marche-drift`` | ``refresh_threshold=0.25, refresh_period=16``: refresh when the drift estimate crosses 0.25 |
| ``marche-adaptive`` | ``refresh_mass=0.5``: per step, the fewest rows (up to the budget) holding half the attention |
"""
from __future__ import annotations

from dataclasses import dataclass

from . import register
from .marche import MARcheConfig, MARcheStrategy


@dataclass(frozen=True, kw_only=True)
class OracleConfig(MARcheConfig):
    """``marche`` options with ``selection="oracle"``."""
    selection: str = "oracle"


@dataclass(frozen=True, kw_only=True)
class DriftConfig(MARcheConfig):
    """``marche`` options with a drift-triggered refresh (``refresh_period`` is the cap).

    The threshold is set from the embedded model (its 1,700-iteration checkpoint) at 16 steps, where the estimate
    is 0.18, 0.38 and 0.49 after
    1, 2 and 3 steps without refresh (one run, labels 0 and 5, seed 0): 0.25 refreshes about every other step
    there; at 64 steps each step decodes fewer tokens, so it should refresh less often (not measured).
    """
    refresh_threshold: float = 0.25
    refresh_period: int = 16


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig(MARcheConfig):
    """``marche`` options with a per-step budget covering half the attention of the non-must rows."""
    refresh_mass: float = 0.5


@register("marche-oracle")
class MARcheOracle(MARcheStrategy):
    """MARché refreshing the rows of largest true drift."""
    name = "marche-oracle"
    Config = OracleConfig


@register("marche-drift")
class MARcheDrift(MARcheStrategy):
    """MARché with a drift-triggered refresh."""
    name = "marche-drift"
    Config = DriftConfig


@register("marche-adaptive")
class MARcheAdaptive(MARcheStrategy):
    """MARché with a per-step adaptive budget."""
    name = "marche-adaptive"
    Config = AdaptiveConfig
