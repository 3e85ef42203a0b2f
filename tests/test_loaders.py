"""Every weight loader refuses code-carrying files, and explains unreadable ones, in one line (issue 19)."""
import numpy as np

import pytest
import torch

from mar_probe import load_model
from mar_probe.models.checkpoints import CheckpointError
from mar_probe.models.vae import VAEFileError, load_vae
from mar_probe.quality import ClassifierFileError, InceptionFileError, load_classifier, load_inception


class _Payload:
    """Unpickling it would create a marker file: no loader may ever do that."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


LOADERS = [(load_model, CheckpointError, "checkpoint"), (load_vae, VAEFileError, "VAE checkpoint"),
           (load_classifier, ClassifierFileError, "classifier file"),
           (load_inception, InceptionFileError, "Inception weights file")]
IDS = [w for _, _, w in LOADERS]


@pytest.mark.parametrize("loader, error, what", LOADERS, ids=IDS)
def test_payload_is_refused_untrusted_and_never_runs(tmp_path, loader, error, what):
    marker = tmp_path / "marker"
    path = tmp_path / "payload.pth"
    torch.save({"model": _Payload(marker), "model_ema": _Payload(marker)}, path)
    with pytest.raises(error) as info:
        loader(path)
    text = str(info.value)
    assert f"{what} {str(path)!r} is refused as untrusted" in text and "global 'io.open'" in text
    assert "weights_only=False" not in text and info.value.__cause__ is None and info.value.__suppress_context__
    assert not marker.exists()


FOREIGN = [(b"", "the file is empty or truncated"), (np.random.default_rng(0).bytes(4096), "no torch.save archive")]


@pytest.mark.parametrize("content, reason", FOREIGN, ids=["empty", "random"])
@pytest.mark.parametrize("loader, error, what", LOADERS, ids=IDS)
def test_foreign_bytes_get_one_line(tmp_path, loader, error, what, content, reason):
    path = tmp_path / "file.pth"
    path.write_bytes(content)
    with pytest.raises(error, match=reason) as info:
        loader(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value) and "weights_only" not in str(info.value)


def test_a_dict_without_model_weights_is_named(tmp_path):
    path = tmp_path / "ints.pth"
    torch.save({"epoch": 3, "lr": 0.1}, path)
    with pytest.raises(CheckpointError, match=r"holds no model weights: .* got keys \['epoch', 'lr'\]"):
        load_model(path)
    with pytest.raises(VAEFileError, match="holds no state dict of tensors"):
        load_vae(path)


def test_training_resume_from_a_payload_checkpoint_is_refused(tmp_path):
    from mar_probe.train import TrainConfig, train
    marker = tmp_path / "marker"
    torch.save({"model": _Payload(marker)}, tmp_path / "checkpoint-last.pth")
    cfg = TrainConfig(preset="mar_tiny", dataset="digits", out_dir=str(tmp_path), iters=1, batch_size=4, amp="none")
    with pytest.raises(CheckpointError, match="refused as untrusted"):
        train(cfg)
    assert not marker.exists()
