"""Data loading and the pixel tokenizer."""
import gzip

import numpy as np
import pytest

from mar_probe.data import DatasetError, load_digits_images, load_fashion_mnist, read_idx
from mar_probe.models.tokenizer import PixelTokenizer


def _write_idx(path, array, compress=False):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def _fake_fashion(tmp_path, n=5, compress=True):
    rng = np.random.default_rng(0)
    sfx = ".gz" if compress else ""
    for split, k in (("train", n), ("t10k", n)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte{sfx}", rng.integers(0, 256, (k, 28, 28)), compress)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte{sfx}", rng.integers(0, 10, k), compress)
    return tmp_path


@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip(tmp_path, compress):
    _fake_fashion(tmp_path, compress=compress)
    images, labels = load_fashion_mnist("train", tmp_path)
    assert images.shape == (5, 28, 28) and images.dtype == np.uint8 and labels.dtype == np.int64


def test_missing_directory_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetError, match="does not exist.*apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", tmp_path / "absent")
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte"):
        load_fashion_mnist("train", tmp_path)


def test_corrupt_idx_files(tmp_path):
    _fake_fashion(tmp_path, compress=False)
    path = tmp_path / "train-images-idx3-ubyte"
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    with pytest.raises(DatasetError, match="payload has"):
        read_idx(path)
    path.write_bytes(b"\x01\x02\x03\x04" + raw[4:])
    with pytest.raises(DatasetError, match="expected magic bytes 00 00 08"):
        load_fashion_mnist("train", tmp_path)
    with pytest.raises(ValueError, match="unknown split 'val'"):
        load_fashion_mnist("val", tmp_path)


def test_digits_are_real_images():
    images, labels = load_digits_images()
    assert images.shape == (1797, 8, 8) and images.max() == 255 and set(labels) == set(range(10))


def test_pixel_tokenizer_round_trip():
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    tok = PixelTokenizer(32, 2, 1, 28)
    latents = tok.encode(images)
    assert tuple(latents.shape) == (3, 4, 16, 16)          # 256 tokens of 2x2 pixels
    assert float(latents[0, :, 0, 0].max()) == -1.0         # padding is background (-1)
    assert np.array_equal(tok.decode(latents)[..., 0], images)
    with pytest.raises(ValueError, match="expected images of 28x28"):
        tok.encode(images[:, :20, :20])
