"""Paired fidelity: how close a strategy's samples are to ``full``'s samples of the same labels, seed, generation
orders and noise.

Per image: token MSE and mean token cosine (on the model's token latents), pixel PSNR and SSIM (on the decoded
uint8 images; SSIM is scikit-image's ``structural_similarity`` with its defaults: 7x7 uniform window, data range
255, mean over channels). Their distribution over images is summarised by :func:`summarize` (mean with a
Student-t interval, median, quantiles).

Pairing: every strategy draws its generation orders first from the same seeded generator, so orders and labels
match ``full``'s exactly; the head's noise matches as long as the strategy runs the same number of steps (the
per-step draws have the shape of the tokens generated at that step). ``fewer-steps`` changes the schedule, so its
images are new samples rather than approximations of ``full``'s: its paired numbers measure difference, not error.
"""
from __future__ import annotations

import numpy as np
import xarray as xr

# PSNR of identical images is infinite; it is reported as this value (above the 77.1 dB of a one-level difference
# in a single pixel of a 28x28 image, and any finite PSNR of uint8 images up to 200x200 pixels).
PSNR_IDENTICAL = 100.0


def _pairs(a, b, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim < 2:
        raise ValueError(f"paired {what} must have the same shape [N, ...], got {a.shape!r} and {b.shape!r}")
    return a, b


def token_mse(tokens, reference) -> np.ndarray:
    """Mean squared error per image of token latents [N, ...] -> [N]."""
    a, b = _pairs(tokens, reference, "tokens")
    d = a.reshape(len(a), -1).astype(np.float64) - b.reshape(len(b), -1).astype(np.float64)
    return (d ** 2).mean(axis=1)


def token_cosine(tokens, reference) -> np.ndarray:
    """Mean over tokens of the cosine similarity of token latents [N, L, C] -> [N] (1 for two zero tokens)."""
    a, b = _pairs(tokens, reference, "tokens")
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot, na, nb = (a * b).sum(-1), np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, dot / (na * nb))
    return np.nan_to_num(cos, nan=0.0).reshape(len(a), -1).mean(axis=1)


def psnr(images, reference, data_range: float = 255.0) -> np.ndarray:
    """Peak signal-to-noise ratio per image (dB) of images [N, H, W(, C)]; identical images give
    :data:`PSNR_IDENTICAL`."""
    a, b = _pairs(images, reference, "images")
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        out = 10.0 * np.log10(data_range ** 2 / mse)
    return np.minimum(out, PSNR_IDENTICAL)


def ssim(images, reference, data_range: float = 255.0) -> np.ndarray:
    """Structural similarity per image (scikit-image, default 7x7 window) of images [N, H, W(, C)]."""
    from skimage.metrics import structural_similarity
    a, b = _pairs(images, reference, "images")
    if a.ndim == 3:
        a, b = a[..., None], b[..., None]
    return np.array([structural_similarity(x.astype(np.float64), y.astype(np.float64), data_range=data_range,
                                           channel_axis=-1) for x, y in zip(a, b)])


def paired_fidelity(tokens, reference_tokens, images=None, reference_images=None) -> xr.Dataset:
    """Per-image fidelity of a strategy's samples against ``full``'s.

    Parameters
    ----------
    tokens, reference_tokens : array_like [N, L, C] or [N, C, H, W]
        Token latents of the strategy and of ``full`` for the same images.
    images, reference_images : array_like of uint8 [N, H, W(, C)], optional
        Decoded images (PSNR and SSIM are computed when both are given).

    Returns
    -------
    xarray.Dataset
        ``token_mse``, ``token_cos`` and, with images, ``psnr`` and ``ssim``, each over dim ``image``.
    """
    data = {"token_mse": ("image", token_mse(tokens, reference_tokens)),
            "token_cos": ("image", token_cosine(_token_rows(tokens), _token_rows(reference_tokens)))}
    if images is not None and reference_images is not None:
        data["psnr"] = ("image", psnr(images, reference_images))
        data["ssim"] = ("image", ssim(images, reference_images))
    return xr.Dataset(data)


def _token_rows(tokens) -> np.ndarray:
    """[N, C, H, W] (the official layout) -> [N, H*W, C]; [N, L, C] unchanged."""
    t = np.asarray(tokens)
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(0, 2, 1) if t.ndim == 4 else t


def summarize(values, dim: str = "image", level: float = 0.95) -> dict:
    """Distribution of per-item values: ``mean`` with a Student-t ``lo``/``hi`` interval, ``median``, ``q05``,
    ``q95``, ``min``, ``max`` and ``n`` (NaN skipped; a single value has lo = hi = mean).

    Parameters
    ----------
    values : xarray.DataArray or array_like
        Values along ``dim`` (1-D).
    dim : str
        The dim to summarise over (for a DataArray).
    level : float
        Confidence level of the interval.
    """
    from scipy import stats
    x = values.values if isinstance(values, xr.DataArray) else np.asarray(values, dtype=np.float64)
    if isinstance(values, xr.DataArray) and values.dims != (dim,):
        raise ValueError(f"summarize expects a 1-D array over {dim!r}, got dims {values.dims!r}")
    x = x[np.isfinite(x)].astype(np.float64)
    if x.size == 0:
        return {"mean": None, "lo": None, "hi": None, "median": None, "q05": None, "q95": None, "min": None,
                "max": None, "n": 0}
    mean = float(x.mean())
    half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else 0.0
    q05, med, q95 = np.quantile(x, [0.05, 0.5, 0.95])
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "median": float(med), "q05": float(q05),
            "q95": float(q95), "min": float(x.min()), "max": float(x.max()), "n": int(x.size)}
