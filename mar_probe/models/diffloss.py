"""MAR's diffusion head: a small AdaLN MLP denoiser per token, conditioned on the transformer output z.

Module and parameter names equal the official ``DiffLoss`` / ``SimpleMLPAdaLN`` so that official state
dicts load with ``strict=True``. Sampling takes an explicit ``torch.Generator`` and draws noise in the
reference order (initial noise once, then one draw per reverse step of the full batch).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .diffusion import GaussianDiffusion


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def rng_device(generator: torch.Generator | None, device) -> torch.device:
    """Where a draw from ``generator`` must be made: on the generator's own device (a CPU generator cannot draw on a
    GPU), else on ``device``. Training keeps its generator on the CPU whatever its device, so a run's random stream
    (orders, label drops, timesteps, noise) is the same on every device; on the CPU nothing moves."""
    return generator.device if generator is not None else torch.device(device)


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features followed by a two-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class ResBlock(nn.Module):
    """Residual MLP block with AdaLN shift/scale/gate from the condition."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x, y):
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, model_channels: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(model_channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(model_channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 2 * model_channels))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """The denoising MLP: input projection, ``num_res_blocks`` AdaLN residual blocks, final layer."""

    def __init__(self, in_channels, model_channels, out_channels, z_channels, num_res_blocks):
        super().__init__()
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.out_channels = out_channels
        self.num_res_blocks = num_res_blocks
        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList([ResBlock(model_channels) for _ in range(num_res_blocks)])
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for block in self.res_blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for p in (self.final_layer.adaLN_modulation[-1].weight, self.final_layer.adaLN_modulation[-1].bias,
                  self.final_layer.linear.weight, self.final_layer.linear.bias):
            nn.init.zeros_(p)

    def forward(self, x, t, c):
        """x [N, C] noisy tokens, t [N] timesteps, c [N, Dz] conditions -> [N, 2C] (eps, variance)."""
        x = self.input_proj(x)
        y = self.time_embed(t) + self.cond_embed(c)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)

    def forward_with_cfg(self, x, t, c, cfg_scale):
        """CFG inside the head: first half conditional, second half unconditional, shared noisy input."""
        half = x[: len(x) // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, c)
        eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)


class DiffLoss(nn.Module):
    """Diffusion loss and sampler for continuous tokens."""

    def __init__(self, target_channels, z_channels, depth, width, num_sampling_steps="100",
                 clip_denoised: bool = False):
        super().__init__()
        self.in_channels = target_channels
        self.clip_denoised = clip_denoised
        self.net = SimpleMLPAdaLN(target_channels, width, target_channels * 2, z_channels, depth)
        self.train_diffusion = GaussianDiffusion("")
        self._spaced: dict = {}                               # (spacing, clip) -> GaussianDiffusion, diffusion_for's
        self.set_sampling_steps(num_sampling_steps)

    def set_sampling_steps(self, num_sampling_steps) -> None:
        self.num_sampling_steps = str(num_sampling_steps)
        self.gen_diffusion = GaussianDiffusion(self.num_sampling_steps)

    def diffusion_for(self, steps: int | None = None, clip_timestep: int | None = None) -> GaussianDiffusion:
        """The reverse process of ``steps`` evenly respaced steps, as the official head with ``num_sampling_steps=
        str(steps)`` samples (a strategy's per-step head steps, e.g. ``disa``).

        None, or the head's own step count, is the head's own process (``gen_diffusion`` itself, so a sectioned
        respacing such as ``"25,25"`` stays itself); ``clip_timestep`` clamps the kept timesteps (see
        :class:`GaussianDiffusion`). Other processes are made once and kept on this head.
        """
        own = self.gen_diffusion
        if steps is not None:
            limit = self.train_diffusion.num_timesteps
            if not isinstance(steps, int) or isinstance(steps, bool) or not 2 <= steps <= limit:
                raise ValueError(f"head steps {steps!r} are outside the head's steps: a respacing of its "
                                 f"{limit}-step diffusion takes 2 to {limit} steps (one step has no posterior "
                                 f"variance: the official code cannot sample with one either)")
        spacing = self.num_sampling_steps if steps is None or steps == own.num_timesteps else str(steps)
        if spacing == self.num_sampling_steps and clip_timestep is None:
            return own
        key = (spacing, clip_timestep)
        if key not in self._spaced:
            self._spaced[key] = GaussianDiffusion(spacing, clip_timestep=clip_timestep)
        return self._spaced[key]

    def forward(self, target, z, mask=None, generator: torch.Generator | None = None):
        """Training loss; timesteps and noise come from ``generator`` (default: torch's global one)."""
        rng = rng_device(generator, target.device)  # a CPU generator draws on the CPU also for a GPU run
        t = torch.randint(0, self.train_diffusion.num_timesteps, (target.shape[0],), device=rng,
                          generator=generator).to(target.device)
        noise = torch.randn(target.shape, device=rng, generator=generator).to(target.device)
        loss = self.train_diffusion.training_losses(self.net, target, t, z, noise=noise)
        if mask is not None:
            loss = (loss * mask).sum() / mask.sum()
        return loss.mean()

    def sample(self, z, temperature=1.0, cfg=1.0, generator: torch.Generator | None = None,
               init_generator: torch.Generator | None = None, denoise_fn=None,
               diffusion: GaussianDiffusion | None = None):
        """Sample one token per row of ``z`` [N, Dz]; with CFG rows are [cond; uncond] halves.

        The initial noise comes from ``init_generator`` (default: ``generator``), created on the CPU when
        that generator is a CPU one, and each reverse step draws from ``generator`` on ``z``'s device — the
        reference's order. ``denoise_fn(x, t, c, cfg, i)`` replaces the network call (head caches);
        ``diffusion`` the reverse process (default: ``gen_diffusion``; see :meth:`diffusion_for`).
        """
        use_cfg = not cfg == 1.0
        n = z.shape[0] // 2 if use_cfg else z.shape[0]
        init_generator = generator if init_generator is None else init_generator
        init_device = init_generator.device if init_generator is not None else z.device
        noise = torch.randn(n, self.in_channels, generator=init_generator, device=init_device).to(z.device)
        x = torch.cat([noise, noise], dim=0) if use_cfg else noise
        diff = self.gen_diffusion if diffusion is None else diffusion
        for i in reversed(range(diff.num_timesteps)):
            t = torch.full((x.shape[0],), i, dtype=torch.long, device=z.device)
            tm = diff.model_timesteps(t)
            if denoise_fn is not None:
                out = denoise_fn(x, tm, z, cfg if use_cfg else None, i)
            elif use_cfg:
                out = self.net.forward_with_cfg(x, tm, z, cfg)
            else:
                out = self.net(x, tm, z)
            step_noise = torch.randn(x.shape, generator=generator, device=z.device)
            x = diff.p_sample(out, x, t, step_noise, temperature, self.clip_denoised)
        return x
