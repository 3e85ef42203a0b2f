"""Ablations (issue 15 items 3-4): the LazyMAR attribution and MARché's selection rules against attention.

The arms and their options, the scaled head interval, a tiny end-to-end run of each ``mar-probe ablate`` command
(a perturbed mar_tiny checkpoint, 3 images x 2 seeds, a few steps) checked against ``paired_difference``
recomputed from the saved samples, and bad inputs refused before a model is even built.
"""
import json

import numpy as np
import pytest
import torch

from mar_probe import cli
from mar_probe.ablation import (CACHES, head_step_count, lazymar_attribution_runs, scaled_head_interval,
                                selection_runs)
from mar_probe.compare import CompareConfig, StrategyRun, _file_label, paired_difference, run_strategy
from mar_probe.quality.paired import paired_fidelity

ARMS = ["token", "condition", "head", "token+condition", "token+head", "condition+head", "lazymar"]


# ---- the arms ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, interval", [(100, 7), (50, 4), (10, 1), (5, 1), (64, 4), (150, 11), (1, 1),
                                             (250, 18), (1000, 70)])
def test_scaled_head_interval(steps, interval):
    """max(1, round(7 K / 100)), halves rounded up (50 -> 3.5 -> 4, 150 -> 10.5 -> 11, 250 -> 17.5 -> 18)."""
    assert scaled_head_interval(steps) == interval


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "50"])
def test_scaled_head_interval_refuses_bad_steps(bad):
    with pytest.raises(ValueError, match=rf"head_steps must be an integer >= 1, got {bad!r}"):
        scaled_head_interval(bad)


def test_head_step_count():
    assert head_step_count("50") == 50 and head_step_count("25,25") == 50 and head_step_count(100) == 100
    with pytest.raises(ValueError, match=r"head steps must be >= 1 in every section, got '0'"):
        head_step_count("0")
    with pytest.raises(ValueError, match="head steps must be a count"):
        head_step_count("ddim50")


@pytest.mark.parametrize("steps, interval", [(None, 7), (100, 7), (50, 4), (10, 1), (5, 1)])
def test_lazymar_attribution_arms_have_exactly_their_flags(steps, interval):
    runs = lazymar_attribution_runs(head_steps=steps)
    assert [r.label for r in runs] == ARMS and {r.name for r in runs} == {"lazymar"}
    for r in runs:
        on = set(CACHES) if r.label == "lazymar" else set(r.label.split("+"))
        assert dict(r.options) == {"token_cache": "token" in on, "condition_cache": "condition" in on,
                                   "head_cache": "head" in on, "head_interval": interval}


def test_all_three_caches_at_100_head_steps_is_plain_lazymar():
    lazymar = lazymar_attribution_runs(head_steps=100)[-1]
    assert lazymar.create().to_dict() == StrategyRun(label="x", name="lazymar").create().to_dict()


def test_lazymar_attribution_options():
    runs = lazymar_attribution_runs(head_steps=50, base_options={"refresh_interval": 5})
    assert all(dict(r.options)["refresh_interval"] == 5 and dict(r.options)["head_interval"] == 4 for r in runs)
    fixed = lazymar_attribution_runs(head_steps=50, scale_head_interval=False)
    assert {dict(r.options)["head_interval"] for r in fixed} == {7}                     # the released value
    given = lazymar_attribution_runs(head_steps=50, base_options={"head_interval": 3}, scale_head_interval=False)
    assert {dict(r.options)["head_interval"] for r in given} == {3}
    with pytest.raises(ValueError, match=r"head_interval 3 given while the head interval is scaled"):
        lazymar_attribution_runs(head_steps=50, base_options={"head_interval": 3})
    with pytest.raises(ValueError, match=r"cache flags are the arms .* got \['head_cache'\]"):
        lazymar_attribution_runs(base_options={"head_cache": False})
    with pytest.raises(ValueError, match="head_steps must be an integer >= 1, got 0"):
        lazymar_attribution_runs(head_steps=0)
    with pytest.raises(ValueError, match="has no option"):
        lazymar_attribution_runs(base_options={"refresh": 3})


def test_selection_arms():
    runs = selection_runs()
    assert [r.label for r in runs] == ["attention@32", "random@32", "low-attention@32", "oracle@32",
                                       "attention@64", "random@64", "low-attention@64", "oracle@64"]
    assert all(r.name == "marche" for r in runs)
    assert dict(runs[2].options) == {"budget": 32, "selection": "low-attention"}
    # attention, the reference, is added when left out; base options reach every arm
    runs = selection_runs((8,), ("random",), {"refresh_period": 2})
    assert [r.label for r in runs] == ["attention@8", "random@8"]
    assert dict(runs[1].options) == {"budget": 8, "selection": "random", "refresh_period": 2}


@pytest.mark.parametrize("kwargs, match", [
    (dict(selections=("attention", "top-k")),
     r"unknown selection rule 'top-k'; expected some of \('attention', 'low-attention', 'random', 'oracle'\)"),
    (dict(budgets=(32, 0)), "budget must be an integer >= 1, got 0"),
    (dict(budgets=(-1,)), "budget must be an integer >= 1, got -1"),
    (dict(budgets=(32, 32)), r"budgets must be distinct, got \(32, 32\)"),
    (dict(budgets=()), "at least one budget"),
    (dict(base_options={"budget": 3}), r"the arms set \['budget'\]"),
])
def test_selection_runs_refuse_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        selection_runs(**kwargs)


# ---- end to end: mar-probe ablate on a perturbed mar_tiny ----------------------------------------------------
HEAD_STEPS = "30"  # scaled head interval 2: the head cache skips every other reverse step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import perturbed_tiny
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save({"model_ema": perturbed_tiny().state_dict()}, path)
    return path


def _flags(checkpoint):
    return ["--checkpoint", str(checkpoint), "--model", "mar_tiny", "--num-samples", "3", "--seeds", "0,1",
            "--num-iter", "8", "--cfg", "3.0", "--num-sampling-steps", HEAD_STEPS, "--grid-images", "2",
            "--worst", "2"]


@pytest.fixture(scope="module")
def lazymar_run(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "lazymar"
    # mar_tiny's decoder has 2 layers: prune after layer 1; warm-up 1 and refresh every 3rd step let every cache act
    assert cli.main(["ablate", "lazymar", *_flags(checkpoint), "--strategy-opt", "prune_layer=1",
                     "--strategy-opt", "warmup_steps=1", "--strategy-opt", "refresh_interval=3",
                     "--strategy-opt", "min_extra_tokens=2", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def marche_run(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "marche"
    # selection after layer 0: mar_tiny's second layer is cached
    assert cli.main(["ablate", "marche-selection", *_flags(checkpoint), "--budgets", "8,16",
                     "--strategy-opt", "selection_layer=0", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def _saved(out, label, seeds=(0, 1)):
    """The per-seed samples the command saved (OUT/partial/LABEL.seedS.npz)."""
    runs = []
    for seed in seeds:
        with np.load(out / "partial" / f"{_file_label(label)}.seed{seed}.npz") as f:
            runs.append({k: f[k] for k in f.files})
    return runs


def _fidelity(out, label):
    full = _saved(out, "full")
    return [paired_fidelity(s["tokens"], f["tokens"], s["images"], f["images"]) for s, f in zip(_saved(out, label),
                                                                                                 full)]


def _same(got: dict, want: dict):
    assert got["against"] == want["against"]
    for metric in ("token_mse", "token_cos", "psnr", "ssim"):
        for key in ("mean", "lo", "hi", "n", "clipped"):
            assert got[metric][key] == pytest.approx(want[metric][key], rel=1e-12, abs=1e-12), (metric, key)


def test_ablate_lazymar_runs_every_arm_with_the_scaled_head_interval(lazymar_run):
    out, data = lazymar_run
    s = data["strategies"]
    assert list(s) == ["full"] + ARMS
    ab = data["ablation"]
    assert (ab["kind"], ab["head_steps"], ab["head_interval"], ab["head_interval_scaled"]) == \
        ("lazymar-attribution", 30, 2, True)
    for label in ARMS:
        config = s[label]["config"]
        on = set(CACHES) if label == "lazymar" else set(label.split("+"))
        assert {c: config[f"{c}_cache"] for c in CACHES} == {c: c in on for c in CACHES}
        assert config["head_interval"] == 2 and config["prune_layer"] == 1
        assert s[label]["fidelity"]["token_mse"]["mean"] > 0                     # every cache changes something
        assert s[label]["speedup"]["flops"]["mean"] > 1
    assert data["command"].startswith("mar-probe ablate lazymar")
    assert ab["notes"] == ["6 paired images per arm over 2 seed(s): below the n >= 200 over >= 3 seeds a claim "
                           "needs (issue 15); read the intervals as a smoke test"]


def test_ablate_lazymar_paired_differences_match_the_saved_samples(lazymar_run):
    out, data = lazymar_run
    s = data["strategies"]
    fid = {label: _fidelity(out, label) for label in ["full"] + ARMS}
    for label in ["full"] + ARMS[:-1]:
        _same(s[label]["paired"], paired_difference(fid[label], fid["lazymar"], "lazymar"))
    assert "paired" not in s["lazymar"]
    rows = data["ablation"]["rows"]
    assert sorted(r["label"] for r in rows) == sorted(ARMS)
    psnr = [r["vs_full"]["mean"] for r in rows]
    assert psnr == sorted(psnr)                                                  # largest fidelity loss first
    for r in rows:
        want = np.concatenate([d["psnr"].values for d in fid[r["label"]]])
        assert r["vs_full"]["mean"] == pytest.approx(want.mean()) and r["vs_full"]["n"] == 6
        assert r["vs_lazymar"] == (None if r["label"] == "lazymar" else
                                   {k: s[r["label"]]["paired"]["psnr"][k] for k in r["vs_lazymar"]})
    assert any(v.startswith("alone, the ") for v in data["ablation"]["verdict"])
    csv = (out / "ablation.csv").read_text().splitlines()
    assert len(csv) == 8 and "vs_lazymar_lo" in csv[0].split(",")


def test_ablate_lazymar_all_three_caches_equal_plain_lazymar_bit_for_bit(lazymar_run, checkpoint):
    from mar_probe.models.checkpoints import load_model
    out, data = lazymar_run
    config = CompareConfig.from_dict(data["settings"])
    model = load_model(checkpoint, preset="mar_tiny", num_sampling_steps=config.head_steps)
    plain = StrategyRun(label="plain", name="lazymar", options=(("prune_layer", 1), ("warmup_steps", 1),
                                                                ("refresh_interval", 3), ("min_extra_tokens", 2),
                                                                ("head_interval", 2)))
    labels = config.label_array(model.num_classes)
    for seed, saved in zip(config.seeds, _saved(out, "lazymar")):
        got = run_strategy(model, plain, labels, seed, config)
        assert np.array_equal(got.tokens, saved["tokens"]) and got.flops == int(saved["flops"])


def test_ablate_lazymar_figures(lazymar_run):
    from matplotlib.image import imread

    from mar_probe.plot.ablation import WORST_DPI, worst_figsize
    out, data = lazymar_run
    assert (out / "attribution.png").stat().st_size > 0 and (out / "grid.png").stat().st_size > 0
    w, h = worst_figsize(7, 2)
    assert imread(out / "worst.png").shape[:2] == (round(h * WORST_DPI), round(w * WORST_DPI))


def test_ablate_marche_selection_pairs_each_arm_with_attention_at_its_budget(marche_run):
    out, data = marche_run
    s = data["strategies"]
    arms = [f"{sel}@{b}" for b in (8, 16) for sel in ("attention", "random", "low-attention", "oracle")]
    assert list(s) == ["full"] + arms
    fid = {label: _fidelity(out, label) for label in ["full"] + arms}
    for label in arms:
        sel, budget = label.split("@")
        assert (s[label]["config"]["selection"], s[label]["config"]["budget"]) == (sel, int(budget))
        if sel == "attention":
            assert "paired" not in s[label]
            continue
        ref = f"attention@{budget}"
        _same(s[label]["paired"], paired_difference(fid[label], fid[ref], ref))
        assert s[label]["paired"]["psnr"]["n"] == 6                              # 3 images x 2 seeds
    assert "paired" not in s["full"]
    rows = {r["label"]: r for r in data["ablation"]["rows"]}
    assert rows["random@16"]["vs_attention"]["mean"] == s["random@16"]["paired"]["psnr"]["mean"]
    assert rows["attention@8"]["vs_attention"] is None
    assert (data["ablation"]["budgets"], data["ablation"]["reference"]) == ([8, 16], "attention")


def test_ablate_marche_selection_worst_images(marche_run):
    import pandas as pd
    from matplotlib.image import imread

    from mar_probe.plot.ablation import WORST_DPI, worst_figsize
    out, data = marche_run
    w, h = worst_figsize(8, 2)                                                     # 8 arms x 2 worst images
    assert imread(out / "worst.png").shape[:2] == (round(h * WORST_DPI), round(w * WORST_DPI))
    assert (out / "selection.png").stat().st_size > 0
    worst = pd.read_csv(out / "worst.csv")
    assert len(worst) == 16 and list(worst.groupby("label", sort=False).size()) == [2] * 8
    for label, g in worst.groupby("label"):
        per_image = np.concatenate([d["psnr"].values for d in _fidelity(out, label)])
        assert g["psnr"].tolist() == pytest.approx(sorted(per_image)[:2])     # the two lowest, lowest first


def test_figures_pass_the_lint_when_it_exists(lazymar_run, marche_run):
    lint = pytest.importorskip("mar_probe.plot.lint")
    import matplotlib.pyplot as plt

    from mar_probe.plot.ablation import attribution_plot, selection_plot
    for plot, (_, data) in ((attribution_plot, lazymar_run), (selection_plot, marche_run)):
        ax = plot(data["ablation"]["rows"])
        lint.check_figure(ax.figure, plot.__name__)
        plt.close(ax.figure)


# ---- bad input: refused before a model is built ---------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    def refuse(args):
        raise AssertionError("a model was built: the input should have been refused before")
    monkeypatch.setattr(cli, "build_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["marche-selection", "--selections", "attention,top-k"],
     "unknown selection rule 'top-k'; expected some of ('attention', 'low-attention', 'random', 'oracle')"),
    (["marche-selection", "--budgets", "32,0"], "budget must be an integer >= 1, got 0"),
    (["marche-selection", "--budgets", "32,x"], "--budgets must be comma-separated integers, got '32,x'"),
    (["lazymar", "--num-sampling-steps", "0"], "head steps must be >= 1 in every section, got '0'"),
    (["lazymar", "--strategy-opt", "head_cache=false"], "cache flags are the arms of the attribution"),
    (["lazymar", "--strategy-opt", "head_interval=3"], "head_interval 3 given while the head interval is scaled"),
    (["lazymar", "--worst", "-1"], "--worst must be >= 0, got -1"),
])
def test_ablate_refuses_bad_input_before_sampling(argv, message, no_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["ablate", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_ablate_lazymar_without_scaling_keeps_the_given_interval(no_model, tmp_path, capsys):
    """--no-scale-head-interval lets head_interval be set by hand (checked, then the model would load)."""
    with pytest.raises(AssertionError, match="a model was built"):
        cli.main(["ablate", "lazymar", "--no-scale-head-interval", "--strategy-opt", "head_interval=3",
                  "--out", str(tmp_path)])


def test_ablate_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ablate", "marche-selection", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "70 images x seeds 0,1,2 = 210 paired images per arm" in text
    assert "(default: 32,64)" in text and "(default: attention,random,low-attention,oracle)" in text
    args = cli.make_parser().parse_args(["ablate", "lazymar"])
    assert (args.num_samples, args.seeds, args.worst) == (70, "0,1,2", 4)
