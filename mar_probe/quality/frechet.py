"""The Fréchet distance between two Gaussians, the statistic behind FID.

``d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^{1/2})``
"""
from __future__ import annotations

import warnings

import numpy as np
from scipy import linalg

# Imaginary parts of diag((S1 S2)^{1/2}) above this are not rounding noise: the inputs are not covariances.
IMAG_TOLERANCE = 1e-3
# Relative residual |X X - A|_F / |A|_F above which the square root is retried with eps added to the diagonals.
RESIDUAL_TOLERANCE = 1e-6


def feature_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """Mean [D] and unbiased covariance [D, D] (float64) of features [N, D], N >= 2."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"expected features of shape [N, D] with N >= 2, got shape {x.shape!r}")
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or infinite values")
    return x.mean(axis=0), np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1])


def _as_gaussian(mu, sigma, which: str) -> tuple[np.ndarray, np.ndarray]:
    mu = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    sigma = np.atleast_2d(np.asarray(sigma, dtype=np.float64))
    if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
        raise ValueError(f"{which}: expected mu [D] and sigma [D, D], got mu {mu.shape!r} and sigma {sigma.shape!r}")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{which}: mu or sigma contains NaN or infinite values")
    return mu, sigma


def _sqrtm(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """Principal square root of ``a`` and whether it is finite and accurate (relative residual)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on singular input; the residual check below decides
        root = linalg.sqrtm(a)
    if not np.isfinite(root).all():
        return root, False
    scale = max(np.linalg.norm(a), np.finfo(np.float64).tiny)
    return root, bool(np.linalg.norm(root @ root - a) / scale <= RESIDUAL_TOLERANCE)


def trace_sqrt_product(sigma1: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6) -> float:
    """``tr((S1 S2)^{1/2})``, retried with ``eps`` on both diagonals when ``S1 S2`` is near-singular."""
    root, ok = _sqrtm(sigma1 @ sigma2)
    if not ok:
        offset = np.eye(sigma1.shape[0]) * eps
        root, _ = _sqrtm((sigma1 + offset) @ (sigma2 + offset))
        if not np.isfinite(root).all():
            raise ValueError(f"cannot take the square root of sigma1 @ sigma2, even with {eps!r} added to the "
                             "diagonals; are both matrices covariances?")
    if np.iscomplexobj(root):
        imag = np.abs(np.diagonal(root).imag).max()
        if imag > IMAG_TOLERANCE:
            raise ValueError(f"sqrt(sigma1 @ sigma2) has imaginary diagonal parts up to {imag:.3g} "
                             f"(expected <= {IMAG_TOLERANCE!r}); are both matrices covariances?")
        root = root.real
    return float(np.trace(root))


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """Squared Fréchet (2-Wasserstein) distance between N(mu1, sigma1) and N(mu2, sigma2).

    Parameters
    ----------
    mu1, mu2 : array_like
        Means, shape [D] (a scalar counts as D = 1).
    sigma1, sigma2 : array_like
        Covariances, shape [D, D].
    eps : float
        Added to both diagonals when ``sigma1 @ sigma2`` is too singular for an accurate square root.

    Returns
    -------
    float
        ``|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^{1/2})``; the FID when the
        statistics are those of Inception pool features.
    """
    mu1, sigma1 = _as_gaussian(mu1, sigma1, "first Gaussian")
    mu2, sigma2 = _as_gaussian(mu2, sigma2, "second Gaussian")
    if mu1.shape != mu2.shape:
        raise ValueError(f"the Gaussians have different dimensions: {mu1.shape[0]!r} vs {mu2.shape[0]!r}")
    diff = mu1 - mu2
    tr_covmean = trace_sqrt_product(sigma1, sigma2, eps)
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean)
