"""Quality metrics: Fréchet golden values, Inception Score limits, classifier files, shipped artefacts, FID net."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mar_probe.data import DEFAULT_FASHION_DIR
from mar_probe.quality import (DEFAULT_CLASSIFIER_PATH, DEFAULT_REFERENCE_PATH, ClassifierConfig, ClassifierFileError,
                               FashionCNN, FIDInceptionV3, InceptionFileError, class_accuracy, feature_stats,
                               fid_from_images, format_report, frechet_distance, inception_features_and_logits,
                               inception_score, load_classifier, load_inception, load_reference_stats, quality_report,
                               save_classifier)
from mar_probe.quality import inception as inception_module
from mar_probe.quality.classifier import prepare_images, state_fingerprint

torch.set_num_threads(1)
HAVE_FASHION = (DEFAULT_FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file()
needs_fashion = pytest.mark.skipif(not HAVE_FASHION, reason=f"Fashion-MNIST not found in {DEFAULT_FASHION_DIR}")


def _rotation(theta: float) -> np.ndarray:
    return np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])


def _random_spd(rng, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


# ---------------------------------------------------------------- Fréchet distance: golden values


@pytest.mark.parametrize("mu1, s1, mu2, s2, expected", [
    (0.0, 1.0, 1.0, 4.0, 2.0),                                   # 1^2 + 1 + 4 - 2*sqrt(1*4)
    ([0.0, 0.0], np.diag([1.0, 4.0]), [1.0, 2.0], np.diag([4.0, 9.0]), 7.0),   # 5 + 18 - 2*(2+6)
    ([3.0, -1.0], np.eye(2), [3.0, -1.0], np.eye(2), 0.0),
    ([0.0, 0.0], np.diag([1.0, 0.0]), [0.0, 0.0], np.diag([1.0, 0.0]), 0.0),  # singular product
    ([0.0, 0.0], np.diag([1.0, 0.0]), [0.0, 0.0], np.diag([0.0, 1.0]), 2.0),  # S1 S2 = 0
    ([0.0, 0.0], np.zeros((2, 2)), [1.0, 1.0], np.diag([4.0, 9.0]), 15.0),    # point mass: 2 + 13
])
def test_frechet_golden_values_both_ways(mu1, s1, mu2, s2, expected):
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, abs=1e-5)
    assert frechet_distance(mu2, s2, mu1, s1) == pytest.approx(expected, abs=1e-5)


def test_frechet_commuting_non_diagonal():
    r = _rotation(0.7)
    s1, s2 = r @ np.diag([1.0, 4.0]) @ r.T, r @ np.diag([9.0, 1.0]) @ r.T
    # sqrt(S1 S2) = R diag(3, 2) R^T: 0 + 5 + 10 - 2*5 = 5
    assert frechet_distance([0, 0], s1, [0, 0], s2) == pytest.approx(5.0, abs=1e-9)


def test_frechet_identical_random_gaussian_is_zero_and_matches_symmetric_formula():
    rng = np.random.default_rng(0)
    mu, s1, s2 = rng.normal(size=6), _random_spd(rng, 6), _random_spd(rng, 6)
    assert frechet_distance(mu, s1, mu, s1) == pytest.approx(0.0, abs=1e-8)
    w, v = np.linalg.eigh(s1)
    root1 = v @ np.diag(np.sqrt(w)) @ v.T  # tr sqrt(S1 S2) = tr sqrt(S1^1/2 S2 S1^1/2), a symmetric PSD matrix
    tr_cov = np.sqrt(np.clip(np.linalg.eigvalsh(root1 @ s2 @ root1), 0, None)).sum()
    expected = np.trace(s1) + np.trace(s2) - 2 * tr_cov
    assert frechet_distance(mu, s1, mu, s2) == pytest.approx(expected, rel=1e-9)
    assert frechet_distance(mu, s2, mu, s1) == pytest.approx(expected, rel=1e-9)


def test_frechet_rejects_bad_shapes():
    with pytest.raises(ValueError, match="different dimensions"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match=r"expected mu \[D\] and sigma \[D, D\]"):
        frechet_distance(np.zeros(2), np.eye(3), np.zeros(2), np.eye(2))


def test_feature_stats_and_sampled_gaussians():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(20000, 2)) * [1.0, 2.0]
    y = rng.normal(size=(20000, 2)) * [2.0, 3.0] + [1.0, 0.0]
    mu, sigma = feature_stats(x)
    np.testing.assert_allclose(sigma, np.cov(x, rowvar=False))
    # exact: 1 + (1 + 4) + (4 + 9) - 2*(2 + 6) = 3
    assert frechet_distance(mu, sigma, *feature_stats(y)) == pytest.approx(3.0, abs=0.15)
    with pytest.raises(ValueError, match="N >= 2"):
        feature_stats(np.zeros((1, 4)))


# ---------------------------------------------------------------- Inception Score


def test_inception_score_limits():
    assert inception_score(np.zeros((20, 1008)), splits=2) == pytest.approx((1.0, 0.0))
    mean, std = inception_score(60.0 * np.eye(10), splits=1)  # each image sure of a different class
    assert mean == pytest.approx(10.0, rel=1e-6) and std == 0.0
    mean, _ = inception_score(60.0 * np.tile(np.eye(10), (4, 1)), splits=4)
    assert mean == pytest.approx(10.0, rel=1e-6)
    with pytest.raises(ValueError, match="splits"):
        inception_score(np.zeros((3, 5)), splits=4)


# ---------------------------------------------------------------- classifier files

TINY = ClassifierConfig(channels=(4, 8, 8), feature_dim=16)


def test_classifier_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = FashionCNN(TINY).eval()
    path = save_classifier(tmp_path / "clf.pt", model, test_accuracy=0.5, train_config={"epochs": 1})
    loaded = load_classifier(path)
    assert loaded.config == TINY and loaded.test_accuracy == 0.5 and not loaded.training
    assert loaded.fingerprint == state_fingerprint(model.state_dict())
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28, 1), dtype=np.uint8)
    x = prepare_images(images)
    torch.testing.assert_close(loaded(x), model(x))
    assert loaded.features(x).shape == (5, 16)


def test_classifier_file_errors(tmp_path):
    model = FashionCNN(TINY)
    path = save_classifier(tmp_path / "clf.pt", model, test_accuracy=0.5)
    payload = torch.load(path, weights_only=True)
    payload["config"]["feature_dim"] = 32  # weights no longer fit the declared architecture
    torch.save(payload, tmp_path / "mismatch.pt")
    with pytest.raises(ClassifierFileError, match="do not match the classifier architecture"):
        load_classifier(tmp_path / "mismatch.pt")
    torch.save(model.state_dict(), tmp_path / "bare.pt")  # a plain state dict, no mar_probe header
    with pytest.raises(ClassifierFileError, match="is not a mar_probe classifier"):
        load_classifier(tmp_path / "bare.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ClassifierFileError, match="is not a PyTorch weights file"):
        load_classifier(tmp_path / "junk.pt")
    with pytest.raises(ClassifierFileError, match="does not exist"):
        load_classifier(tmp_path / "absent.pt")


def test_wrong_images_are_rejected():
    model = FashionCNN(TINY)
    with pytest.raises(ValueError, match=r"28x28 grayscale.*got shape \(2, 32, 32\)"):
        class_accuracy(np.zeros((2, 32, 32), np.uint8), np.zeros(2, np.int64), model)
    with pytest.raises(ValueError, match="uint8"):
        prepare_images(np.zeros((2, 28, 28), np.float32))
    with pytest.raises(ValueError, match=r"28x28 grayscale images .* or RGB images"):
        quality_report((np.zeros((2, 32, 32, 1), np.uint8), np.zeros(2, np.int64)), classifier=model)
    with pytest.raises(ValueError, match="inception_weights"):
        quality_report((np.zeros((2, 64, 64, 3), np.uint8), np.zeros(2, np.int64)))


# ---------------------------------------------------------------- shipped classifier and statistics


def test_shipped_reference_stats_shapes():
    ref = load_reference_stats(DEFAULT_REFERENCE_PATH)
    assert ref["mu"].shape == (128,) and ref["sigma"].shape == (128, 128)
    np.testing.assert_allclose(ref["sigma"], ref["sigma"].T)
    assert list(ref["floor_sizes"]) == sorted(ref["floor_sizes"]) and ref["floor_fd"].shape == ref["floor_sizes"].shape
    assert np.all(ref["floor_fd"] > 0) and np.all(np.diff(ref["floor_fd"]) < 0)  # bias falls with n
    assert ref["classifier_fingerprint"] == load_classifier(DEFAULT_CLASSIFIER_PATH).fingerprint
    assert DEFAULT_CLASSIFIER_PATH.stat().st_size < 2_000_000


@needs_fashion
def test_shipped_classifier_accuracy_and_report(tmp_path):
    from mar_probe.data import load_fashion_mnist
    images, labels = load_fashion_mnist("test")
    classifier = load_classifier(DEFAULT_CLASSIFIER_PATH)
    assert classifier.test_accuracy >= 0.90
    assert class_accuracy(images[:1000], labels[:1000], classifier) > 0.85
    np.savez(tmp_path / "samples.npz", images=images[:1000, :, :, None], labels=labels[:1000])
    report = quality_report(tmp_path / "samples.npz")
    assert report["kind"] == "fashion" and report["num_images"] == 1000 and report["class_accuracy"] > 0.85
    assert report["frechet_floor_num_images"] == 1000 and 0 < report["frechet_ratio"] < 3
    assert set(report["per_class_accuracy"]) >= {"T-shirt/top", "Ankle boot"}
    assert "class-conditional accuracy" in format_report(report)
    with pytest.raises(ValueError, match="another classifier"):
        quality_report((images[:10], labels[:10]), classifier=FashionCNN())


# ---------------------------------------------------------------- FID InceptionV3 (random weights)

PYTORCH_FID_KEYS = {"Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3), "Conv2d_4a_3x3.bn.running_var": (192,),
                    "Mixed_5b.branch_pool.conv.weight": (32, 192, 1, 1),
                    "Mixed_6e.branch7x7dbl_5.conv.weight": (192, 192, 1, 7),
                    "Mixed_7a.branch7x7x3_4.conv.weight": (192, 192, 3, 3),
                    "Mixed_7c.branch3x3dbl_3b.bn.bias": (384,), "fc.weight": (1008, 2048), "fc.bias": (1008,)}


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    torch.manual_seed(0)
    model = FIDInceptionV3()
    path = tmp_path_factory.mktemp("inception") / "pt_inception_random.pth"
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, path)  # the pytorch-fid file has no num_batches_tracked entries either
    return path, state


def test_inception_parameter_names_follow_pytorch_fid(inception_file):
    _, state = inception_file
    for name, shape in PYTORCH_FID_KEYS.items():
        assert tuple(state[name].shape) == shape, name
    assert not any(k.startswith("AuxLogits") for k in state)


def test_inception_random_weights_two_images(inception_file, tmp_path, monkeypatch):
    path, _ = inception_file
    model = load_inception(path)
    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    feats, logits = inception_features_and_logits(model, images)
    assert feats.shape == (2, 2048) and logits.shape == (2, 1008)
    assert np.isfinite(feats).all() and np.isfinite(logits).all() and (feats >= 0).all()
    np.savez(tmp_path / "ref.npz", mu=np.zeros(2048, np.float32), sigma=np.eye(2048, dtype=np.float32))
    seen = {}
    monkeypatch.setattr(inception_module, "frechet_distance",  # a 2048-d sqrtm takes ~1 min on one core
                        lambda mu1, s1, mu2, s2: seen.update(shapes=(mu1.shape, s1.shape, mu2.shape, s2.shape)) or 1.5)
    assert fid_from_images(images, tmp_path / "ref.npz", model) == 1.5
    assert seen["shapes"] == ((2048,), (2048, 2048), (2048,), (2048, 2048))
    np.savez(tmp_path / "samples.npz", images=images[:1], labels=np.zeros(1, np.int64))
    report = quality_report(tmp_path / "samples.npz", inception_weights=path)
    assert report["kind"] == "imagenet" and report["fid"] is None
    assert report["inception_score"] == pytest.approx(1.0) and report["inception_score_splits"] == 1
    assert "Inception Score" in format_report(report)


def test_inception_file_errors(inception_file, tmp_path):
    _, state = inception_file
    broken = dict(state)
    broken["fc.weight"] = torch.zeros(1000, 2048)
    del broken["Mixed_7c.branch_pool.conv.weight"]
    torch.save(broken, tmp_path / "broken.pth")
    with pytest.raises(InceptionFileError, match=r"1 missing .*1 with wrong shapes"):
        load_inception(tmp_path / "broken.pth")
    with pytest.raises(InceptionFileError, match="do not exist"):
        load_inception(tmp_path / "absent.pth")
    np.savez(tmp_path / "bad_ref.npz", mean=np.zeros(3))
    with pytest.raises(InceptionFileError, match=r"expected keys \['mu', 'sigma'\]"):
        fid_from_images(np.zeros((2, 8, 8, 3), np.uint8), tmp_path / "bad_ref.npz", None)
