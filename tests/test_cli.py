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
    (["generate", "--model", "mar_tiny", "--num-iter", "0"], "error: --num-iter must be a positive integer, got 0"),
    (["generate", "--model", "mar_tiny", "--labels", "a,b"], "--labels must be comma-separated integers"),
    (["generate", "--model", "mar_tiny", "--num-samples", "0"], "--num-samples must be >= 1"),
    # issue 19: nonsense was accepted, or refused only after something was written
    (["generate", "--model", "mar_tiny", "--cfg", "nan"], "error: --cfg must be a finite number >= 1, got nan"),
    (["generate", "--model", "mar_tiny", "--temperature", "inf"],
     "error: --temperature must be a finite number > 0, got inf"),
    (["generate", "--model", "mar_tiny", "--temperature", "-1"],
     "error: --temperature must be a finite number > 0, got -1.0"),
    (["record", "--model", "mar_tiny", "--num-iter", "2", "--queue-size", "0"],
     "error: --queue-size must be an integer >= 1"),
    (["record", "--model", "mar_tiny", "--num-iter", "2", "--repair"], "give it with --resume"),
    (["compare", "--num-samples", "1", "--num-iter", "2"],
     "error: --num-samples must be >= 2 for the Frechet distance"),
    (["train", "--preset", "mar_tiny", "--dataset", "digits", "--max-minutes", "-1"],
     "error: --max-minutes must be a finite"),
    # issue 18: errors name the flag, and torch's own messages are replaced by ones that list the valid values
    (["generate", "--model", "mar_tiny", "--device", "bogus"], "error: unknown device 'bogus'; expected 'cpu', 'cuda'"),
    (["generate", "--model", "mar_tiny", "--num-sampling-steps", "abc"],
     "error: --num-sampling-steps: head steps must be a count such as '100' or per-section counts such as '25,25', "
     "got 'abc'"),
])
def test_bad_inputs_exit_nonzero_with_message(argv, match, capsys, tmp_path):
    rc = main(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "Traceback" not in err
    assert match in err
    assert not (tmp_path / "x").exists()  # nothing is written before a check fails


def test_unexpected_errors_keep_their_traceback(monkeypatch, tmp_path):
    """Only expected errors (bad input, a failed write) become one line: a bug's KeyError is not hidden (issue 18)."""
    from mar_probe import api

    def broken(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(api, "sample", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["generate", "--model", "mar_tiny", "--num-iter", "2", "--out", str(tmp_path / "x")])


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
    page = (out / "index.html").read_text()                  # the whole study on one page (issue 15)
    figures = sorted(p.stem for p in (out / "figures").glob("*.png"))
    import html
    assert "<img src='grid.png'" in page and html.escape((out / "summary.txt").read_text().splitlines()[0]) in page
    assert figures and all(f"<img src='figures/{name}.png'" in page for name in figures)
    study = json.loads((out / "study.json").read_text())
    assert StudyConfig.from_dict(study["config"]).seeds == (0, 3)
    chunk = next((out / "seed0.zarr" / "dec_k").glob("c.*"))  # flat chunk keys
    before = chunk.stat().st_mtime_ns
    threads = torch.get_num_threads()
    assert main(argv + ["--threads", "1"]) == 0              # complete stores are reused, not re-recorded
    assert chunk.stat().st_mtime_ns == before and torch.get_num_threads() == threads
    assert main(argv + ["--seeds", "0,0"]) == 2
    assert "error: --seeds must be distinct non-negative integers, got (0, 0)" in capsys.readouterr().err


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


def test_bad_spec_and_damaged_metadata_get_one_line(tmp_path, capsys):
    bad = tmp_path / "spec.yaml"
    bad.write_text("variables: [dec_k\n  - : :")
    assert main(["record", "--model", "mar_tiny", "--spec", str(bad), "--out", str(tmp_path / "s.zarr")]) == 2
    assert "is not valid YAML at line 2, column 5" in capsys.readouterr().err
    store = tmp_path / "run.zarr"
    assert main(["record", "--model", "mar_tiny", "--num-samples", "2", "--num-iter", "2", "--cfg", "2.0",
                 "--vars", "dec_k", "--out", str(store)]) == 0
    capsys.readouterr()
    for meta in (store / "dec_k" / "zarr.json", store / "zarr.json"):
        meta.write_text(meta.read_text()[:25])  # truncated
        assert main(["analyze", str(store)]) == 2
        err = capsys.readouterr().err
        assert f"its metadata file {str(meta)!r} is not valid JSON" in err and "--overwrite" in err
        assert "Traceback" not in err


def test_ctrl_c_says_what_is_saved_and_exits_130(tmp_path, capsys, monkeypatch):
    import sys
    from mar_probe import compare as compare_module
    record_module = sys.modules["mar_probe.probe.record"]  # the package re-exports the function of that name
    calls = []
    real_run = compare_module.run_strategy

    def second_run_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)
    monkeypatch.setattr(compare_module, "run_strategy", second_run_interrupted)
    argv = ["compare", "--model", "mar_tiny", "--num-samples", "2", "--num-iter", "2", "--cfg", "3.0",
            "--strategies", "full,marche", "--out", str(tmp_path / "c")]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "mar-probe compare: interrupted; 1 of 2 (strategy, seed) runs are saved in" in err
    assert "rerun with --resume" in err and "Traceback" not in err

    def unit_interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(record_module, "_run_unit", unit_interrupted)
    assert main(["record", "--model", "mar_tiny", "--num-samples", "2", "--num-iter", "2", "--cfg", "3.0",
                 "--vars", "dec_k", "--out", str(tmp_path / "r.zarr")]) == 130
    err = capsys.readouterr().err
    assert "mar-probe record: interrupted; 0 of 4 steps saved in" in err and "--resume" in err
