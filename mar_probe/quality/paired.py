"""Paired fidelity: how close a strategy's samples are to ``full``'s samples of the same labels, seed, generation
orders and noise.

Per image: token MSE and mean token cosine (on the model's token latents), pixel PSNR and SSIM (on the decoded
uint8 images; SSIM is scikit-image's ``structural_similarity`` with its defaults: 7x7 uniform window, data range
255, mean over channels). Their distribution over images is summarised by :func:`summarize` (mean with a
Student-t interval, median, quantiles, and bootstrap intervals of the median, the bad tail and the worst image).
:func:`interval` is the package's one interval function (every statistic, t or bootstrap, clipped to the quantity's
range and flagged when clipped); ``analysis.aggregate`` shares its t half width.

Pairing: every strategy draws its generation orders first from the same seeded generator, so orders and labels
match ``full``'s exactly; the head's noise matches as long as the strategy runs the same number of steps (the
per-step draws have the shape of the tokens generated at that step). ``fewer-steps`` changes the schedule, so its
images are new samples rather than approximations of ``full``'s: its paired numbers measure difference, not error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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


# ---- intervals ----------------------------------------------------------------------------------------------
STATISTICS = ("mean", "median", "p5", "p95", "tail", "worst")
METHODS = ("t", "bootstrap")
_QUANTILES = {"median": 0.5, "p5": 0.05, "p95": 0.95}


@dataclass(frozen=True)
class Interval:
    """A statistic of independent values with its confidence interval.

    ``statistic`` is the one computed (``tail`` and ``worst`` resolved to ``p5``/``p95`` and ``min``/``max``);
    ``low``/``high`` are None when there is no interval (one value); ``clipped`` says that clipping to the
    quantity's range moved an end."""
    estimate: float
    low: float | None
    high: float | None
    n: int
    statistic: str
    method: str
    level: float
    clipped: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Interval:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def t_half_width(std, n, level: float):
    """Half width of the Student-t interval of a mean: ``t(0.5 + level/2, n - 1) * std / sqrt(n)`` (broadcasts)."""
    from scipy import stats
    n = np.asarray(n, dtype=np.float64)
    return stats.t.ppf(0.5 + level / 2, n - 1) * np.asarray(std, dtype=np.float64) / np.sqrt(n)


def _resolve(statistic: str, higher_is_better: bool) -> str:
    if statistic == "tail":
        return "p5" if higher_is_better else "p95"
    if statistic == "worst":
        return "min" if higher_is_better else "max"
    return statistic


def _statistic(name: str, x: np.ndarray, axis=None):
    """The resolved statistic ``name`` of ``x`` along ``axis`` (numpy's default linear quantiles)."""
    if name == "mean":
        return np.mean(x, axis=axis)
    if name == "min":
        return np.min(x, axis=axis)
    if name == "max":
        return np.max(x, axis=axis)
    return np.quantile(x, _QUANTILES[name], axis=axis)


def _shown(values) -> str:
    a = np.asarray(values)
    return repr(values) if a.size <= 8 else f"an array of shape {a.shape!r}"


def _check_interval_args(statistic, method, level, bounds, n_boot) -> str:
    """Refuse bad arguments of :func:`interval`, naming them; the method (its default resolved)."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; expected one of {STATISTICS!r}")
    method = ("t" if statistic == "mean" else "bootstrap") if method is None else method
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; expected one of {METHODS!r}")
    if method == "t" and statistic != "mean":
        raise ValueError(f"the t-interval is for the mean, got statistic {statistic!r} with method 't'; use "
                         "method='bootstrap'")
    if isinstance(level, bool) or not isinstance(level, (int, float, np.integer, np.floating)) \
            or not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    if bounds is not None and (len(bounds) != 2 or not bounds[0] <= bounds[1]):
        raise ValueError(f"bounds must be (low, high) with low <= high, got {bounds!r}")
    return method


def interval(values, *, statistic: str = "mean", method: str | None = None, level: float = 0.95,
             bounds: tuple[float, float] | None = None, higher_is_better: bool = True, n_boot: int = 2000,
             seed: int = 0) -> Interval:
    """A statistic of independent values (images, seeds) with its confidence interval, clipped to a range.

    Parameters
    ----------
    values : array_like or xarray.DataArray, 1-D
        One value per independent unit; non-finite values are skipped (``n`` counts the rest).
    statistic : {"mean", "median", "p5", "p95", "tail", "worst"}
        ``tail`` is the bad tail's 5% quantile (``p5`` when higher is better, ``p95`` otherwise); ``worst`` the
        minimum when higher is better, the maximum otherwise.
    method : {"t", "bootstrap"}, optional
        Student-t interval (the mean only) or percentile bootstrap over the units; default ``t`` for the mean,
        ``bootstrap`` for the other statistics.
    level : float in (0, 1)
        Confidence level.
    bounds : (low, high), optional
        The quantity's range (``np.inf`` for none on a side); the interval's ends are clipped to it and
        ``clipped`` set when that moved one.
    higher_is_better : bool
        Direction of the quantity (for ``tail`` and ``worst``).
    n_boot, seed : int
        Bootstrap resamples (``rng = np.random.default_rng(seed)``; ``idx = rng.integers(0, n, (n_boot, n))``;
        the ``50 -+ 50 * level`` percentiles of the statistic of ``x[idx]`` along axis 1).

    Returns
    -------
    Interval
        With ``low = high = None`` for a single value: one unit gives no interval. The bootstrap interval of
        ``worst`` can never pass the sample's worst: read it as a lower bound on how bad the tail is.
    """
    method = _check_interval_args(statistic, method, level, bounds, n_boot)
    raw = values.values if isinstance(values, xr.DataArray) else values
    x = np.asarray(raw, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"interval expects 1-D values (one per independent unit), got shape {x.shape!r}")
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise ValueError(f"interval needs at least one finite value, got {_shown(raw)}")
    name = _resolve(statistic, higher_is_better)
    estimate = float(_statistic(name, x))
    low = high = None
    if x.size > 1 and method == "t":
        half = float(t_half_width(x.std(ddof=1), x.size, level))
        low, high = estimate - half, estimate + half
    elif x.size > 1:
        idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
        reps = _statistic(name, x[idx], axis=1)
        low, high = (float(v) for v in np.percentile(reps, [50 - 50 * level, 50 + 50 * level]))
    clipped = False
    if bounds is not None and low is not None:
        lo_b, hi_b = float(bounds[0]), float(bounds[1])
        new_low, new_high = min(max(low, lo_b), hi_b), max(min(high, hi_b), lo_b)
        clipped = (new_low, new_high) != (low, high)
        low, high = new_low, new_high
    return Interval(estimate=estimate, low=low, high=high, n=int(x.size), statistic=name, method=method,
                    level=float(level), clipped=clipped)


def difference_bounds(bounds: tuple[float, float] | None) -> tuple[float, float] | None:
    """The range of ``a - b`` for ``a`` and ``b`` in ``bounds``."""
    return None if bounds is None else (bounds[0] - bounds[1], bounds[1] - bounds[0])


def summarize(values, dim: str = "image", level: float = 0.95, *, bounds: tuple[float, float] | None = None,
              higher_is_better: bool = True, statistics: bool = True, point_interval: bool = True,
              n_boot: int = 2000, seed: int = 0) -> dict:
    """Distribution of per-item values: ``mean`` with a Student-t ``lo``/``hi`` interval (clipped to ``bounds``,
    ``clipped`` when that moved an end), ``median``, ``q05``, ``q95``, ``min``, ``max`` and ``n`` (non-finite
    values skipped), and with ``statistics`` a dict of :meth:`Interval.to_dict` for ``mean`` (t), ``median``,
    ``tail`` and ``worst`` (percentile bootstrap; see :func:`interval`).

    Parameters
    ----------
    values : xarray.DataArray or array_like
        Values along ``dim`` (1-D).
    dim : str
        The dim to summarise over (for a DataArray).
    level : float
        Confidence level of the intervals.
    bounds, higher_is_better, n_boot, seed
        As for :func:`interval`.
    point_interval : bool
        A single value has ``lo = hi = mean`` (True, the original contract) or ``lo = hi = None`` (False: no
        interval).
    """
    if isinstance(values, xr.DataArray) and values.dims != (dim,):
        raise ValueError(f"summarize expects a 1-D array over {dim!r}, got dims {values.dims!r}")
    x = values.values if isinstance(values, xr.DataArray) else np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)].astype(np.float64)
    if x.size == 0:
        return {"mean": None, "lo": None, "hi": None, "median": None, "q05": None, "q95": None, "min": None,
                "max": None, "n": 0, "clipped": False, **({"statistics": {}} if statistics else {})}
    kw = dict(level=level, bounds=bounds, higher_is_better=higher_is_better, n_boot=n_boot, seed=seed)
    mean = interval(x, statistic="mean", **kw)
    lo, hi = (mean.low, mean.high) if mean.low is not None or not point_interval else (mean.estimate,) * 2
    q05, med, q95 = np.quantile(x, [0.05, 0.5, 0.95])
    out = {"mean": mean.estimate, "lo": lo, "hi": hi, "median": float(med), "q05": float(q05), "q95": float(q95),
           "min": float(x.min()), "max": float(x.max()), "n": int(x.size), "clipped": mean.clipped}
    if statistics:
        out["statistics"] = {"mean": mean.to_dict(), **{s: interval(x, statistic=s, **kw).to_dict()
                                                         for s in ("median", "tail", "worst")}}
    return out
