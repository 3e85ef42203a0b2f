"""``compose``: strategies combined through the interface — a token policy, LazyMAR's condition cache and
LazyMAR's diffusion-head cache.

* **Token policy**: any registered strategy that exposes its decoder hidden state
  (:meth:`~mar_probe.engine.strategy.Strategy.hidden`), built from ``tokens`` and ``token_opts`` (default: MARché).
* **Condition cache** (LazyMAR's): on the token policy's refresh steps both CFG branches are computed and the
  difference ``uncond - cond`` of the decoder's last hidden state is stored; on its other steps the token policy
  runs on the conditional branch only and the unconditional hidden state is ``cond + difference``.
* **Diffusion-head cache**: the head of a :class:`~mar_probe.strategies.lazymar.LazyMARStrategy` (MLP reuse every
  ``head_interval`` reverse steps and the cached CFG difference inside the head), called through ``head_sample``.

With the token policy refreshing every step and ``head_interval=1`` it equals ``full`` exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._config import check_ints
from . import create, parse_options, register
from ..engine.strategy import Strategy
from .lazymar import LazyMARStrategy


@dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """Options of :class:`ComposeStrategy`.

    tokens : registered strategy deciding which rows each layer computes (must implement ``hidden``).
    token_opts : its options as ``KEY=VALUE`` pairs separated by ``;`` (e.g. ``budget=32;refresh_period=4``).
    condition_cache : derive the unconditional branch between the token policy's refresh steps.
    condition_warmup : steps ``< condition_warmup`` compute both branches (LazyMAR computes everything in its first
        5 steps, where the CFG residual still moves most); 0 derives from step 1 on.
    head_cache : LazyMAR's diffusion-head cache; ``head_interval`` is its recompute interval and
        ``head_batch_modulation`` makes the AdaLN modulations of its evaluations in one product per step.
    """
    tokens: str = "marche"
    token_opts: str = ""
    condition_cache: bool = True
    condition_warmup: int = 0
    head_cache: bool = True
    head_interval: int = 7
    head_batch_modulation: bool = False

    def __post_init__(self):
        check_ints("compose", self, (("head_interval", 1), ("condition_warmup", 0)))
        if self.tokens == "compose":
            raise ValueError("compose tokens must name another strategy, got 'compose'")

    def token_options(self) -> dict:
        """``token_opts`` parsed into typed options of the ``tokens`` strategy."""
        return parse_options(self.tokens, [p for p in self.token_opts.split(";") if p.strip()])


@register("compose")
class ComposeStrategy(Strategy):
    """A token policy with LazyMAR's condition cache and diffusion-head cache (see the module docstring)."""

    name = "compose"
    Config = ComposeConfig

    def __init__(self, **options):
        self.config = ComposeConfig(**options)
        self.tokens = create(self.config.tokens, **self.config.token_options())
        if type(self.tokens).hidden is Strategy.hidden:
            raise ValueError(f"compose tokens={self.config.tokens!r} does not expose its decoder hidden state; "
                             "expected a strategy implementing Strategy.hidden, such as 'marche'")
        head = dict(head_interval=self.config.head_interval, head_batch_modulation=self.config.head_batch_modulation)
        self.head = LazyMARStrategy(**head) if self.config.head_cache else None
        self.diff = None

    @classmethod
    def exact_options(cls, num_iter):
        exact = create(ComposeConfig.tokens).exact_options(num_iter)
        return {"token_opts": ";".join(f"{k}={v}" for k, v in exact.items()), "head_interval": 1}

    def to_dict(self) -> dict:
        return dict(super().to_dict(), token_strategy=self.tokens.to_dict())

    def num_steps(self, requested):
        return self.tokens.num_steps(requested)

    def begin(self, model, batch_size, num_iter):
        self.tokens.begin(model, batch_size, num_iter)
        self.diff = None

    def is_refresh(self, step):
        return self.tokens.is_refresh(step)

    def hidden(self, model, state, timer):
        two = len(state.branches) == 2 and self.config.condition_cache
        warm = state.step < self.config.condition_warmup
        if not two or self.diff is None or warm or self.tokens.is_refresh(state.step):
            x = self.tokens.hidden(model, state, timer)                    # [B', S+L, D]
            if two:
                self.diff = x[state.batch_size:] - x[:state.batch_size]     # [B, S+L, D] uncond - cond
            return x
        x = self.tokens.hidden(model, cond_only(state), timer)              # [B, S+L, D]
        plan = state.outputs.plan
        plan.computed, plan.derived = ("cond",), ("uncond",)
        return torch.cat([x, x + self.diff], dim=0)                         # [B', S+L, D]

    def head_sample(self, model, z, state, rng):
        if self.head is None:
            return super().head_sample(model, z, state, rng)
        return self.head.head_sample(model, z, state, rng)


def cond_only(state):
    """The step state restricted to its conditional branch (the same outputs object, so plans land in the step's)."""
    b = state.batch_size
    return dataclasses.replace(state, branches=("cond",), tokens_in=state.tokens_in[:b], mask_in=state.mask_in[:b],
                               class_embedding=state.class_embedding[:b], enc_positions=state.enc_positions[:b],
                               outputs=state.outputs)
