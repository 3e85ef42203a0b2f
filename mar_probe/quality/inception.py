"""FID and Inception Score for ImageNet-sized RGB samples with the standard FID InceptionV3.

The network mirrors pytorch-fid's ``fid_inception_v3`` (torchvision's Inception3 topology with the
TensorFlow-ported FIDInceptionA/C/E_1/E_2 blocks, a 1008-way ``fc``) so that the state dict
``pt_inception-2015-12-05-6726825d.pth`` loads unchanged. Weights are read from a local file only.
Images are resized to 299x299 with bilinear interpolation (``align_corners=False``) and scaled to [-1, 1],
as pytorch-fid does; FID values are comparable to pytorch-fid's, and close to (not identical with)
torch-fidelity's or TensorFlow's, which resize differently.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import logsumexp
from torch import nn

from .._io import load_weights
from .frechet import feature_stats, frechet_distance

FEATURE_DIM = 2048
NUM_LOGITS = 1008
INPUT_SIZE = 299


class BasicConv2d(nn.Module):
    """Conv (no bias) + BatchNorm (eps 1e-3) + ReLU; parameter names ``conv.*`` and ``bn.*``."""

    def __init__(self, cin: int, cout: int, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


def _avg_pool(x):
    # TensorFlow's average pool ignores the zero padding in its denominator.
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class FIDInceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x):
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(_avg_pool(x))], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class FIDInceptionC(nn.Module):
    def __init__(self, cin: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x):
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = x
        for i in range(1, 6):
            bd = getattr(self, f"branch7x7dbl_{i}")(bd)
        return torch.cat([self.branch1x1(x), b7, bd, self.branch_pool(_avg_pool(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = x
        for i in range(1, 5):
            b7 = getattr(self, f"branch7x7x3_{i}")(b7)
        return torch.cat([b3, b7, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class _FIDInceptionE(nn.Module):
    """InceptionE; subclasses choose the pooling of ``branch_pool``."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def pool(self, x):
        raise NotImplementedError

    def forward(self, x):
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        return torch.cat([self.branch1x1(x), b3, bd, self.branch_pool(self.pool(x))], 1)


class FIDInceptionE_1(_FIDInceptionE):
    def pool(self, x):
        return _avg_pool(x)


class FIDInceptionE_2(_FIDInceptionE):
    def pool(self, x):
        # The FID graph max-pools here (the paper and torchvision average-pool).
        return F.max_pool2d(x, kernel_size=3, stride=1, padding=1)


class FIDInceptionV3(nn.Module):
    """InceptionV3 of the TF FID graph. ``forward`` takes float images [N, 3, H, W] in [0, 1] and returns
    (pool features [N, 2048], logits [N, 1008])."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b, self.Mixed_5c, self.Mixed_5d = (FIDInceptionA(192, 32), FIDInceptionA(256, 64),
                                                       FIDInceptionA(288, 64))
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b, self.Mixed_6c = FIDInceptionC(768, 128), FIDInceptionC(768, 160)
        self.Mixed_6d, self.Mixed_6e = FIDInceptionC(768, 160), FIDInceptionC(768, 192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b, self.Mixed_7c = FIDInceptionE_1(1280), FIDInceptionE_2(2048)
        self.fc = nn.Linear(FEATURE_DIM, NUM_LOGITS)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(F.max_pool2d(x, kernel_size=3, stride=2)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return f, self.fc(f)


class InceptionFileError(ValueError):
    """An Inception weights or reference-statistics file is missing or does not match."""


def _check_state_dict(state, model: nn.Module, path: Path) -> None:
    if not isinstance(state, dict):
        raise InceptionFileError(f"{str(path)!r} is not an InceptionV3 state dict: expected a dict of tensors, "
                                 f"got {type(state).__name__}")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(k for k in expected if k not in got and not k.endswith("num_batches_tracked"))
    unexpected = sorted(k for k in got if k not in expected)
    wrong = sorted((k, expected[k], got[k]) for k in expected if k in got and expected[k] != got[k])
    if missing or unexpected or wrong:
        raise InceptionFileError(
            f"{str(path)!r} does not match the FID InceptionV3 (pytorch-fid's pt_inception-2015-12-05 layout): "
            f"{len(missing)} missing (e.g. {missing[:3]!r}), {len(unexpected)} unexpected (e.g. {unexpected[:3]!r}), "
            f"{len(wrong)} with wrong shapes (name, expected, got: {wrong[:3]!r})")


def load_inception(path: str | Path) -> FIDInceptionV3:
    """Build :class:`FIDInceptionV3` from a local state-dict file (``weights_only=True``), in eval mode.

    Raises
    ------
    InceptionFileError
        If the file is missing, unreadable, or its parameter names or shapes differ from the FID network.
    """
    path = Path(path)
    if not path.is_file():
        raise InceptionFileError(f"Inception weights {str(path)!r} do not exist; download pytorch-fid's "
                                 "pt_inception-2015-12-05-6726825d.pth and pass its local path")
    state = load_weights(path, what="Inception weights file", error=InceptionFileError)
    model = FIDInceptionV3()
    _check_state_dict(state, model, path)
    model.load_state_dict(state, strict=False)  # only BatchNorm's num_batches_tracked may be absent
    return model.eval()


def _prepare_rgb(images) -> np.ndarray:
    arr = np.asarray(images)
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"expected uint8 RGB images of shape [N, H, W, 3], got dtype {str(arr.dtype)!r} "
                         f"and shape {arr.shape!r}")
    if arr.shape[0] == 0:
        raise ValueError("expected at least one image, got 0")
    return arr


@torch.no_grad()
def inception_features_and_logits(model: FIDInceptionV3, images, batch_size: int = 50
                                  ) -> tuple[np.ndarray, np.ndarray]:
    """Pool features (float64 [N, 2048]) and logits (float64 [N, 1008]) of uint8 RGB images [N, H, W, 3]."""
    arr = _prepare_rgb(images)
    model.eval()
    feats, logits = [], []
    for i in range(0, arr.shape[0], batch_size):
        x = torch.from_numpy(arr[i:i + batch_size].copy()).permute(0, 3, 1, 2).float() / 255.0
        f, lg = model(x)
        feats.append(f.double())
        logits.append(lg.double())
    return torch.cat(feats).numpy(), torch.cat(logits).numpy()


def load_inception_reference(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(mu [2048], sigma [2048, 2048])`` from a reference ``.npz`` in MAR's format (keys ``mu``, ``sigma``)."""
    path = Path(path)
    if not path.is_file():
        raise InceptionFileError(f"reference statistics {str(path)!r} do not exist (MAR ships e.g. "
                                 "fid_stats/adm_in256_stats.npz)")
    with np.load(path, allow_pickle=False) as data:
        if "mu" not in data.files or "sigma" not in data.files:
            raise InceptionFileError(f"{str(path)!r}: expected keys ['mu', 'sigma'], got {sorted(data.files)!r}")
        mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
    if mu.shape != (FEATURE_DIM,) or sigma.shape != (FEATURE_DIM, FEATURE_DIM):
        raise InceptionFileError(f"{str(path)!r}: expected mu {(FEATURE_DIM,)!r} and sigma "
                                 f"{(FEATURE_DIM, FEATURE_DIM)!r}, got {mu.shape!r} and {sigma.shape!r}")
    return mu, sigma


def fid_from_features(features, reference: tuple[np.ndarray, np.ndarray]) -> float:
    """FID of Inception pool features [N, 2048] (N >= 2) against reference ``(mu, sigma)``."""
    return frechet_distance(*feature_stats(features), *reference)


def fid_from_images(images, ref_npz: str | Path, model: FIDInceptionV3, batch_size: int = 50) -> float:
    """FID of uint8 RGB images [N, H, W, 3] against a MAR-format reference ``.npz``."""
    reference = load_inception_reference(ref_npz)
    features, _ = inception_features_and_logits(model, images, batch_size)
    return fid_from_features(features, reference)


def inception_score(logits, splits: int = 10) -> tuple[float, float]:
    """Inception Score ``exp(E_x KL(p(y|x) || p(y)))``: mean and standard deviation over ``splits`` chunks.

    Parameters
    ----------
    logits : array_like
        Classifier logits [N, K] (the FID network's 1008-way ``fc`` for the standard IS).
    splits : int
        Number of equal chunks (as in Salimans et al. 2016); 1 <= splits <= N.
    """
    lg = np.asarray(logits, dtype=np.float64)
    if lg.ndim != 2 or not 1 <= splits <= lg.shape[0]:
        raise ValueError(f"expected logits [N, K] with 1 <= splits <= N, got shape {lg.shape!r} and "
                         f"splits={splits!r}")
    log_p = lg - logsumexp(lg, axis=1, keepdims=True)
    scores = []
    for chunk in np.array_split(log_p, splits):
        log_py = logsumexp(chunk, axis=0) - np.log(chunk.shape[0])
        kl = (np.exp(chunk) * (chunk - log_py)).sum(1).mean()
        scores.append(np.exp(kl))
    return float(np.mean(scores)), float(np.std(scores))
