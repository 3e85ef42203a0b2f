"""The identity tokenizer: images <-> continuous tokens made of pixel patches (no VAE)."""
from __future__ import annotations

import numpy as np
import torch


class PixelTokenizer:
    """Pads ``crop_size`` images to ``img_size``, scales to [-1, 1] and packs ``stride`` x ``stride`` patches
    as channels: uint8 [N, H, W(, C)] <-> latents [N, C*s*s, H/s, W/s]."""

    def __init__(self, img_size: int, stride: int, channels: int = 1, crop_size: int = 0):
        self.img_size, self.stride, self.channels = img_size, stride, channels
        self.crop_size = crop_size or img_size
        self.pad = (img_size - self.crop_size) // 2

    def encode(self, images) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(images)).float() / 127.5 - 1.0
        if x.ndim == 3:
            x = x.unsqueeze(-1)
        x = x.permute(0, 3, 1, 2)  # [N, C, h, w]
        if x.shape[-1] != self.crop_size or x.shape[1] != self.channels:
            raise ValueError(f"expected images of {self.crop_size}x{self.crop_size} with {self.channels} channel(s), "
                             f"got shape {tuple(images.shape)!r}")
        x = torch.nn.functional.pad(x, (self.pad,) * 4, value=-1.0)  # [N, C, H, W]
        return torch.nn.functional.pixel_unshuffle(x, self.stride)  # [N, C*s*s, H/s, W/s]

    def decode_float(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [N, C*s*s, h, w] -> float images in [-1, 1], [N, C, crop, crop]."""
        x = torch.nn.functional.pixel_shuffle(latents.float(), self.stride)
        p = self.pad
        return x[..., p:p + self.crop_size, p:p + self.crop_size]

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents -> uint8 images [N, H, W, C]."""
        x = self.decode_float(latents).clamp(-1, 1)
        return ((x + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
