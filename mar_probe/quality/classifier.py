"""A small Fashion-MNIST CNN: the judge of class-conditional accuracy and the feature extractor for the
Fréchet distance on 28x28 grayscale samples.

The trained weights ship as ``data/fashion_classifier.pt``; rebuild them with
``python -m mar_probe.quality.train_classifier --out data/fashion_classifier.pt`` (see ``data/CLASSIFIER.md``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .._config import checked_fields
from .._io import load_weights

REPO_DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_CLASSIFIER_PATH = REPO_DATA_DIR / "fashion_classifier.pt"
FILE_FORMAT = "mar_probe.fashion_classifier"
FILE_FORMAT_VERSION = 1
IMAGE_SIZE = 28


class ClassifierFileError(ValueError):
    """A classifier file is missing, is not a mar_probe classifier, or does not match its architecture."""


@dataclass(frozen=True, kw_only=True)
class ClassifierConfig:
    """Architecture of :class:`FashionCNN`; travels inside the saved file."""
    channels: tuple[int, int, int] = (32, 64, 128)
    feature_dim: int = 128
    num_classes: int = 10
    dropout: float = 0.3

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(self.channels))
        if len(self.channels) != 3 or any(not isinstance(c, int) or c < 1 for c in self.channels):
            raise ValueError(f"ClassifierConfig.channels must be three positive integers, got {self.channels!r}")
        for f in ("feature_dim", "num_classes"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"ClassifierConfig.{f} must be a positive integer, got {getattr(self, f)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ClassifierConfig.dropout must lie in [0, 1), got {self.dropout!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ClassifierConfig:
        return cls(**checked_fields(cls, data))


@dataclass(frozen=True, kw_only=True)
class TrainClassifierConfig:
    """How to train the classifier on the Fashion-MNIST train split."""
    out: str = str(DEFAULT_CLASSIFIER_PATH)
    data_dir: str | None = None
    epochs: int = 4
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 1e-4
    flip: bool = True  # random horizontal flips (Fashion-MNIST classes are mirror-symmetric)
    seed: int = 0
    threads: int = 1
    model: ClassifierConfig = ClassifierConfig()

    def __post_init__(self):
        for f in ("epochs", "batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainClassifierConfig.{f} must be >= 1, got {getattr(self, f)!r}")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={self.lr!r}, "
                             f"weight_decay={self.weight_decay!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2))


class FashionCNN(nn.Module):
    """Three conv/BN/ReLU/max-pool stages (28 -> 14 -> 7 -> 3), a ``feature_dim`` ReLU layer, dropout and a
    linear head. Takes float images [N, 1, 28, 28] in [-1, 1] (see :func:`prepare_images`)."""

    def __init__(self, config: ClassifierConfig = ClassifierConfig()):
        super().__init__()
        self.config = config
        c1, c2, c3 = config.channels
        self.conv = nn.Sequential(_conv_block(1, c1), _conv_block(c1, c2), _conv_block(c2, c3))
        self.fc = nn.Linear(c3 * 3 * 3, config.feature_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features [N, feature_dim] (after ReLU, before dropout)."""
        return torch.relu(self.fc(self.conv(x).flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


def prepare_images(images) -> torch.Tensor:
    """uint8 images [N, 28, 28] or [N, 28, 28, 1] -> float tensor [N, 1, 28, 28] in [-1, 1].

    Raises
    ------
    ValueError
        If the images are not uint8 or not 28x28 grayscale.
    """
    arr = np.asarray(images)
    if arr.ndim == 4 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim != 3 or arr.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"expected 28x28 grayscale images of shape [N, 28, 28] or [N, 28, 28, 1], "
                         f"got shape {tuple(np.shape(images))!r}")
    if arr.dtype != np.uint8:
        raise ValueError(f"expected uint8 images (0..255), got dtype {str(arr.dtype)!r}")
    return torch.tensor(arr, dtype=torch.float32).unsqueeze(1) / 127.5 - 1.0


@torch.no_grad()
def classifier_outputs(classifier: FashionCNN, images, batch_size: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Penultimate features (float64 [N, D]) and logits (float64 [N, classes]) of uint8 28x28 images."""
    x = prepare_images(images)
    classifier.eval()
    feats, logits = [], []
    for i in range(0, x.shape[0], batch_size):
        f = classifier.features(x[i:i + batch_size])
        feats.append(f)
        logits.append(classifier.head(f))
    if not feats:
        raise ValueError("expected at least one image, got 0")
    return torch.cat(feats).double().numpy(), torch.cat(logits).double().numpy()


def predict(classifier: FashionCNN, images, batch_size: int = 1000) -> np.ndarray:
    """Predicted class (int64 [N]) of uint8 28x28 images."""
    return classifier_outputs(classifier, images, batch_size)[1].argmax(1)


def state_fingerprint(state_dict: dict) -> str:
    """A SHA-256 of the parameter names, shapes and values: ties reference statistics to one classifier."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def save_classifier(path: str | Path, classifier: FashionCNN, *, test_accuracy: float,
                    train_config: dict | None = None) -> Path:
    """Atomically write the classifier's config, state dict and test accuracy to a ``.pt`` file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FILE_FORMAT, "format_version": FILE_FORMAT_VERSION,
               "config": classifier.config.to_dict(), "state_dict": classifier.state_dict(),
               "test_accuracy": float(test_accuracy), "train_config": train_config or {}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def _read_payload(path: Path) -> dict:
    if not path.is_file():
        raise ClassifierFileError(f"classifier file {str(path)!r} does not exist; train one with "
                                  "`python -m mar_probe.quality.train_classifier --out FILE`")
    payload = load_weights(path, what="classifier file", error=ClassifierFileError)
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        got = sorted(map(str, payload))[:8] if isinstance(payload, dict) else type(payload).__name__
        raise ClassifierFileError(f"{str(path)!r} is not a mar_probe classifier: expected a dict with "
                                  f"format={FILE_FORMAT!r}, got {got!r}")
    if payload.get("format_version") != FILE_FORMAT_VERSION:
        raise ClassifierFileError(f"{str(path)!r}: unsupported classifier format version; expected "
                                  f"{FILE_FORMAT_VERSION!r}, got {payload.get('format_version')!r}")
    return payload


def load_classifier(path: str | Path = DEFAULT_CLASSIFIER_PATH) -> FashionCNN:
    """Load a classifier saved by :func:`save_classifier` (``weights_only=True``), in eval mode.

    The returned module carries ``test_accuracy`` and ``fingerprint`` attributes.

    Raises
    ------
    ClassifierFileError
        If the file is missing, is not a mar_probe classifier, or its weights do not fit its config.
    """
    path = Path(path)
    payload = _read_payload(path)
    try:
        model = FashionCNN(ClassifierConfig.from_dict(payload.get("config")))
    except (TypeError, ValueError) as exc:
        raise ClassifierFileError(f"{str(path)!r}: invalid classifier config {payload.get('config')!r}: {exc}") from exc
    state = payload.get("state_dict")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()} if isinstance(state, dict) else {}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:6]
        raise ClassifierFileError(f"{str(path)!r}: weights do not match the classifier architecture "
                                  f"{payload['config']!r}; first differing (name, shape) entries: {diff!r}")
    model.load_state_dict(state)
    model.test_accuracy = float(payload.get("test_accuracy", float("nan")))
    model.fingerprint = state_fingerprint(state)
    return model.eval()


def _epoch(model, opt, sched, x, y, cfg: TrainClassifierConfig, gen: torch.Generator, bar) -> None:
    model.train()
    perm = torch.randperm(x.shape[0], generator=gen)
    for i in range(0, x.shape[0], cfg.batch_size):
        idx = perm[i:i + cfg.batch_size]
        xb = x[idx]
        if cfg.flip:
            flip = torch.rand(idx.shape[0], generator=gen) < 0.5
            xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
        loss = nn.functional.cross_entropy(model(xb), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")


def train_classifier(cfg: TrainClassifierConfig = TrainClassifierConfig()) -> tuple[FashionCNN, float]:
    """Train on the train split (Adam, one-cycle schedule), save to ``cfg.out``, return (model, test accuracy)."""
    from ..data import load_fashion_mnist
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train_x, train_y = load_fashion_mnist("train", cfg.data_dir)
    test_x, test_y = load_fashion_mnist("test", cfg.data_dir)
    x, y = prepare_images(train_x), torch.from_numpy(train_y)
    model = FashionCNN(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * -(-x.shape[0] // cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.15)
    t0 = time.time()
    with tqdm(total=steps, desc="train classifier", smoothing=0.05) as bar:
        for _ in range(cfg.epochs):
            _epoch(model, opt, sched, x, y, cfg, gen, bar)
    accuracy = float((predict(model, test_x) == test_y).mean())
    train_info = {**cfg.to_dict(), "wall_time_s": round(time.time() - t0, 1)}
    save_classifier(cfg.out, model, test_accuracy=accuracy, train_config=train_info)
    return model.eval(), accuracy
