"""Gaussian diffusion for MAR's per-token diffusion head.

Semantics follow MAR's head (itself from DiT / improved DDPM): a cosine noise schedule over 1000 steps,
epsilon prediction with a learned-range variance, the hybrid MSE + variational-bound training loss, and
timestep respacing for sampling. Written for this project; the schedules are computed in float64 and
gathered to float32, as in the reference.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch


def cosine_betas(num_steps: int = 1000, max_beta: float = 0.999) -> np.ndarray:
    """Betas of the squared-cosine alpha-bar schedule (s = 0.008)."""
    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return np.array([min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta)
                     for i in range(num_steps)], dtype=np.float64)


def parse_spacing(spacing: str | int) -> list[int]:
    """The per-section step counts of a respacing (``"100"`` -> [100], ``"25,25"`` -> [25, 25]), with a clear error."""
    text = str(spacing).strip()
    if not re.fullmatch(r"[0-9]+(,[0-9]+)*", text):
        raise ValueError(f"head steps must be a count such as '100' or per-section counts such as '25,25', "
                         f"got {spacing!r}")
    return [int(x) for x in text.split(",")]


def space_timesteps(num_timesteps: int, spacing: str | int) -> list[int]:
    """Timesteps kept by a respacing such as ``"100"`` or ``"25,25"`` (evenly strided per section)."""
    counts = parse_spacing(spacing)
    size_per, extra = divmod(num_timesteps, len(counts))
    kept, start = [], 0
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if count < 1 or size < count:
            raise ValueError(f"cannot divide a section of {size} diffusion steps into {count!r}")
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        kept += [start + round(stride * j) for j in range(count)]
        start += size
    return sorted(set(kept))




class GaussianDiffusion:
    """A (possibly respaced) diffusion process with learned-range variance and epsilon prediction.

    ``clip_timestep`` (default None: none) clamps the kept timesteps to at most that timestep before the process is
    built, merging those above it into one (the DiSA code's sampler does this at 950, see
    :mod:`mar_probe.strategies.disa`); without it the process is the official respacing.
    """

    def __init__(self, spacing: str | int = "", num_timesteps: int = 1000, clip_timestep: int | None = None):
        base = cosine_betas(num_timesteps)
        use = space_timesteps(num_timesteps, spacing) if str(spacing) else list(range(num_timesteps))
        if clip_timestep is not None:
            use = sorted({min(t, clip_timestep) for t in use})
        base_bar = np.cumprod(1.0 - base)
        last, betas = 1.0, []
        for i in use:
            betas.append(1 - base_bar[i] / last)
            last = base_bar[i]
        self.timestep_map = np.array(use, dtype=np.int64)
        self._tables: dict = {}  # (id of a schedule array, device) -> the array as a float64 tensor
        self._set_betas(np.array(betas, dtype=np.float64))

    def _set_betas(self, betas: np.ndarray) -> None:
        self.betas = betas
        self.num_timesteps = len(betas)
        ab = np.cumprod(1.0 - betas)
        ab_prev = np.append(1.0, ab[:-1])
        self.alphas_cumprod = ab
        self.sqrt_alphas_cumprod = np.sqrt(ab)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - ab)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / ab)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / ab - 1)
        post_var = betas * (1.0 - ab_prev) / (1.0 - ab)
        self.posterior_log_variance_clipped = (np.log(np.append(post_var[1], post_var[1:]))
                                               if len(post_var) > 1 else np.array([]))
        self.log_betas = np.log(betas)
        self.posterior_mean_coef1 = betas * np.sqrt(ab_prev) / (1.0 - ab)
        self.posterior_mean_coef2 = (1.0 - ab_prev) * np.sqrt(1.0 - betas) / (1.0 - ab)

    def _gather(self, arr: np.ndarray, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """arr[t] as float32 [N, 1, ...]: gathered in float64, then cast, as the reference does.

        The tensor form of each schedule array is made once per device and kept on this instance
        (the arrays are its own attributes, so their ids are stable for its lifetime).
        """
        key = (id(arr), t.device)
        if key not in self._tables:
            self._tables[key] = torch.from_numpy(arr).to(t.device)
        out = self._tables[key][t].float()
        return out.reshape(out.shape + (1,) * (ndim - 1))

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """Map respaced indices to the original timesteps the network was trained on."""
        return torch.from_numpy(self.timestep_map).to(t.device)[t]

    def q_sample(self, x0, t, noise):
        return (self._gather(self.sqrt_alphas_cumprod, t, x0.ndim) * x0
                + self._gather(self.sqrt_one_minus_alphas_cumprod, t, x0.ndim) * noise)

    def q_posterior(self, x0, xt, t):
        mean = (self._gather(self.posterior_mean_coef1, t, xt.ndim) * x0
                + self._gather(self.posterior_mean_coef2, t, xt.ndim) * xt)
        return mean, self._gather(self.posterior_log_variance_clipped, t, xt.ndim)

    def p_mean_variance(self, model_output, x, t, clip_denoised: bool = False):
        """Mean, log-variance and x0 prediction of p(x_{t-1} | x_t) from the network's [N, 2C] output."""
        c = x.shape[1]
        eps, var_values = model_output[:, :c], model_output[:, c:]
        min_log = self._gather(self.posterior_log_variance_clipped, t, x.ndim)
        max_log = self._gather(self.log_betas, t, x.ndim)
        frac = (var_values + 1) / 2
        log_var = frac * max_log + (1 - frac) * min_log
        x0 = (self._gather(self.sqrt_recip_alphas_cumprod, t, x.ndim) * x
              - self._gather(self.sqrt_recipm1_alphas_cumprod, t, x.ndim) * eps)
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
        mean, _ = self.q_posterior(x0, x, t)
        return mean, log_var, x0

    def p_sample(self, model_output, x, t, noise, temperature: float = 1.0, clip_denoised: bool = False):
        """One reverse step; ``noise`` is drawn by the caller (so that its RNG order is explicit)."""
        mean, log_var, _ = self.p_mean_variance(model_output, x, t, clip_denoised)
        nonzero = (t != 0).float().reshape(-1, *([1] * (x.ndim - 1)))
        return mean + nonzero * torch.exp(0.5 * log_var) * noise * temperature

    def training_losses(self, net, x0, t, cond, noise=None):
        """Per-sample hybrid loss: epsilon MSE + variational bound for the variance (mean detached)."""
        noise = torch.randn_like(x0) if noise is None else noise
        xt = self.q_sample(x0, t, noise)
        out = net(xt, self.model_timesteps(t), cond)
        c = x0.shape[1]
        eps = out[:, :c]
        frozen = torch.cat([eps.detach(), out[:, c:]], dim=1)
        vb = self._vb_bits(frozen, x0, xt, t)
        mse = ((noise - eps) ** 2).mean(dim=1)
        return mse + vb

    def _vb_bits(self, model_output, x0, xt, t):
        true_mean, true_log_var = self.q_posterior(x0, xt, t)
        mean, log_var, _ = self.p_mean_variance(model_output, xt, t)
        kl = 0.5 * (-1.0 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                    + (true_mean - mean) ** 2 * torch.exp(-log_var))
        kl = kl.mean(dim=1) / math.log(2.0)
        nll = -_discretized_gaussian_loglik(x0, mean, 0.5 * log_var).mean(dim=1) / math.log(2.0)
        return torch.where(t == 0, nll, kl)


def _approx_std_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _discretized_gaussian_loglik(x, mean, log_scale):
    centered = x - mean
    inv_std = torch.exp(-log_scale)
    cdf_plus = _approx_std_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_std_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))
