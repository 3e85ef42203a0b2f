"""The command line: outputs, exit codes and messages."""
import json

import numpy as np
import pytest
import torch

from mar_probe.cli import main


def test_generate_writes_samples_and_grid(tmp_path, capsys):
    out = tmp_path / "gen"
    rc = main(["generate", "--model", "mar_tiny", "--num-samples", "3", "--labels", "4,2", "--num-iter", "4",
               "--cfg", "2.0", "--num-sampling-steps", "5", "--out", str(out)])
    assert rc == 0
    d = np.load(out / "samples.npz")
    assert d["images"].dtype == np.uint8 and d["images"].shape == (3, 8, 8, 1)
    assert d["labels"].tolist() == [4, 2, 4]
    assert d["tokens"].dtype == np.float32 and d["tokens"].shape == (3, 64, 4)
    assert (out / "grid.png").stat().st_size > 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["num_sampling_steps"] == "5" and settings["cfg"] == 2.0


@pytest.mark.parametrize("argv, match", [
    (["generate", "--model", "mar_nope"], "unknown preset 'mar_nope'"),
    (["generate", "--checkpoint", "/no/such/file.pth"], "/no/such/file.pth"),
    (["generate", "--model", "mar_tiny", "--labels", "3,10"], "label 10 is outside"),
    (["generate", "--model", "mar_tiny", "--num-iter", "0"], "num_iter must be a positive integer, got 0"),
    (["generate", "--model", "mar_tiny", "--labels", "a,b"], "--labels must be comma-separated integers"),
    (["generate", "--model", "mar_tiny", "--num-samples", "0"], "--num-samples must be >= 1"),
])
def test_bad_inputs_exit_nonzero_with_message(argv, match, capsys, tmp_path):
    rc = main(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err
    assert match in err


def test_cuda_without_cuda_exits_nonzero(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = main(["generate", "--model", "mar_tiny", "--device", "cuda", "--out", str(tmp_path)])
    assert rc == 2 and "CUDA is not available" in capsys.readouterr().err


def test_checkpoint_of_another_preset_exits_nonzero(tmp_path, capsys):
    from mar_probe import create_model
    torch.save({"model_ema": create_model("mar_tiny_latent").state_dict()}, tmp_path / "c.pth")
    rc = main(["generate", "--checkpoint", str(tmp_path / "c.pth"), "--model", "mar_tiny", "--num-iter", "2",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit model 'mar_tiny'" in err and "fits preset 'mar_tiny_latent'" in err


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--checkpoint", "--vae", "--num-iter", "--cfg-schedule", "--temperature", "--out"):
        assert flag in text
