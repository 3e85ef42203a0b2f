"""Model configuration: a frozen keyword-only dataclass that travels inside checkpoints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .._config import checked_fields
from ..vocab import STACKS

TOKENIZERS = ("kl16", "pixel")


@dataclass(frozen=True, kw_only=True)
class MARConfig:
    """Every constructor argument of MAR, plus the tokenizer that turns tokens into images.

    Field names follow the official ``MAR.__init__`` keywords.
    """
    name: str = "custom"
    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    vae_embed_dim: int = 16
    mask_ratio_min: float = 0.7
    label_drop_prob: float = 0.1
    class_num: int = 1000
    attn_dropout: float = 0.1
    proj_dropout: float = 0.1
    buffer_size: int = 64
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: str = "100"
    diffusion_batch_mul: int = 4
    # mar_probe additions (not in the official constructor)
    clip_denoised: bool = False       # clip the head's x0 prediction to [-1, 1]: valid for pixel tokens only
    diffusion_loss_tokens: int = 0    # >0: diffusion loss on this many random masked tokens per image
    tokenizer: str = "kl16"           # "kl16" (VAE latents, scale 0.2325) or "pixel" (identity patches)
    image_channels: int = 3
    crop_size: int = 0                # >0: images are centre-cropped to this size after decoding

    def __post_init__(self):
        for f in ("img_size", "vae_stride", "patch_size", "encoder_embed_dim", "encoder_depth", "encoder_num_heads",
                  "decoder_embed_dim", "decoder_depth", "decoder_num_heads", "vae_embed_dim", "class_num",
                  "diffloss_d", "diffloss_w", "diffusion_batch_mul", "image_channels"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MARConfig.{f} must be a positive integer, got {value!r}")
        if self.img_size % (self.vae_stride * self.patch_size):
            raise ValueError(f"img_size {self.img_size!r} is not divisible by vae_stride*patch_size "
                             f"{self.vae_stride * self.patch_size!r}")
        for stack in STACKS:
            dim, heads = getattr(self, f"{stack}_embed_dim"), getattr(self, f"{stack}_num_heads")
            if dim % heads:
                raise ValueError(f"{stack}_embed_dim {dim!r} is not divisible by {stack}_num_heads {heads!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tokenizer {self.tokenizer!r}; expected one of {TOKENIZERS!r}")
        if self.buffer_size < 0 or self.diffusion_loss_tokens < 0 or self.crop_size < 0:
            raise ValueError("buffer_size, diffusion_loss_tokens and crop_size must be >= 0")
        if not 0.0 <= self.mask_ratio_min <= 1.0:
            raise ValueError(f"mask_ratio_min must lie in [0, 1], got {self.mask_ratio_min!r}")

    @property
    def seq_h(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_h ** 2

    @property
    def token_embed_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size ** 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MARConfig:
        return cls(**checked_fields(cls, data))

    def replace(self, **changes) -> MARConfig:
        return dataclasses.replace(self, **changes)
