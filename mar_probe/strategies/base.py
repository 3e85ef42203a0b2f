"""The strategy interface: how one sampling step computes the transformer output and the head's tokens.

A strategy sees the sampler's :class:`~mar_probe.sampler.StepState` and decides what to compute and what to
serve from its own cache. The baseline, :class:`FullStrategy`, computes everything as the official code does.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class Strategy:
    """Base class. Subclasses override :meth:`transformer` and/or :meth:`head_sample`."""

    name = "base"

    def to_dict(self) -> dict:
        """Parameters that identify the strategy (stored in run attrs)."""
        return {"name": self.name}

    def begin(self, model, batch_size: int, num_iter: int) -> None:
        """Called once before the first step of a batch; reset caches here."""

    def transformer(self, model, state, timer) -> torch.Tensor:
        """Return the decoder output z [B', L, D] for the step's branches (cond first, then uncond)."""
        raise NotImplementedError

    def head_sample(self, model, z, state, rng) -> torch.Tensor:
        """Sample the step's token latents [M', C] from the selected rows ``z`` [M', D] (all branches)."""
        return model.diffloss.sample(z, state.temperature, state.cfg_iter, generator=rng.noise,
                                     init_generator=rng.init_noise)


class FullStrategy(Strategy):
    """The baseline: full encoder and decoder on every branch at every step (official semantics)."""

    name = "full"

    def transformer(self, model, state, timer):
        with timer("encoder"):
            x = model.forward_mae_encoder(state.tokens_in, state.mask_in, state.class_embedding)
        with timer("decoder"):
            return model.forward_mae_decoder(x, state.mask_in)


class Timer:
    """Accumulates wall time per named phase (seconds); synchronises CUDA so times are real."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
