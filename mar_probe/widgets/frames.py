"""What the widgets draw, computed from a recorded run without the model: partial images, token-grid maps.

A run store holds the final tokens of every sample on the ``[buffer; image tokens]`` axis, the per-step
``mask`` (unknown before the step) and ``pred`` (generated at the step), and the model config in its attrs.
MAR never resamples a decoded token, so the canvas the model holds after step s is the final tokens where a
token is known after s and zeros (what the sampler feeds for unknown tokens) elsewhere; pixel tokens decode
to an image through the config alone.
"""
from __future__ import annotations

import numpy as np
import xarray as xr

from .. import analysis as A

FEATURE_SUFFIXES = ("head", "d_head", "d_model")


def vector_variables(ds: xr.Dataset) -> list[str]:
    """Per-step variables with a feature dim (head, d_head, d_model): those a cosine is defined for."""
    return [str(v) for v, x in ds.data_vars.items()
            if "step" in x.dims and "token" in x.dims and any(d.endswith(FEATURE_SUFFIXES) for d in x.dims)]


def layer_dim(x: xr.DataArray) -> str | None:
    """The layer dimension of a variable (``layer``, ``enc_layer`` or ``dec_layer``), or None."""
    found = [d for d in x.dims if d == "layer" or d.endswith("_layer")]
    return found[0] if found else None


def image_token_grid(ds: xr.Dataset, values) -> np.ndarray:
    """Values on the full token axis -> a [grid, grid] array of the image tokens (buffer rows dropped)."""
    row = np.asarray(ds["row"].values)
    col = np.asarray(ds["col"].values)
    values = np.asarray(values, dtype=np.float64)
    if values.shape != row.shape:
        raise ValueError(f"expected one value per token ({row.shape[0]}), got shape {values.shape!r}")
    img = row >= 0
    n = int(row[img].max()) + 1
    grid = np.full((n, int(col[img].max()) + 1), np.nan)
    grid[row[img], col[img]] = values[img]
    return grid


def cosine_map(ds: xr.Dataset, var: str, sample: int, steps: tuple[int, int], layer: int | None = None,
               branch: str | None = None) -> np.ndarray:
    """Cosine of ``var`` between steps ``steps = (s0, s1)`` per image token, as a [grid, grid] array.

    NaN where a token was not processed at either step (encoder variables skip masked tokens).
    """
    A.require(ds, var)
    s0, s1 = (int(s) for s in steps)
    if s1 <= s0:
        raise ValueError(f"expected a step pair (s0, s1) with s0 < s1, got {steps!r}")
    x = ds[var]
    A.check_values(x, "sample", sample)
    A.check_values(x, "step", [s0, s1])
    sel = {"sample": sample, "step": [s0, s1]}
    ldim = layer_dim(x)
    if ldim is not None:
        if layer is None:
            raise ValueError(f"{var!r} has a {ldim!r} dim; expected a layer, got None")
        A.check_values(x, ldim, layer)
        sel[ldim] = layer
    if "branch" in x.dims:
        A.check_values(x, "branch", branch)
        sel["branch"] = branch
    cos = A.cosine_stability(x.sel(sel, drop=True).compute(), lag=s1 - s0).sel(step=s1, drop=True)
    return image_token_grid(ds, cos.values)


def _config(ds: xr.Dataset) -> dict:
    cfg = ds.attrs.get("model_config")
    if not cfg:
        raise ValueError("the store has no 'model_config' attribute; expected a run written by `mar-probe record`")
    return cfg


def is_pixel_run(ds: xr.Dataset) -> bool:
    """Whether the run's tokens are pixel patches (decodable from the config alone, no VAE)."""
    return _config(ds).get("tokenizer") == "pixel"


def decode_pixel_tokens(tokens: np.ndarray, config: dict) -> np.ndarray:
    """Pixel-patch tokens [N, L, C] (image tokens only) -> uint8 images [N, H, W, channels].

    Exactly what the sampler's decoding does (``model.unpatchify`` then the pixel tokenizer), from the config.
    """
    import torch

    from ..models.tokenizer import PixelTokenizer
    if config.get("tokenizer") != "pixel":
        raise ValueError(f"only pixel tokens decode without a VAE; this run's tokenizer is "
                         f"{config.get('tokenizer')!r}")
    tokens = np.asarray(tokens, dtype=np.float32)
    n, seq, _ = tokens.shape
    h = int(round(seq ** 0.5))
    p, c = int(config["patch_size"]), int(config["vae_embed_dim"])
    x = tokens.reshape(n, h, h, c, p, p).transpose(0, 3, 1, 4, 2, 5).reshape(n, c, h * p, h * p)  # [N, C, H', W']
    tok = PixelTokenizer(config["img_size"], config["vae_stride"], config["image_channels"], config["crop_size"])
    return tok.decode(torch.from_numpy(np.ascontiguousarray(x)))


def known_after(ds: xr.Dataset, sample: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(known after ``step``, generated at ``step``) as bool arrays over the image tokens [L]."""
    A.check_values(ds["mask"], "step", step)
    img = np.asarray(ds["row"].values) >= 0
    mask = np.asarray(ds["mask"].sel(sample=sample, step=step).values)[img]
    pred = np.asarray(ds["pred"].sel(sample=sample, step=step).values)[img]
    return ~mask | pred, pred


def canvas_tokens(ds: xr.Dataset, sample: int, step: int) -> np.ndarray:
    """The token canvas after ``step`` [L, C]: final tokens where known, zeros where still masked."""
    known, _ = known_after(ds, sample, step)
    img = np.asarray(ds["row"].values) >= 0
    final = np.asarray(ds["tokens"].sel(sample=sample).values)[img]  # [L, C]
    return np.where(known[:, None], final, 0.0).astype(np.float32)


def partial_image(ds: xr.Dataset, sample: int, step: int) -> np.ndarray:
    """The image the model holds after ``step`` as uint8 [H, W, channels] (pixel-token runs).

    For runs of latent tokens (a VAE is needed to decode) the final decoded image is returned with the tokens
    still unknown after ``step`` greyed out, when the store has ``images``; otherwise the mean latent channel
    of the canvas, scaled to uint8.
    """
    cfg = _config(ds)
    if cfg.get("tokenizer") == "pixel":
        return decode_pixel_tokens(canvas_tokens(ds, sample, step)[None], cfg)[0]
    known, _ = known_after(ds, sample, step)
    if "images" in ds.data_vars:
        img = np.asarray(ds["images"].sel(sample=sample).values)
        cover = upsample_token_mask(~known, cfg, img.shape[:2])
        return np.where(cover[..., None], np.uint8(128), img)
    canvas = canvas_tokens(ds, sample, step).mean(-1)
    grid = image_token_grid(ds, _on_token_axis(ds, canvas))
    lo, hi = np.nanmin(grid), np.nanmax(grid)
    return ((grid - lo) / (hi - lo + 1e-12) * 255).round().astype(np.uint8)[..., None]


def _on_token_axis(ds: xr.Dataset, image_values: np.ndarray) -> np.ndarray:
    row = np.asarray(ds["row"].values)
    full = np.full(row.shape, np.nan)
    full[row >= 0] = image_values
    return full


def upsample_token_mask(mask: np.ndarray, config: dict, shape: tuple[int, int]) -> np.ndarray:
    """A per-image-token bool mask [L] -> a pixel mask of ``shape`` (each token's patch, crop applied)."""
    h = int(round(mask.size ** 0.5))
    grid = np.asarray(mask, dtype=bool).reshape(h, h)
    scale = shape[0] // h if config.get("tokenizer") != "pixel" else \
        int(config["vae_stride"]) * int(config["patch_size"])
    full = grid.repeat(scale, 0).repeat(scale, 1)
    pad = (full.shape[0] - shape[0]) // 2
    return full[pad:pad + shape[0], pad:pad + shape[1]]
