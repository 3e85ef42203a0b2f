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


def test_study_records_then_writes_grid_figures_and_summary(tmp_path, capsys):
    from mar_probe.analysis import open_runs
    from mar_probe.study import StudyConfig
    out = tmp_path / "study"
    argv = ["study", "--model", "mar_tiny", "--num-iter", "5", "--samples-per-seed", "2", "--seeds", "0,3",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "* CFG residual: adjacent-step MSE cond/residual = " in printed
    assert "skipped selection: no dec_k layer after the selection layer 1; the store has layer [0, 1]" in printed
    for name in ("grid.png", "summary.txt", "figures/index.html", "figures/lazymar_fig1.png",
                 "figures/marche_fig11.csv", "figures/marche_fig12.png"):
        assert (out / name).stat().st_size > 0, name
    ds = open_runs([out / "seed0.zarr", out / "seed3.zarr"])
    assert ds["label"].values.tolist() == [0, 1, 2, 3] and ds["run_seed"].values.tolist() == [0, 0, 3, 3]
    assert ds["step"].values.tolist() == list(range(5)) and ds["branch"].values.tolist() == ["cond"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["samples"] == 4 and all(r["n"] == 4 for r in summary["rows"])
    study = json.loads((out / "study.json").read_text())
    assert StudyConfig.from_dict(study["config"]).seeds == (0, 3)
    chunk = next((out / "seed0.zarr" / "dec_k").glob("c.*"))  # flat chunk keys
    before = chunk.stat().st_mtime_ns
    threads = torch.get_num_threads()
    assert main(argv + ["--threads", "1"]) == 0              # complete stores are reused, not re-recorded
    assert chunk.stat().st_mtime_ns == before and torch.get_num_threads() == threads
    assert main(argv + ["--seeds", "0,0"]) == 2
    assert "StudyConfig.seeds must be distinct non-negative integers, got (0, 0)" in capsys.readouterr().err


@pytest.mark.parametrize("kw, match", [
    (dict(samples_per_seed=0), "samples_per_seed must be a positive integer, got 0"),
    (dict(cfg=1.0), "cfg must differ from 1.0"),
    (dict(layer=-1), "layer must be a non-negative integer, got -1"),
])
def test_study_config_validates(kw, match):
    from mar_probe.study import StudyConfig
    with pytest.raises(ValueError, match=match):
        StudyConfig(**kw)
    with pytest.raises(ValueError, match=r"unknown StudyConfig field\(s\) \['sample'\]"):
        StudyConfig.from_dict({"sample": 3})
    assert StudyConfig.from_dict(StudyConfig(seeds=(4,)).to_dict()) == StudyConfig(seeds=(4,))
