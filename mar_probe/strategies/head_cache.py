"""LazyMAR's diffusion-head cache as a part that any strategy delegates ``head_sample`` to (issue 18, item 4).

Within each step's diffusion sampling the network runs in full (both CFG halves) at reverse index ``i == T-1`` and
``i % interval == 0``, storing each residual block's MLP output, the increments of blocks ``delta_blocks`` and
``cond_eps - uncond_eps``; in between only the conditional half runs: delta blocks add their cached increment,
other blocks reuse the cached MLP output with a fresh AdaLN gate (recomputing it while ``i > warm_fraction * T``),
and ``uncond_eps = cond_eps - cached difference`` (the released LazyMAR code's ``CachedDiffLoss``; constants and
their sources in :mod:`mar_probe.strategies.lazymar`). ``batch_modulation`` makes the AdaLN modulations of a
step's evaluations in one batched product per layer (not in the released code). ``lazymar`` and ``compose`` both
hold one :class:`HeadCache`.

The reverse process is the step's plan's: with ``StepPlan.head_steps`` set (a head-step schedule, e.g. ``compose
head_schedule=disa``) the head samples with that many respaced steps (and the schedule's ``clip_timestep``), ``T``
above is that process's number of steps and the recompute rule applies over its reverse indices. Without it (None)
the process is the head's own, exactly as before the schedule existed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._config import check_ints
from ..engine.cost import head_embed_flops, head_eval_flops
from ..models.diffloss import modulate


@dataclass(frozen=True, kw_only=True)
class HeadCacheConfig:
    """The head cache's options; the defaults are the released LazyMAR code's (``lazymar``'s ``head_*`` options)."""
    interval: int = 7
    warm_fraction: float = 0.9
    delta_blocks: tuple[int, ...] = (1, 2, 3, 4)
    batch_modulation: bool = False

    def __post_init__(self):
        check_ints("head cache", self, (("interval", 1),))
        if not 0.0 <= self.warm_fraction <= 1.0:
            raise ValueError(f"head cache warm_fraction must be in [0, 1], got {self.warm_fraction!r}")
        if any(not isinstance(j, int) or j < 0 for j in self.delta_blocks):
            raise ValueError(f"head cache delta_blocks must be block indices >= 0, got {self.delta_blocks!r}")


class HeadCache:
    """The diffusion-head cache of one strategy: ``head_sample`` replaces :meth:`Strategy.head_sample`."""

    def __init__(self, config: HeadCacheConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget the timestep-embedding tables (call at the start of a batch)."""
        self._tables: dict = {}

    def head_sample(self, model, z, state, rng, clip_timestep: int | None = None) -> torch.Tensor:
        """The step's token latents [M', C] from ``z`` [M', D], with the cache, over the reverse process of the plan's
        ``head_steps`` (None: the head's own; ``clip_timestep`` see
        :meth:`~mar_probe.models.diffloss.DiffLoss.diffusion_for`); counts FLOPs and head evaluations."""
        diff = model.diffloss
        timer = state.outputs.timer
        plan = state.outputs.ensure_plan()
        diffusion = diff.diffusion_for(plan.head_steps, clip_timestep=clip_timestep)
        head = _StepCache(self.config, diff.net, diffusion.num_timesteps,
                          lambda: self._time_table(diff, z.device, timer, diffusion))
        out = diff.sample(z, state.temperature, state.cfg_iter, generator=rng.noise, init_generator=rng.init_noise,
                          denoise_fn=head.denoise, diffusion=diffusion)
        if timer is not None:
            timer.add_flops("head.linear", head.flops)
        plan.head = {"full": head.full, "cached": head.cached}
        return out

    def _time_table(self, diff, device, timer, diffusion=None) -> torch.Tensor:
        """Timestep embeddings [T, W] of every reverse index of ``diffusion`` (default: the head's own process), made
        once per batch, head and process (cached evaluations read them instead of running ``time_embed``; its FLOPs
        are counted when the table is made)."""
        diffusion = diff.gen_diffusion if diffusion is None else diffusion
        net, T = diff.net, diffusion.num_timesteps
        key = (net, id(diffusion), device)              # the entry holds the process: its id stays its own
        entry = self._tables.get(key)
        if entry is None:
            t = diffusion.model_timesteps(torch.arange(T, device=device))
            entry = self._tables[key] = (diffusion, net.time_embed(t))
            if timer is not None:
                timer.add_flops("head.linear", head_embed_flops(net, T, cond=False))
        return entry[1]


class _StepCache:
    """One step's diffusion-head cache (the released ``CachedDiffLoss`` logic); ``denoise`` is the net call.

    Beyond the released code (overheads only; recompute calls stay op for op the released ones): cached calls
    reuse ``cond_embed(z)`` of the last recompute call (z is the same at every reverse index of a step) and take
    the timestep embedding from ``time_table()`` [T, W] instead of running both embeddings on every call.
    """

    def __init__(self, config: HeadCacheConfig, net, num_timesteps: int, time_table):
        self.c, self.net, self.T = config, net, num_timesteps
        self.time_table = time_table                        # callable -> [T, W]
        self.cond = None                                    # cond_embed(z) [N, W] at the last recompute call
        self.mlp: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}
        self.cfg_delta = None
        self.full = self.cached = self.flops = 0
        self.tables: dict = {True: {}, False: {}}           # recompute? -> layer key -> [T', n, kW] (batched)
        self.slot = {full: {i: k for k, i in enumerate(i for i in range(num_timesteps) if self.recompute(i) == full)}
                     for full in (True, False)}

    def recompute(self, i: int) -> bool:
        return i == self.T - 1 or i % self.c.interval == 0

    def denoise(self, x, t, z, cfg, i):
        """Network output [N, 2C] for noisy x [N, C] at reverse index ``i`` (CFG halves when ``cfg`` is set)."""
        c = self.net.in_channels
        if cfg is None:
            return self.forward(x, t, z, i)
        n = x.shape[0] // 2
        half = x[:n]
        if self.recompute(i):
            out = self.forward(torch.cat([half, half], dim=0), t, z, i)
            eps, rest = out[:, :c], out[:, c:]
            cond, uncond = torch.split(eps, len(eps) // 2, dim=0)
            self.cfg_delta = cond - uncond
            half_eps = uncond + cfg * (cond - uncond)
            return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)
        out = self.forward(half, t[:n], z[:n], i)
        cond, rest = out[:, :c], out[:, c:]
        uncond = cond - self.cfg_delta
        half_eps = uncond + cfg * (cond - uncond)
        return torch.cat([torch.cat([half_eps, half_eps], dim=0), torch.cat([rest, rest], dim=0)], dim=1)

    def forward(self, x, t, c, i):
        """``SimpleMLPAdaLN.forward`` with MLP reuse (op for op the same on recompute indices) for x [n, C]."""
        net, full = self.net, self.recompute(i)
        warm = full or i > self.c.warm_fraction * self.T
        x = net.input_proj(x)
        n, ada, mlp = x.shape[0], 0, 0
        y, embeds = self._embedding(t, c, i, n, full)
        for j, block in enumerate(net.res_blocks):
            if not full and j in self.c.delta_blocks:
                x = x + _fit(self.delta[j], n)
                continue
            shift, scale, gate = self.modulation(j, block.adaLN_modulation, y, i, full, n).chunk(3, dim=-1)
            ada += 1
            if warm:
                m = self.mlp[j] = block.mlp(modulate(block.in_ln(x), shift, scale))
                mlp += 1
            else:
                m = _fit(self.mlp[j], n)
            x_new = x + gate * m
            if full and j in self.c.delta_blocks:
                self.delta[j] = x_new - x
            x = x_new
        self.full, self.cached = self.full + full, self.cached + (not full)
        self.flops += head_eval_flops(net, n, mlp_blocks=mlp, ada_blocks=ada, time_embed=embeds[0],
                                      cond_embed=embeds[1])
        if not self.c.batch_modulation:
            return net.final_layer(x, y)
        final = net.final_layer
        shift, scale = self.modulation("final", final.adaLN_modulation, y, i, full, n).chunk(2, dim=-1)
        return final.linear(modulate(final.norm_final(x), shift, scale))

    def _embedding(self, t, c, i: int, n: int, full: bool):
        """(y [n, W] or None, (time_embed ran, cond_embed ran)) of one evaluation.

        Released behaviour: recompute evaluations embed t and z, cached ones add the time table's row to the last
        ``cond_embed(z)``. With ``batch_modulation`` the modulation tables hold every index's time embedding,
        so no evaluation needs y, and ``cond_embed(z)`` runs once per step (z is the same at every index)."""
        batched = self.c.batch_modulation
        embed_cond = full and not (batched and self.cond is not None)
        if embed_cond:
            self.cond = self.net.cond_embed(c)                                     # [n, W]
        if batched:
            return None, (False, embed_cond)
        if full:
            return self.net.time_embed(t) + self.cond, (True, True)
        return self.time_table()[i] + self.cond[:n], (False, False)              # [W] + [n, W]

    def modulation(self, key, layer, y, i: int, full: bool, n: int) -> torch.Tensor:
        """AdaLN modulation ``layer(y)`` [n, kW] at reverse index ``i``; with ``batch_modulation`` read from
        a table made at the step's first evaluation of its kind (recompute or cached) for every index of it."""
        if not self.c.batch_modulation:
            return layer(y)
        table = self.tables[full].get(key)
        if table is None:
            idx = torch.tensor(list(self.slot[full]), device=self.cond.device)
            ys = self.time_table()[idx][:, None, :] + self.cond[None, :n]              # [T', n, W]
            table = self.tables[full][key] = layer(ys)                                 # [T', n, kW]
        return table[self.slot[full][i]]


def _fit(cached: torch.Tensor, n: int) -> torch.Tensor:
    """A cached [M, W] tensor fitted to n rows as the released code does (first rows, or repeated)."""
    if n < cached.shape[0]:
        return cached[:n]
    return torch.cat([cached, cached]) if n > cached.shape[0] else cached
