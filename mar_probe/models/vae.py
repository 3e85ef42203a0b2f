"""The KL-16 VAE that MAR uses as its tokenizer (LDM ``AutoencoderKL``, 256 px images <-> 16x16x16 latents).

Module and parameter names equal the official ``models/vae.py`` of LTH14/mar so that the released ``kl16.ckpt``
loads with ``strict=True``. MAR works on latents scaled by :data:`MAR_LATENT_SCALE`; :class:`KL16Decoder`
undoes that scale and returns uint8 images the way the official evaluation saves them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .._io import load_weights

MAR_LATENT_SCALE = 0.2325  # MAR multiplies VAE latents by this to give them unit std
KL16_SOURCE = "the kl16.ckpt released with MAR (LTH14/mar README)"


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


def _conv3(c_in: int, c_out: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding)


class ResnetBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, plus a 1x1 ``nin_shortcut`` where the channel count changes."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in), _conv3(c_in, c_out)
        self.norm2, self.conv2 = _norm(c_out), _conv3(c_out, c_out)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, kernel_size=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels, with 1x1-conv projections."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, kernel_size=1) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (p(y).reshape(b, c, h * w).transpose(1, 2) for p in (self.q, self.k, self.v))  # [B, HW, C]
        o = F.scaled_dot_product_attention(q, k, v)  # [B, HW, C]
        return x + self.proj_out(o.transpose(1, 2).reshape(b, c, h, w))  # [B, C, H, W]


class Downsample(nn.Module):
    """Stride-2 3x3 conv after zero-padding one pixel on the right and bottom."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _conv3(channels, channels, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2 followed by a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _conv3(channels, channels)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(blocks, attns, resample=None) -> nn.Module:
    """One resolution level: ``block`` and ``attn`` lists and an optional ``downsample``/``upsample``."""
    level = nn.Module()
    level.block, level.attn = nn.ModuleList(blocks), nn.ModuleList(attns)
    if resample is not None:
        setattr(level, "downsample" if isinstance(resample, Downsample) else "upsample", resample)
    return level


def _middle(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1 = ResnetBlock(channels, channels), AttnBlock(channels)
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


def _run_level(level: nn.Module, h):
    for i, block in enumerate(level.block):
        h = block(h)
        if len(level.attn) > 0:
            h = level.attn[i](h)
    return h


@dataclass(frozen=True, kw_only=True)
class VAEConfig:
    """Architecture of the KL VAE; the defaults are MAR's KL-16 (``AutoencoderKL(16, (1, 1, 2, 2, 4))``)."""
    embed_dim: int = 16
    ch_mult: tuple = (1, 1, 2, 2, 4)
    ch: int = 128
    num_res_blocks: int = 2
    resolution: int = 256
    in_channels: int = 3
    out_ch: int = 3
    enc_attn_resolutions: tuple = (16,)  # the official Encoder default
    dec_attn_resolutions: tuple = ()     # the official Decoder default
    use_variational: bool = True


class Encoder(nn.Module):
    """Image [B, 3, R, R] -> moments [B, 2*z, R/2^(L-1), R/2^(L-1)]."""

    def __init__(self, c: VAEConfig):
        super().__init__()
        widths = [c.ch * m for m in c.ch_mult]
        self.conv_in = _conv3(c.in_channels, c.ch)
        self.down = nn.ModuleList()
        c_in = c.ch
        for i, w in enumerate(widths):
            use_attn = (c.resolution >> i) in c.enc_attn_resolutions
            blocks = [ResnetBlock(c_in if j == 0 else w, w) for j in range(c.num_res_blocks)]
            attns = [AttnBlock(w) for _ in range(c.num_res_blocks)] if use_attn else []
            self.down.append(_level(blocks, attns, Downsample(w) if i < len(widths) - 1 else None))
            c_in = w
        self.mid = _middle(c_in)
        self.norm_out = _norm(c_in)
        self.conv_out = _conv3(c_in, 2 * c.embed_dim)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent [B, z, r, r] -> image [B, 3, r*2^(L-1), r*2^(L-1)]; ``up[0]`` is the finest level."""

    def __init__(self, c: VAEConfig):
        super().__init__()
        widths = [c.ch * m for m in c.ch_mult]
        self.conv_in = _conv3(c.embed_dim, widths[-1])
        self.mid = _middle(widths[-1])
        self.up = nn.ModuleList()
        for i, w in enumerate(widths):
            c_in = widths[min(i + 1, len(widths) - 1)]
            use_attn = (c.resolution >> i) in c.dec_attn_resolutions
            blocks = [ResnetBlock(c_in if j == 0 else w, w) for j in range(c.num_res_blocks + 1)]
            attns = [AttnBlock(w) for _ in range(c.num_res_blocks + 1)] if use_attn else []
            self.up.append(_level(blocks, attns, Upsample(w) if i > 0 else None))
        self.norm_out = _norm(widths[0])
        self.conv_out = _conv3(widths[0], c.out_ch)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(self.up):
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class DiagonalGaussian:
    """Posterior N(mean, exp(logvar)) from moments [B, 2*z, h, w]; ``parameters`` keeps the raw moments."""

    def __init__(self, parameters: torch.Tensor, deterministic: bool = False):
        self.parameters, self.deterministic = parameters, deterministic
        self.mean, logvar = torch.chunk(parameters, 2, dim=1)  # [B, z, h, w] each
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std, self.var = torch.exp(0.5 * self.logvar), torch.exp(self.logvar)
        if deterministic:
            self.std = self.var = torch.zeros_like(self.mean)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """mean + std * eps; eps is drawn on the generator's device (CPU without one, as the official code)."""
        device = generator.device if generator is not None else torch.device("cpu")
        eps = torch.randn(self.mean.shape, generator=generator, device=device).to(self.mean.device)
        return self.mean + self.std * eps

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL to N(0, I), summed over [C, H, W] -> [B]."""
        if self.deterministic:
            return torch.zeros(self.mean.shape[0], device=self.mean.device)
        return 0.5 * torch.sum(self.mean.pow(2) + self.var - 1.0 - self.logvar, dim=[1, 2, 3])


class AutoencoderKL(nn.Module):
    """KL-regularised autoencoder: ``encode`` -> :class:`DiagonalGaussian`, ``decode`` -> images in about [-1, 1]."""

    def __init__(self, config: VAEConfig | None = None):
        super().__init__()
        c = self.config = config or VAEConfig()
        self.embed_dim, self.use_variational = c.embed_dim, c.use_variational
        self.encoder = Encoder(c)
        self.decoder = Decoder(c)
        self.quant_conv = nn.Conv2d(2 * c.embed_dim, (2 if c.use_variational else 1) * c.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(c.embed_dim, c.embed_dim, 1)

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Images [B, 3, H, W] in [-1, 1] -> posterior over latents [B, z, H/16, W/16]."""
        moments = self.quant_conv(self.encoder(x))
        if not self.use_variational:
            moments = torch.cat((moments, torch.ones_like(moments)), dim=1)  # [B, 2*z, h, w]
        return DiagonalGaussian(moments)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents [B, z, h, w] -> images [B, 3, 16h, 16w] (not clamped)."""
        return self.decoder(self.post_quant_conv(z))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction through the posterior mode."""
        return self.decode(self.encode(x).mode())


def _check_state_dict(model: nn.Module, sd: dict, path) -> None:
    """Raise ValueError naming missing/unexpected keys and shape conflicts between ``sd`` and ``model``."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"{name} ({len(keys)}): {keys[:5]}" for name, keys in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape conflicts", shapes)) if keys]
        raise ValueError(f"{path} does not match the KL-16 VAE: " + "; ".join(parts))


class VAEFileError(ValueError):
    """A VAE checkpoint cannot be read, is refused, or holds no VAE weights."""


def load_vae(path, device="cpu", config: VAEConfig | None = None) -> AutoencoderKL:
    """Load a KL VAE from a local checkpoint (``{"model": state_dict}`` or a bare state dict), frozen in eval mode."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"VAE checkpoint not found: {path}; download {KL16_SOURCE} and pass its path")
    ckpt = load_weights(path, what="VAE checkpoint", error=VAEFileError)
    sd = ckpt["model"] if isinstance(ckpt, dict) and "model" in ckpt else ckpt
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise VAEFileError(f"VAE checkpoint {str(path)!r} holds no state dict of tensors; expected kl16.ckpt "
                           f"({KL16_SOURCE}) or a dict with its 'model' state dict")
    # LDM training checkpoints may carry the discriminator/LPIPS loss under "loss."; the official loader
    # skips them (strict=False), we drop exactly those and stay strict about everything else.
    sd = {k: v for k, v in sd.items() if not k.startswith("loss.")}
    vae = AutoencoderKL(config)
    _check_state_dict(vae, sd, path)
    vae.load_state_dict(sd, strict=True)
    return vae.to(device).eval().requires_grad_(False)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Images [B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3] (RGB), converted as MAR's ``evaluate`` saves them."""
    x = (images.detach().float().cpu().clamp(-1, 1) + 1) / 2
    x = x.numpy().transpose(0, 2, 3, 1)  # [B, H, W, C]
    return np.round(np.clip(x * 255, 0, 255)).astype(np.uint8)


class KL16Decoder:
    """Turns MAR tokens (scaled KL-16 latents [B, 16, 16, 16]) into images."""

    def __init__(self, vae: AutoencoderKL, scale: float = MAR_LATENT_SCALE):
        self.vae, self.scale = vae, scale

    @classmethod
    def from_checkpoint(cls, path, device="cpu") -> KL16Decoder:
        return cls(load_vae(path, device))

    @torch.no_grad()
    def decode_float(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, 16, h, w] -> float images in [-1, 1], [B, 3, 16h, 16w]."""
        p = next(self.vae.parameters())
        return self.vae.decode(tokens.to(p.device, p.dtype) / self.scale).clamp(-1, 1)

    def decode_tokens(self, tokens: torch.Tensor) -> np.ndarray:
        """Tokens [B, 16, h, w] -> uint8 images [B, 16h, 16w, 3]."""
        return to_uint8(self.decode_float(tokens))

    decode = decode_tokens  # same call as PixelTokenizer.decode
