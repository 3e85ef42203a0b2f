"""``compose``: strategies combined through the interface — a token side (a token policy and LazyMAR's condition
cache) and a head side (a head-step schedule and LazyMAR's diffusion-head cache).

Token side:

* **Token policy**: the part of a registered strategy that decides which rows each layer computes
  (:meth:`~mar_probe.engine.strategy.Strategy.token_policy`), built from ``tokens`` and ``token_opts`` (default:
  MARché); it must expose its decoder hidden state (:meth:`~mar_probe.engine.strategy.Strategy.hidden`:
  ``marche`` and its variants, ``recap``, and ``lazymar``'s token cache, :class:`~.lazymar.LazyMARTokens`).
* **Condition cache** (LazyMAR's): on the token policy's refresh steps both CFG branches are computed and the
  difference ``uncond - cond`` of the decoder's last hidden state is stored; on its other steps the token policy
  runs on the conditional branch only and the unconditional hidden state is ``cond + difference``.

Head side (what the head does is compose's alone: a token policy's own head options are refused in ``token_opts``,
since compose never calls the policy's head; e.g. ``recap``'s ``head_fraction``, ``lazymar``'s ``head_*``):

* **Head-step schedule** (``head_schedule``, typed ``head_opts``): the per-step number of respaced reverse steps,
  a :mod:`~mar_probe.strategies.head_schedule` part (``"disa"``: DiSA's annealing, the part ``disa`` holds; its
  options are ``disa``'s). None: the head's own steps at every step.
* **Diffusion-head cache**: :class:`~mar_probe.strategies.head_cache.HeadCache` (MLP reuse every ``head_interval``
  reverse steps and the cached CFG difference inside the head), the part ``lazymar`` uses too. With a schedule it
  runs over each step's respaced process (its interval counts the respaced reverse indices).
* ``head_batch_modulation``: the head cache's AdaLN modulations in one product per step (see ``lazymar``).

The parts are separate: the token policy is a strategy, the condition cache a
:class:`~mar_probe.strategies.condition_cache.ConditionCache`, the schedule a ``DiSASchedule``, the head cache a
``HeadCache``.

Exactness: with the token policy recomputing every step, no schedule (or ``upper = lower = None`` and
``clip_timestep=None``) and ``head_interval=1`` it equals ``full`` bit for bit; with only a schedule (token policy
recomputing, no head cache) it equals ``disa`` with the same options, tokens and FLOPs (tests/test_compose_head.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from .._config import check_ints
from . import create, describe, options, parse_options, register
from ..engine.strategy import Strategy, sample_head
from .condition_cache import ConditionCache, cond_only  # noqa: F401  (cond_only: its old home)
from .head_cache import HeadCache, HeadCacheConfig
from .head_schedule import HEAD_SCHEDULES
from .lazymar import CONDITION_OPTIONS as LAZYMAR_CONDITION_OPTIONS
from .lazymar import HEAD_OPTIONS as LAZYMAR_HEAD_OPTIONS

HEAD_SIDE_OPTIONS: dict[str, tuple[str, ...]] = {"recap": ("head_fraction",), "lazymar": LAZYMAR_HEAD_OPTIONS}
"""Options of a token policy that belong to its own head, which compose never calls: refused in ``token_opts``."""

CONDITION_SIDE_OPTIONS: dict[str, tuple[str, ...]] = {"lazymar": LAZYMAR_CONDITION_OPTIONS}
"""Options of a token policy that belong to its own condition cache, which compose's ``condition_cache`` replaces:
refused in ``token_opts``."""


def _typed_options(owner: str, strategy: str, opts) -> dict:
    """``opts`` (a dict, or the command line's ``KEY=VALUE;KEY=VALUE`` text) checked and typed as the options of the
    registered ``strategy``; ``owner`` names the compose option in errors."""
    if isinstance(opts, str):
        return parse_options(strategy, [p for p in opts.split(";") if p.strip()])
    if isinstance(opts, Mapping):
        unknown = sorted(set(opts) - set(options(strategy)))
        if unknown:
            raise ValueError(f"strategy {strategy!r} has no option {unknown[0]!r}; valid options: "
                             f"{describe(strategy)}")
        return dict(opts)
    raise ValueError(f"compose {owner} must be a dict of {strategy!r} options (or KEY=VALUE;... text), "
                     f"got {type(opts).__name__!r}")


@dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """Options of :class:`ComposeStrategy`.

    tokens : registered strategy whose token policy decides which rows each layer computes (implementing ``hidden``).
    token_opts : its options, typed (``{"budget": 32, "refresh_period": 4}``); the command line's
        ``KEY=VALUE;KEY=VALUE`` string is parsed into the same dict (issue 18: nested options are typed). Options of
        the policy's own head (``HEAD_SIDE_OPTIONS``) are refused: compose's head side samples.
    condition_cache : derive the unconditional branch between the token policy's refresh steps (LazyMAR's condition
        cache, the part ``lazymar`` holds too; ``lazymar``'s own ``condition_cache`` option is refused in
        ``token_opts``, as this one replaces it).
    condition_warmup : steps ``< condition_warmup`` compute both branches (LazyMAR computes everything in its first
        5 steps, where the CFG residual still moves most); 0 derives from step 1 on.
    head_cache : LazyMAR's diffusion-head cache; ``head_interval`` is its recompute interval and
        ``head_batch_modulation`` makes the AdaLN modulations of its evaluations in one product per step.
    head_schedule : per-step head steps: ``"disa"`` (DiSA's annealing) or None (the head's own steps).
    head_opts : the schedule's options, typed as ``token_opts`` (those of the registered strategy of the same name:
        ``{"upper": 50, "lower": 5, "schedule": "linear", "clip_timestep": 950}`` for ``disa``); empty: its defaults.
    """
    tokens: str = "marche"
    token_opts: dict | str = dataclasses.field(default_factory=dict)
    condition_cache: bool = True
    condition_warmup: int = 0
    head_cache: bool = True
    head_interval: int = 7
    head_batch_modulation: bool = False
    head_schedule: str | None = None
    head_opts: dict | str = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_ints("compose", self, (("head_interval", 1), ("condition_warmup", 0)))
        if self.tokens == "compose":
            raise ValueError("compose tokens must name another strategy, got 'compose'")
        opts = _typed_options("token_opts", self.tokens, self.token_opts)
        head_side = [k for k in HEAD_SIDE_OPTIONS.get(self.tokens, ()) if k in opts]
        if head_side:
            raise ValueError(f"compose token_opts option {head_side[0]!r}={opts[head_side[0]]!r} is {self.tokens!r}'s "
                             f"own head, which compose never calls (its head side samples every step); set the head "
                             f"with compose's head_schedule, head_opts, head_cache, head_interval and "
                             f"head_batch_modulation instead")
        condition_side = [k for k in CONDITION_SIDE_OPTIONS.get(self.tokens, ()) if k in opts]
        if condition_side:
            raise ValueError(f"compose token_opts option {condition_side[0]!r}={opts[condition_side[0]]!r} is "
                             f"{self.tokens!r}'s own condition cache, which compose never uses; set compose's "
                             f"condition_cache and condition_warmup instead")
        object.__setattr__(self, "token_opts", opts)
        if self.head_schedule is not None and self.head_schedule not in HEAD_SCHEDULES:
            raise ValueError(f"compose head_schedule must be one of {tuple(HEAD_SCHEDULES)!r} or None, "
                             f"got {self.head_schedule!r}")
        if self.head_schedule is None:
            if self.head_opts:
                raise ValueError(f"compose head_opts {self.head_opts!r} are given without a head_schedule (one of "
                                 f"{tuple(HEAD_SCHEDULES)!r})")
            head = {}
        else:
            head = _typed_options("head_opts", self.head_schedule, self.head_opts)
            self.schedule_config(head)                                       # the schedule's own checks
        object.__setattr__(self, "head_opts", head)

    def token_options(self) -> dict:
        """The typed options of the ``tokens`` strategy."""
        return dict(self.token_opts)

    def schedule_config(self, head_opts: dict | None = None):
        """The head schedule's typed config (None without a schedule)."""
        if self.head_schedule is None:
            return None
        return HEAD_SCHEDULES[self.head_schedule].Config(**(self.head_opts if head_opts is None else head_opts))


@register("compose")
class ComposeStrategy(Strategy):
    """A token policy with LazyMAR's condition cache, a head-step schedule and LazyMAR's diffusion-head cache (see
    the module docstring)."""

    name = "compose"
    Config = ComposeConfig

    def __init__(self, **options):
        self.config = self.composition = c = ComposeConfig(**options)   # a named composition keeps its own config
        self.tokens = create(c.tokens, **c.token_options()).token_policy()
        if type(self.tokens).hidden is Strategy.hidden:
            raise ValueError(f"compose tokens={c.tokens!r} does not expose its decoder hidden state; expected a "
                             f"strategy implementing Strategy.hidden, such as 'marche', 'recap' or 'lazymar'")
        self.condition = ConditionCache(c.condition_warmup) if c.condition_cache else None
        config = c.schedule_config()
        self.schedule = HEAD_SCHEDULES[c.head_schedule](config) if config is not None else None
        self.head = HeadCache(HeadCacheConfig(interval=c.head_interval, batch_modulation=c.head_batch_modulation)) \
            if c.head_cache else None

    @classmethod
    def exact_options(cls, num_iter):
        exact = create(ComposeConfig.tokens).exact_options(num_iter)
        return {"token_opts": dict(exact), "head_interval": 1}

    def to_dict(self) -> dict:
        unused = HEAD_SIDE_OPTIONS.get(self.composition.tokens, ())       # the policy's own head, never called
        policy = {k: v for k, v in self.tokens.to_dict().items() if k not in unused}
        out = dict(super().to_dict(), token_strategy=policy)
        if self.schedule is not None:
            out["head_schedule_config"] = self.schedule.to_dict()
        return out

    def num_steps(self, requested):
        return self.tokens.num_steps(requested)

    def begin(self, model, batch_size, num_iter):
        self.tokens.begin(model, batch_size, num_iter)
        if self.schedule is not None:
            self.schedule.bounds(model)                  # a bad schedule fails before the first step
        for part in (self.condition, self.head):
            if part is not None:
                part.reset()

    def is_refresh(self, step):
        return self.tokens.is_refresh(step)

    def hidden(self, model, state, timer):
        if self.condition is None:
            return self.tokens.hidden(model, state, timer)
        return self.condition.hidden(self.tokens, model, state, timer)

    def head_steps(self, model, state):
        """The schedule's head steps (None without one). The token policy's own (``recap``'s shorter head at its
        cheap steps) never apply: compose's head side decides the head."""
        return None if self.schedule is None else self.schedule.head_steps(model, state)

    def head_sample(self, model, z, state, rng):
        clip = None if self.schedule is None else self.schedule.clip_timestep
        if self.head is None:
            return sample_head(model, z, state, rng, clip_timestep=clip)
        return self.head.head_sample(model, z, state, rng, clip_timestep=clip)
