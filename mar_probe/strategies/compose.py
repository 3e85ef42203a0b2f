"""``compose``: strategies combined through the interface — a token policy, LazyMAR's condition cache and
LazyMAR's diffusion-head cache.

* **Token policy**: any registered strategy that exposes its decoder hidden state
  (:meth:`~mar_probe.engine.strategy.Strategy.hidden`), built from ``tokens`` and ``token_opts`` (default: MARché).
* **Condition cache** (LazyMAR's): on the token policy's refresh steps both CFG branches are computed and the
  difference ``uncond - cond`` of the decoder's last hidden state is stored; on its other steps the token policy
  runs on the conditional branch only and the unconditional hidden state is ``cond + difference``.
* **Diffusion-head cache**: :class:`~mar_probe.strategies.head_cache.HeadCache` (MLP reuse every ``head_interval``
  reverse steps and the cached CFG difference inside the head), the part ``lazymar`` uses too.

The three are separate parts: the token policy is a strategy, the condition cache a
:class:`~mar_probe.strategies.condition_cache.ConditionCache`, the head cache a ``HeadCache``.

With the token policy refreshing every step and ``head_interval=1`` it equals ``full`` exactly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


from .._config import check_ints
from . import create, describe, options, parse_options, register
from ..engine.strategy import Strategy
from .condition_cache import ConditionCache, cond_only  # noqa: F401  (cond_only: its old home)
from .head_cache import HeadCache, HeadCacheConfig


@dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """Options of :class:`ComposeStrategy`.

    tokens : registered strategy deciding which rows each layer computes (must implement ``hidden``).
    token_opts : its options, typed (``{"budget": 32, "refresh_period": 4}``); the command line's
        ``KEY=VALUE;KEY=VALUE`` string is parsed into the same dict (issue 18: nested options are typed).
    condition_cache : derive the unconditional branch between the token policy's refresh steps.
    condition_warmup : steps ``< condition_warmup`` compute both branches (LazyMAR computes everything in its first
        5 steps, where the CFG residual still moves most); 0 derives from step 1 on.
    head_cache : LazyMAR's diffusion-head cache; ``head_interval`` is its recompute interval and
        ``head_batch_modulation`` makes the AdaLN modulations of its evaluations in one product per step.
    """
    tokens: str = "marche"
    token_opts: dict | str = dataclasses.field(default_factory=dict)
    condition_cache: bool = True
    condition_warmup: int = 0
    head_cache: bool = True
    head_interval: int = 7
    head_batch_modulation: bool = False

    def __post_init__(self):
        check_ints("compose", self, (("head_interval", 1), ("condition_warmup", 0)))
        if self.tokens == "compose":
            raise ValueError("compose tokens must name another strategy, got 'compose'")
        opts = self.token_opts
        if isinstance(opts, str):
            opts = parse_options(self.tokens, [p for p in opts.split(";") if p.strip()])
        elif isinstance(opts, Mapping):
            unknown = sorted(set(opts) - set(options(self.tokens)))
            if unknown:
                raise ValueError(f"strategy {self.tokens!r} has no option {unknown[0]!r}; valid options: "
                                 f"{describe(self.tokens)}")
        else:
            raise ValueError(f"compose token_opts must be a dict of {self.tokens!r} options (or KEY=VALUE;... text), "
                             f"got {type(opts).__name__!r}")
        object.__setattr__(self, "token_opts", dict(opts))

    def token_options(self) -> dict:
        """The typed options of the ``tokens`` strategy."""
        return dict(self.token_opts)


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
        c = self.config
        self.condition = ConditionCache(c.condition_warmup) if c.condition_cache else None
        self.head = HeadCache(HeadCacheConfig(interval=c.head_interval, batch_modulation=c.head_batch_modulation)) \
            if c.head_cache else None

    @classmethod
    def exact_options(cls, num_iter):
        exact = create(ComposeConfig.tokens).exact_options(num_iter)
        return {"token_opts": dict(exact), "head_interval": 1}

    def to_dict(self) -> dict:
        return dict(super().to_dict(), token_strategy=self.tokens.to_dict())

    def num_steps(self, requested):
        return self.tokens.num_steps(requested)

    def begin(self, model, batch_size, num_iter):
        self.tokens.begin(model, batch_size, num_iter)
        for part in (self.condition, self.head):
            if part is not None:
                part.reset()

    def is_refresh(self, step):
        return self.tokens.is_refresh(step)

    def hidden(self, model, state, timer):
        if self.condition is None:
            return self.tokens.hidden(model, state, timer)
        return self.condition.hidden(self.tokens, model, state, timer)

    def head_sample(self, model, z, state, rng):
        if self.head is None:
            return super().head_sample(model, z, state, rng)
        return self.head.head_sample(model, z, state, rng)

