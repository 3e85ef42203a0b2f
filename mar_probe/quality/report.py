"""One entry point for ``mar-probe quality SAMPLES.npz``: pick the metrics that fit the images, format them."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .classifier import DEFAULT_CLASSIFIER_PATH, FashionCNN, load_classifier
from .fashion import DEFAULT_REFERENCE_PATH, fashion_report, load_reference_stats
from .inception import (FIDInceptionV3, fid_from_features, inception_features_and_logits, inception_score,
                        load_inception, load_inception_reference)


def load_samples(samples) -> tuple[np.ndarray, np.ndarray | None]:
    """``(images, labels or None)`` from a samples ``.npz`` path, a mapping or an ``(images, labels)`` pair."""
    if isinstance(samples, (str, Path)):
        path = Path(samples)
        if not path.is_file():
            raise FileNotFoundError(f"samples file {str(path)!r} does not exist")
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise ValueError(f"samples file {str(path)!r} cannot be read as a .npz archive "
                             f"({type(exc).__name__}: {exc}); expected one written by `mar-probe generate`") from None
        with data:
            if "images" not in data.files:
                raise ValueError(f"{str(path)!r}: expected keys 'images' (uint8 [N, H, W, C]) and 'labels' "
                                 f"(int [N]), got {sorted(data.files)!r}")
            return data["images"], (data["labels"] if "labels" in data.files else None)
    if isinstance(samples, dict):
        return np.asarray(samples["images"]), samples.get("labels")
    images, labels = samples
    return np.asarray(images), labels


def _is_grayscale_28(images: np.ndarray) -> bool:
    return images.ndim in (3, 4) and images.shape[1:3] == (28, 28) and (images.ndim == 3 or images.shape[3] == 1)


def imagenet_report(images, model: FIDInceptionV3, reference=None, splits: int = 10) -> dict:
    """FID (when ``reference`` is a MAR-format ``.npz`` path) and Inception Score of uint8 RGB images."""
    features, logits = inception_features_and_logits(model, images)
    splits = min(splits, logits.shape[0])
    is_mean, is_std = inception_score(logits, splits)
    fid = fid_from_features(features, load_inception_reference(reference)) if reference is not None else None
    return {"kind": "imagenet", "num_images": int(features.shape[0]), "fid": fid,
            "inception_score": is_mean, "inception_score_std": is_std, "inception_score_splits": splits}


def quality_report(samples, *, classifier: str | Path | FashionCNN = DEFAULT_CLASSIFIER_PATH,
                   reference: str | Path | dict = DEFAULT_REFERENCE_PATH, inception_weights: str | Path | None = None,
                   inception_reference: str | Path | None = None, splits: int = 10) -> dict:
    """Quality metrics of generated samples, chosen by image shape.

    Parameters
    ----------
    samples : str, Path, dict or (images, labels)
        A samples ``.npz`` (``images`` uint8 [N, H, W, C], ``labels`` int [N]) or the arrays themselves.
    classifier, reference
        Fashion-MNIST classifier file (or module) and its test-split statistics; default: the shipped files.
    inception_weights, inception_reference
        For RGB samples: local pytorch-fid InceptionV3 weights and a MAR-format ``mu``/``sigma`` ``.npz``
        (without the latter, FID is None and only the Inception Score is reported).
    splits : int
        Inception Score splits (capped at N).

    Returns
    -------
    dict
        28x28 grayscale: ``kind='fashion'``, ``num_images``, ``class_accuracy``, ``per_class_accuracy``,
        ``frechet_distance``, ``frechet_floor`` +- ``frechet_floor_std`` (real train vs test at
        ``frechet_floor_num_images``), ``frechet_ratio``, ``classifier_test_accuracy``.
        RGB: ``kind='imagenet'``, ``num_images``, ``fid``, ``inception_score``, ``inception_score_std``,
        ``inception_score_splits``.
    """
    images, labels = load_samples(samples)
    if _is_grayscale_28(images):
        if labels is None:
            raise ValueError("28x28 grayscale samples need their conditioning 'labels' for class accuracy")
        model = classifier if isinstance(classifier, FashionCNN) else load_classifier(classifier)
        ref = reference if isinstance(reference, dict) else load_reference_stats(reference)
        return fashion_report(images, labels, model, ref)
    if images.ndim == 4 and images.shape[-1] == 3:
        if inception_weights is None:
            raise ValueError(f"RGB samples of shape {images.shape!r} need InceptionV3 weights: pass "
                             "inception_weights= (pytorch-fid's pt_inception-2015-12-05-6726825d.pth, local file)")
        return imagenet_report(images, load_inception(inception_weights), inception_reference, splits)
    raise ValueError(f"expected 28x28 grayscale images [N, 28, 28(, 1)] (Fashion-MNIST metrics) or RGB images "
                     f"[N, H, W, 3] (FID/IS), got shape {images.shape!r}")


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def format_report(report: dict) -> str:
    """Human-readable lines for a :func:`quality_report` dict."""
    lines = [f"images: {report['num_images']}"]
    if report.get("kind") == "fashion":
        lines += [f"class-conditional accuracy: {_fmt(report['class_accuracy'])} "
                  f"(classifier test accuracy {_fmt(report.get('classifier_test_accuracy'))})",
                  f"Fréchet distance (classifier features vs test split): {_fmt(report['frechet_distance'])}",
                  f"real-vs-real floor (train vs test, n={report['frechet_floor_num_images']}): "
                  f"{_fmt(report['frechet_floor'])} ± {_fmt(report.get('frechet_floor_std'))}  ->  "
                  f"ratio {report['frechet_ratio']:.2f}x",
                  "per-class accuracy:"]
        if not 0.8 <= report["num_images"] / report["frechet_floor_num_images"] <= 1.25:
            lines.insert(-1, f"  note: the Fréchet distance is biased upward at small n; the nearest tabulated floor "
                             f"is for n={report['frechet_floor_num_images']}, not n={report['num_images']}")
        width = max(map(len, report["per_class_accuracy"]))
        lines += [f"  {name:<{width}}  {_fmt(acc)}" for name, acc in report["per_class_accuracy"].items()]
    else:
        lines += [f"FID: {_fmt(report['fid'])}",
                  f"Inception Score: {_fmt(report['inception_score'])} ± {_fmt(report['inception_score_std'])} "
                  f"({report['inception_score_splits']} splits)"]
    return "\n".join(lines)
