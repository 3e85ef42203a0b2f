"""Named model presets: the official MAR-B/L/H and small pixel-token models for the embedded default and tests."""
from __future__ import annotations

from .config import MARConfig

_OFFICIAL = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, class_num=1000, buffer_size=64,
                 mlp_ratio=4.0, tokenizer="kl16", image_channels=3)

# Fashion-MNIST padded to 32x32, 2x2 pixel patches -> 256 tokens on a 16x16 grid, as MAR's ImageNet 256 grid.
_FASHION = dict(img_size=32, vae_stride=2, patch_size=1, vae_embed_dim=4, image_channels=1, crop_size=28,
                class_num=10, attn_dropout=0.0, proj_dropout=0.0, diffloss_d=3, diffloss_w=256,
                num_sampling_steps="50", diffusion_batch_mul=2, diffusion_loss_tokens=64, clip_denoised=True,
                tokenizer="pixel")


def _fashion_b(width: int) -> dict:
    """A MAR-B-shaped pixel model: 12+12 blocks of ``width`` with heads of 64 channels, buffer 64."""
    return dict(_FASHION, buffer_size=64, encoder_embed_dim=width, encoder_depth=12, encoder_num_heads=width // 64,
                decoder_embed_dim=width, decoder_depth=12, decoder_num_heads=width // 64)


PRESETS: dict[str, dict] = {
    "mar_base": dict(_OFFICIAL, encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12,
                     decoder_embed_dim=768, decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "mar_large": dict(_OFFICIAL, encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16,
                      decoder_embed_dim=1024, decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "mar_huge": dict(_OFFICIAL, encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16,
                     decoder_embed_dim=1280, decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
    # The first embedded default (sessions 1-2, 4+4 blocks, buffer 16; data/fashion_small.pth until issue 14 replaced
    # it); kept so its checkpoint in git history loads and the result files measured on it stay reproducible.
    "fashion_small": dict(_FASHION, buffer_size=16, encoder_embed_dim=192, encoder_depth=4, encoder_num_heads=6,
                          decoder_embed_dim=192, decoder_depth=4, decoder_num_heads=6),
    # MAR-B-shaped candidates for the embedded default (issue 14): MAR-B's 12+12 blocks, buffer 64 and head
    # width 64, so MARche's selection layer (index 1, its paper's layer 2) and LazyMAR's prune layer (decoder index
    # 3, its paper's layer 4) sit at MAR-B's relative depth; only the width differs.
    # benchmarks/pilot_architectures.py compares them at the same wall-clock training budget.
    **{f"fashion_b{w}": _fashion_b(w) for w in (128, 192, 256)},
    # Tiny models for tests: 64 tokens (8x8 grid) of 2x2 pixel patches; 8x8 images (sklearn digits) padded to 16x16.
    "mar_tiny": dict(img_size=16, crop_size=8, attn_dropout=0.0, proj_dropout=0.0, vae_stride=2, patch_size=1,
                     vae_embed_dim=4, image_channels=1, class_num=10,
                     buffer_size=4, encoder_embed_dim=32, encoder_depth=2, encoder_num_heads=2,
                     decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2, diffloss_d=2, diffloss_w=32,
                     num_sampling_steps="10", diffusion_batch_mul=1, clip_denoised=True, tokenizer="pixel"),
    # A tiny model with the official 16x16 grid of 16-channel latents, for ImageNet-path tests.
    "mar_tiny_latent": dict(_OFFICIAL, buffer_size=8, class_num=20, encoder_embed_dim=32, encoder_depth=2,
                            encoder_num_heads=2, decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2,
                            diffloss_d=2, diffloss_w=32, num_sampling_steps="10"),
}

# the embedded default's preset (data/fashion_b128.pth since issue 14): create_model() and TrainConfig read it
# here, so a new default changes one line
DEFAULT_PRESET = "fashion_b128"


def preset_config(preset: str, **overrides) -> MARConfig:
    """The :class:`MARConfig` of a named preset, with keyword overrides (``name=`` renames it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)!r}")
    return MARConfig(**{**PRESETS[preset], "name": preset, **overrides})
