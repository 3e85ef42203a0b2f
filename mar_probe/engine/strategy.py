"""The strategy interface: how one sampling step computes the transformer output and the head's tokens.

A strategy sees the sampler's :class:`~mar_probe.engine.loop.StepState` and decides what to compute and what to
serve from its own cache: per stack (encoder, decoder) and layer which token rows are computed, whether the
unconditional CFG branch is computed or derived, and what the diffusion head recomputes. It records that decision
as a :class:`StepPlan` in ``state.outputs.plan`` and the FLOPs it computed in the sampler's :class:`Timer`, so
observers (the probe) and the cost report see what was really computed. The baseline, :class:`FullStrategy`,
computes everything as the official code does.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..vocab import STACKS  # noqa: F401  (re-exported: engine.strategy.STACKS)
from .cost import attention_flops, block_linear_flops, head_eval_flops, linear_flops, stack_dims

__all__ = ["STACKS", "FullStrategy", "StepPlan", "Strategy", "Timer", "count_blocks", "count_embeddings",
           "sample_head", "stack_blocks"]



@dataclass
class StepPlan:
    """What a strategy computed at one step; stored in ``state.outputs.plan``.

    ``rows[stack]`` lists, per layer, the query rows computed per batch row; ``active[stack]`` is the bool mask
    [B'', N] (True = computed) of the rows computed at the stack's cached layers, over the stack's positions
    (``[buffer; tokens]``), absent when every row was computed. ``computed`` / ``derived`` name the CFG branches
    the transformer computed / derived from a cached residual; ``head`` counts head evaluations by kind.
    ``head_steps`` is the number of respaced diffusion steps the head samples with at this step (None: the head's
    own ``num_sampling_steps``); the sampler sets it from :meth:`Strategy.head_steps`.
    """
    refresh: bool
    rows: dict = field(default_factory=dict)
    active: dict = field(default_factory=dict)
    computed: tuple = ()
    derived: tuple = ()
    head: dict = field(default_factory=dict)
    head_steps: int | None = None


class Strategy:
    """Base class. Subclasses override :meth:`transformer` and/or :meth:`head_sample`.

    Options live in ``self.config``, a frozen keyword-only dataclass (None for option-less strategies).
    """

    name = "base"
    config = None

    def to_dict(self) -> dict:
        """Parameters that identify the strategy (stored in run attrs)."""
        opts = dataclasses.asdict(self.config) if self.config is not None else {}
        return {"name": self.name, **opts}

    @classmethod
    def exact_options(cls, num_iter: int) -> dict:
        """Options under which the strategy recomputes everything at every step of a ``num_iter``-step run
        (its tokens then equal :class:`FullStrategy`'s exactly)."""
        return {}

    def num_steps(self, requested: int) -> int:
        """Decoding steps this strategy runs when ``requested`` are asked for (default: the same)."""
        return requested

    def begin(self, model, batch_size: int, num_iter: int) -> None:
        """Called once before the first step of a batch; reset caches here."""

    def is_refresh(self, step: int) -> bool:
        """Whether ``step`` recomputes every row of every layer (refreshing all caches); True for the full model."""
        return True

    def hidden(self, model, state, timer) -> torch.Tensor:
        """The decoder's last hidden state [B', S+L, D] (before ``decoder_norm``) for the step's branches.

        Strategies that implement it get :meth:`transformer` for free and can be composed (the condition cache of
        the ``compose`` strategy derives the unconditional branch from it). ``state`` may hold the conditional
        branch only (``state.branches == ("cond",)``) on steps that do not refresh.
        """
        raise NotImplementedError(f"strategy {self.name!r} does not expose its decoder hidden state")

    def token_policy(self) -> Strategy:
        """The part of this strategy that decides which rows each layer computes, without its condition or head
        cache: what ``compose`` holds as its token side (the strategy itself unless it is built of parts, as
        ``lazymar`` is)."""
        return self

    def transformer(self, model, state, timer) -> torch.Tensor:
        """Return the decoder output z [B', L, D] for the step's branches (cond first, then uncond)."""
        x = self.hidden(model, state, timer)
        with timer("decoder"):
            return model.decoder_output(x)

    def head_steps(self, model, state) -> int | None:
        """Diffusion steps of the head at this step (None, the default: the head's own ``num_sampling_steps``).

        The sampler asks after :meth:`transformer` and records the answer in the plan's ``head_steps``, which
        :meth:`head_sample` honours."""
        return None

    def head_sample(self, model, z, state, rng) -> torch.Tensor:
        """Sample the step's token latents [M', C] from the selected rows ``z`` [M', D] (all branches)."""
        return sample_head(model, z, state, rng)


def sample_head(model, z, state, rng, clip_timestep: int | None = None) -> torch.Tensor:
    """The head's full sampling of the step's tokens [M', C] from ``z`` [M', D] with the plan's ``head_steps``
    (None: the head's own process; ``clip_timestep`` see :meth:`~mar_probe.models.diffloss.DiffLoss.diffusion_for`);
    counts its FLOPs and evaluations."""
    diff = model.diffloss
    plan = state.outputs.ensure_plan()
    diffusion = diff.diffusion_for(plan.head_steps, clip_timestep=clip_timestep)
    evals = diffusion.num_timesteps
    timer = state.outputs.timer
    if timer is not None:
        timer.add_flops("head.linear", evals * head_eval_flops(diff.net, z.shape[0]))
    plan.head = {"full": evals, "cached": 0}
    return diff.sample(z, state.temperature, state.cfg_iter, generator=rng.noise, init_generator=rng.init_noise,
                       diffusion=diffusion)


class FullStrategy(Strategy):
    """The baseline: full encoder and decoder on every branch at every step (official semantics)."""

    name = "full"

    def transformer(self, model, state, timer):
        b = state.tokens_in.shape[0]
        n_enc = state.enc_positions.shape[1]
        n_dec = model.buffer_size + model.seq_len
        with timer("encoder"):
            x = model.forward_mae_encoder(state.tokens_in, state.mask_in, state.class_embedding)
        with timer("decoder"):
            z = model.forward_mae_decoder(x, state.mask_in)
        count_embeddings(timer, model, b, n_enc)
        for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
            count_blocks(timer, model, stack, b, n, n, layers=len(stack_blocks(model, stack)))
        state.outputs.plan = StepPlan(refresh=True, computed=state.branches, rows={
            "encoder": [n_enc] * len(model.encoder_blocks), "decoder": [n_dec] * len(model.decoder_blocks)})
        return z


def stack_blocks(model, stack: str):
    """The block list of the ``encoder`` or ``decoder`` stack."""
    return model.encoder_blocks if stack == "encoder" else model.decoder_blocks


def count_blocks(timer, model, stack: str, batch: int, n_queries: int, n_keys: int, layers: int = 1,
                 mlp_rows: int | None = None, extra_qk: int = 0) -> None:
    """Add the FLOPs of ``layers`` blocks of ``stack`` where ``n_queries`` rows attend to ``n_keys`` keys.

    ``mlp_rows`` rows run the MLP (default: the query rows); ``extra_qk`` extra query rows of score computation.
    """
    width, hidden = stack_dims(model, stack)
    mlp_rows = n_queries if mlp_rows is None else mlp_rows
    lin = block_linear_flops(n_queries, width, hidden, mlp=False) + block_linear_flops(mlp_rows, width, hidden) \
        - block_linear_flops(mlp_rows, width, hidden, mlp=False)
    att = attention_flops(n_queries, n_keys, width) + attention_flops(extra_qk, n_keys, width) // 2
    timer.add_flops(f"{stack}.linear", layers * batch * lin)
    timer.add_flops(f"{stack}.attention", layers * batch * att)


def count_embeddings(timer, model, batch: int, n_enc: int, z_rows: int | None = None) -> None:
    """FLOPs of ``z_proj`` (over ``z_rows`` token rows, default all) and ``decoder_embed`` (over ``n_enc`` rows)."""
    z_rows = model.seq_len if z_rows is None else z_rows
    timer.add_flops("encoder.linear", batch * linear_flops(z_rows, model.token_embed_dim, model.z_proj.out_features))
    timer.add_flops("decoder.linear", batch * linear_flops(n_enc, model.decoder_embed.in_features,
                                                           model.decoder_embed.out_features))


class Timer:
    """Accumulates wall time per named phase (seconds) and FLOPs per component, in total and per step.

    Synchronises CUDA so times are real. ``totals`` holds seconds per phase over the whole run; ``steps`` one
    record per sampling step: ``{"batch", "step", "seconds": {phase: s}, "flops": {"component.kind": n}}``.
    ``clock`` is wall time; a benchmark on a shared machine may set it to ``time.process_time`` (the CPU seconds
    of this process, meaningful with one torch thread).
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.totals: dict[str, float] = {}
        self.flops: dict[str, int] = {}
        self.steps: list[dict] = []
        self._batch = -1

    def begin_step(self, step: int) -> None:
        """Start the record of a sampling step (step 0 starts a new batch)."""
        if step == 0 or self._batch < 0:
            self._batch += 1
        self.steps.append({"batch": self._batch, "step": step, "seconds": {}, "flops": {}})

    def add_flops(self, key: str, flops: int) -> None:
        """Add FLOPs under ``"component.kind"`` (e.g. ``"decoder.attention"``)."""
        self.flops[key] = self.flops.get(key, 0) + int(flops)
        if self.steps:
            rec = self.steps[-1]["flops"]
            rec[key] = rec.get(key, 0) + int(flops)

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = self.clock()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = self.clock() - t0
            self.totals[name] = self.totals.get(name, 0.0) + dt
            if self.steps:
                rec = self.steps[-1]["seconds"]
                rec[name] = rec.get(name, 0.0) + dt

    def report(self) -> dict:
        """The cost record: per step and in total, seconds per phase and FLOPs per component and kind."""
        steps = [dict(s, seconds_total=sum(s["seconds"].values()), flops_total=sum(s["flops"].values()))
                 for s in self.steps]
        return {"steps": steps, "totals": {"seconds": dict(self.totals), "flops": dict(self.flops),
                                           "seconds_total": sum(self.totals.values()),
                                           "flops_total": sum(self.flops.values())}}
