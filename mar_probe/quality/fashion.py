"""Quality of 28x28 grayscale (Fashion-MNIST) samples, judged by the project's classifier.

* class-conditional accuracy: how often the classifier agrees with the label the sample was generated for;
* Fréchet distance of the classifier's penultimate features against the test split (shipped statistics);
* the real-vs-real floor: the same distance for real train images vs the test split, to read it against.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..data import FASHION_CLASSES
from .classifier import REPO_DATA_DIR, FashionCNN, classifier_outputs, state_fingerprint
from .frechet import feature_stats, frechet_distance

DEFAULT_REFERENCE_PATH = REPO_DATA_DIR / "fashion_test_stats.npz"
FLOOR_SIZES = (100, 200, 500, 1000, 2000, 5000, 10000)
_REFERENCE_KEYS = ("mu", "sigma", "floor_sizes", "floor_fd", "classifier_fingerprint")


def _check_labels(labels, num_images: int, num_classes: int) -> np.ndarray:
    lab = np.asarray(labels)
    if lab.shape != (num_images,) or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"expected integer labels of shape ({num_images},), got dtype {str(lab.dtype)!r} "
                         f"and shape {lab.shape!r}")
    if num_images and (lab.min() < 0 or lab.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{lab.min()!r}, {lab.max()!r}]")
    return lab.astype(np.int64)


def per_class_accuracy(predictions, labels, num_classes: int = 10) -> dict[str, float | None]:
    """Accuracy per conditioning class, keyed by Fashion-MNIST class name (None: no sample of that class)."""
    pred, lab = np.asarray(predictions), np.asarray(labels)
    names = FASHION_CLASSES if num_classes == len(FASHION_CLASSES) else tuple(map(str, range(num_classes)))
    return {names[c]: (float((pred[lab == c] == c).mean()) if (lab == c).any() else None)
            for c in range(num_classes)}


def class_accuracy(images, labels, classifier: FashionCNN) -> float:
    """Fraction of uint8 28x28 images the classifier assigns to their conditioning label."""
    _, logits = classifier_outputs(classifier, images)
    lab = _check_labels(labels, logits.shape[0], logits.shape[1])
    return float((logits.argmax(1) == lab).mean())


def load_reference_stats(path: str | Path = DEFAULT_REFERENCE_PATH) -> dict:
    """Read reference statistics written by :func:`save_reference_stats` (``mu``, ``sigma``, the floor table
    ``floor_sizes``/``floor_fd`` and the ``classifier_fingerprint`` they belong to)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference statistics {str(path)!r} do not exist; write them with "
                                "`python -m mar_probe.quality.train_classifier --stats-only`")
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in _REFERENCE_KEYS if k not in data.files]
        if missing:
            raise ValueError(f"{str(path)!r} is not a mar_probe Fashion-MNIST reference file: expected keys "
                             f"{list(_REFERENCE_KEYS)!r}, got {sorted(data.files)!r}")
        stats = {k: data[k] for k in data.files}
    stats["classifier_fingerprint"] = str(stats["classifier_fingerprint"])
    return stats


def save_reference_stats(path: str | Path, stats: dict) -> Path:
    """Write the dict from :func:`compute_reference_stats` as an ``.npz``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in stats.items()})
    return path


def _floor_table(train_feats: np.ndarray, mu, sigma, sizes, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    means, stds = [], []
    for n in sizes:
        k = max(1, min(repeats, train_feats.shape[0] // n))
        fds = [frechet_distance(*feature_stats(train_feats[i * n:(i + 1) * n]), mu, sigma) for i in range(k)]
        means.append(np.mean(fds))
        stds.append(np.std(fds))
    return np.asarray(means), np.asarray(stds)


def compute_reference_stats(classifier: FashionCNN, data_dir=None, floor_sizes=FLOOR_SIZES, repeats: int = 5,
                            seed: int = 0) -> dict:
    """Feature statistics of the test split and the real-vs-real floor.

    The floor for size ``n`` is the Fréchet distance between ``n`` train images and the full (10k) test
    split, averaged over ``repeats`` disjoint random train subsets (``floor_fd``, spread ``floor_fd_std``);
    the table shows how the distance's finite-sample bias falls with ``n``.
    """
    from ..data import load_fashion_mnist
    test_x, _ = load_fashion_mnist("test", data_dir)
    train_x, _ = load_fashion_mnist("train", data_dir)
    mu, sigma = feature_stats(classifier_outputs(classifier, test_x)[0])
    order = np.random.default_rng(seed).permutation(train_x.shape[0])
    train_feats = classifier_outputs(classifier, train_x[order])[0]
    floors, spreads = _floor_table(train_feats, mu, sigma, floor_sizes, repeats)
    return {"mu": mu, "sigma": sigma, "floor_sizes": np.asarray(floor_sizes, dtype=np.int64),
            "floor_fd": floors, "floor_fd_std": spreads, "floor_repeats": np.int64(repeats),
            "floor_seed": np.int64(seed), "num_test_images": test_x.shape[0],
            "classifier_fingerprint": state_fingerprint(classifier.state_dict())}


def _check_fingerprint(classifier: FashionCNN, reference: dict) -> None:
    got = state_fingerprint(classifier.state_dict())
    if got != reference["classifier_fingerprint"]:
        raise ValueError("the reference statistics were computed with another classifier: expected "
                         f"fingerprint {reference['classifier_fingerprint'][:16]!r}..., got {got[:16]!r}...; "
                         "recompute them with `python -m mar_probe.quality.train_classifier --stats-only`")


def floor_for(reference: dict, num_images: int) -> tuple[float, float, int]:
    """(mean, spread, size) of the tabulated real-vs-real floor whose size is nearest (in ratio) to ``num_images``."""
    sizes = np.asarray(reference["floor_sizes"])
    i = int(np.argmin(np.abs(np.log(sizes / max(num_images, 1)))))
    spread = float(reference["floor_fd_std"][i]) if "floor_fd_std" in reference else float("nan")
    return float(reference["floor_fd"][i]), spread, int(sizes[i])


def fashion_frechet(images, classifier: FashionCNN, reference: dict) -> float:
    """Fréchet distance of the images' classifier features against the test-split statistics."""
    _check_fingerprint(classifier, reference)
    feats, _ = classifier_outputs(classifier, images)
    return frechet_distance(*feature_stats(feats), reference["mu"], reference["sigma"])


def fashion_report(images, labels, classifier: FashionCNN, reference: dict) -> dict:
    """All Fashion-MNIST metrics in one classifier pass (see :func:`mar_probe.quality.quality_report`)."""
    _check_fingerprint(classifier, reference)
    feats, logits = classifier_outputs(classifier, images)
    lab = _check_labels(labels, logits.shape[0], logits.shape[1])
    pred = logits.argmax(1)
    fd = frechet_distance(*feature_stats(feats), reference["mu"], reference["sigma"])
    floor, floor_std, floor_n = floor_for(reference, feats.shape[0])
    return {"kind": "fashion", "num_images": int(feats.shape[0]), "class_accuracy": float((pred == lab).mean()),
            "per_class_accuracy": per_class_accuracy(pred, lab, logits.shape[1]),
            "frechet_distance": fd, "frechet_floor": floor,
            "frechet_floor_std": floor_std, "frechet_floor_num_images": floor_n,
            "frechet_ratio": fd / floor if floor > 0 else float("inf"),
            "classifier_test_accuracy": float(getattr(classifier, "test_accuracy", float("nan")))}
