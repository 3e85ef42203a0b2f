"""Real image data for training and tests: Fashion-MNIST IDX files and scikit-learn's 8x8 digits."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

DEFAULT_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_SPLIT_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_HOW_TO_GET = ("Install them with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu puts them in "
               f"{DEFAULT_FASHION_DIR}), or download the four IDX files from "
               "github.com/zalandoresearch/fashion-mnist and pass their folder with --data DIR.")


class DatasetError(ValueError):
    """A dataset file is missing or malformed."""


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise DatasetError(f"Fashion-MNIST file {stem!r} (or {stem + '.gz'!r}) not found in {str(directory)!r}. "
                       + _HOW_TO_GET)


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed) into a uint8 array.

    Raises
    ------
    DatasetError
        If the magic number, dimension count or payload size is not that of a uint8 IDX file.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"cannot read IDX file {str(path)!r}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetError(f"corrupt IDX file {str(path)!r}: expected magic bytes 00 00 08 (uint8), "
                           f"got {raw[:3].hex(' ')!r}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"corrupt IDX file {str(path)!r}: header truncated")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise DatasetError(f"corrupt IDX file {str(path)!r}: header says shape {shape} "
                           f"({expected} bytes), payload has {len(raw) - header} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def fashion_files(split: str = "train", data_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The (images, labels) IDX files of a Fashion-MNIST split, gzip-compressed or not."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(_SPLIT_FILES)!r}")
    directory = Path(data_dir) if data_dir is not None else DEFAULT_FASHION_DIR
    if not directory.is_dir():
        raise DatasetError(f"Fashion-MNIST directory {str(directory)!r} does not exist. " + _HOW_TO_GET)
    img_stem, lbl_stem = _SPLIT_FILES[split]
    return _find(directory, img_stem), _find(directory, lbl_stem)


def load_fashion_mnist(split: str = "train", data_dir: str | Path | None = None):
    """Load a Fashion-MNIST split as ``(images uint8 [N, 28, 28], labels int64 [N])``."""
    image_file, label_file = fashion_files(split, data_dir)
    images = read_idx(image_file)
    labels = read_idx(label_file).astype(np.int64)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError(f"Fashion-MNIST {split!r} files disagree: images {images.shape}, labels {labels.shape}")
    return images, labels


def load_digits_images():
    """scikit-learn's bundled 8x8 digits as ``(images uint8 [1797, 8, 8], labels int64)``, for fast tests."""
    from sklearn.datasets import load_digits
    d = load_digits()
    images = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)
    return images, d.target.astype(np.int64)
