"""mar-probe tune: the fastest configuration meeting a fidelity target, checked on held-out seeds (issue 17 item 3)."""
import json

import pytest
import torch

from mar_probe import cli
from mar_probe.compare import CompareConfig, StrategyRun, compare, sweep_runs
from mar_probe.engine.sampling import SamplingConfig
from mar_probe.tune import (KNOBS, Evaluation, FidelityTarget, Interval, TargetUnreachableError, TuneConfig,
                            TuneResult, fastest_meeting, tune)

SAMPLING = SamplingConfig(num_iter=8, cfg=3.0)
BUDGETS = (8, 16, 32, 48, 64)
CAL, HELD = (0, 1), (2, 3)


@pytest.fixture(scope="module")
def tiny():
    from conftest import perturbed_tiny
    return perturbed_tiny(encoder_depth=3, decoder_depth=4, num_sampling_steps="4")


def _config(**kw):
    base = dict(family="marche", target="psnr>=45", space=(("budget", BUDGETS),), num_samples=2,
                calibration_seeds=CAL, heldout_seeds=HELD, sampling=SAMPLING)
    return TuneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def brute(tiny):
    """The brute force: every budget of the grid on the calibration seeds through ``compare``."""
    config = CompareConfig(runs=sweep_runs("marche", {"budget": list(BUDGETS)}), num_samples=2, seeds=CAL,
                           num_iter=8, cfg=3.0)
    return compare(tiny, config, progress=False).results["strategies"]


def _fastest_meeting(strategies: dict, metric: str, value: float) -> str:
    ok = [lab for lab, e in strategies.items() if lab != "full" and e["fidelity"][metric]["mean"] >= value]
    return max(ok, key=lambda lab: strategies[lab]["speedup"]["flops"]["mean"])


def test_tune_meets_its_target_on_heldout_seeds_with_the_brute_force_choice(tiny, brute):
    result = tune(tiny, _config(), progress=False)
    assert result.chosen.run.label == _fastest_meeting(brute, "psnr", 45.0)
    for e in result.candidates:                                     # the same paired numbers as compare's
        assert e.metric("psnr").mean == pytest.approx(brute[e.run.label]["fidelity"]["psnr"]["mean"])
        assert e.speedup_flops.mean == pytest.approx(brute[e.run.label]["speedup"]["flops"]["mean"])
    assert len(result.candidates) < len(BUDGETS)                     # bisection: not every candidate ran
    held = result.heldout
    assert held.seeds == HELD and held.run == result.chosen.run and held.metric("psnr").n == 4
    assert held.metric("psnr").mean >= 45.0 and result.met is True
    assert held.metric("psnr").lo < held.metric("psnr").mean < held.metric("psnr").hi     # an interval, reported
    again = TuneResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result and again.to_dict()["candidates"][0]["meets"] == result.meets(result.candidates[0])
    exhaustive = tune(tiny, _config(search="exhaustive"), progress=False)
    assert len(exhaustive.candidates) == len(BUDGETS) and exhaustive.chosen.run == result.chosen.run


def test_unreachable_target_is_refused_naming_the_closest_configuration(tiny, brute):
    with pytest.raises(TargetUnreachableError, match=r"psnr>=99 .*the closest is 'budget=64' with psnr") as info:
        tune(tiny, _config(target="psnr>=99"), progress=False)
    assert isinstance(info.value, ValueError)
    result = info.value.result
    assert result.chosen is None and result.heldout is None and result.met is None
    best = max((lab for lab in brute if lab != "full"), key=lambda lab: brute[lab]["fidelity"]["psnr"]["mean"])
    assert result.closest.run.label == best == "budget=64"          # every candidate is lossy: 64 comes closest
    assert f"{result.closest.metric('psnr')}" in str(info.value)


def test_a_trivial_target_picks_the_fastest_candidate(tiny, brute):
    result = tune(tiny, _config(target="token_mse<=1e9"), progress=False)
    fastest = max((lab for lab in brute if lab != "full"), key=lambda lab: brute[lab]["speedup"]["flops"]["mean"])
    assert result.chosen.run.label == fastest == "budget=8" and result.met is True
    assert len(result.candidates) == 3                              # log2: budgets 32, 16, 8


def test_two_options_coordinate_bisection_agrees_with_the_exhaustive_search(tiny):
    space = (("budget", (8, 32)), ("refresh_period", (2, 4, 8)))
    bisect = tune(tiny, _config(space=space), progress=False)
    exhaustive = tune(tiny, _config(space=space, search="exhaustive"), progress=False)
    assert len(exhaustive.candidates) == 6 and len(bisect.candidates) < 6
    assert bisect.chosen.run == exhaustive.chosen.run == fastest_meeting(exhaustive.candidates,
                                                                         exhaustive.config.target).run


def test_the_online_variant_calibrates_marches_drift_threshold(tiny):
    assert TuneConfig(family="marche-drift", target="psnr>=30").space == \
        (("refresh_threshold", KNOBS["marche-drift"]["refresh_threshold"].grid),)
    grid = (0.05, 0.2, 0.5, 1.0)
    result = tune(tiny, _config(family="marche-drift", target="psnr>=57", space=(("refresh_threshold", grid),),
                                search="exhaustive"), progress=False)
    chosen = result.chosen.run.create().config
    assert chosen.refresh_threshold in grid and chosen.refresh_period == 16          # the registered cap
    higher = [e for e in result.candidates if dict(e.run.options)["refresh_threshold"] > chosen.refresh_threshold]
    assert higher and not any(result.meets(e) for e in higher)    # the highest threshold (fewest refreshes) meeting
    assert result.meets(result.chosen)
    assert result.met == (result.heldout.metric("psnr").mean >= 57) and result.heldout.seeds == HELD


def test_the_statistic_is_the_mean_or_the_conservative_bound():
    run = StrategyRun(label="budget=8", name="marche", options=(("budget", 8),))
    ev = Evaluation(run=run, seeds=(0,), steps=4, speedup_flops=Interval(mean=1.2, lo=1.2, hi=1.2, n=1),
                    speedup_time=Interval(mean=1.0, lo=0.5, hi=1.5, n=1),
                    fidelity=(("psnr", Interval(mean=50.0, lo=40.0, hi=60.0, n=4)),
                              ("token_mse", Interval(mean=0.008, lo=0.004, hi=0.012, n=4))))
    assert FidelityTarget.parse("psnr>=45").met_by(ev)
    assert not FidelityTarget.parse("psnr>=45", statistic="bound").met_by(ev)             # lower bound 40
    assert FidelityTarget.parse("token_mse<=0.01").met_by(ev)
    assert not FidelityTarget.parse("token_mse<=0.01", statistic="bound").met_by(ev)      # upper bound 0.012
    assert "lower end of the 95% interval" in FidelityTarget.parse("psnr>=45", statistic="bound").describe
    assert FidelityTarget.parse(" ssim >= 0.9 ").describe == "ssim>=0.9 (mean over images)"


def test_every_default_grid_is_a_valid_space_of_its_family():
    from mar_probe import strategies
    for family, knobs in KNOBS.items():
        assert set(knobs) <= set(strategies.options(family)), family
        if any(k.grid for k in knobs.values()):
            config = TuneConfig(family=family, target="ssim>=0.9")     # builds (and so checks) every candidate
            assert 1 <= len(config.space) <= 2 and len(config.candidates()) >= 3, family


def test_bisection_rows_are_ordered_cheapest_first():
    config = TuneConfig(family="marche", target="psnr>=30")                 # the default grid
    assert [k for k, _ in config.space] == ["budget", "refresh_period"]
    rows = config.rows()
    assert len(rows) == 4 and [r.label for r in rows[0]] == [f"budget=16,refresh_period={p}" for p in (6, 4, 3, 2)]
    disa = TuneConfig(family="disa", target="psnr>=30")
    assert [r.label for r in disa.rows()[0]] == ["upper=10,lower=2", "upper=10,lower=3", "upper=10,lower=5"]
    mixed = TuneConfig(family="marche", target="psnr>=30", space=(("selection", ("attention", "random")),))
    assert [len(r) for r in mixed.rows()] == [1, 1]                   # no direction: every candidate enumerated


@pytest.mark.parametrize("make, match", [
    (lambda: FidelityTarget.parse("psnr=>30"), r"malformed fidelity target 'psnr=>30'; expected METRIC>=VALUE .*"
                                               r"\('token_mse', 'token_cos', 'psnr', 'ssim'\)"),
    (lambda: FidelityTarget.parse("fid<=10"), r"unknown fidelity metric 'fid' in target 'fid<=10'; expected one of "
                                              r"\('token_mse', 'token_cos', 'psnr', 'ssim'\)"),
    (lambda: FidelityTarget.parse("psnr<=30"), r"'psnr<=30' bounds psnr from the wrong side.*expected 'psnr>=30'"),
    (lambda: FidelityTarget.parse("token_mse>=0.01"), r"expected 'token_mse<=0.01'"),
    (lambda: FidelityTarget.parse("psnr>=abc"), r"'psnr>=abc' is not a number: 'abc'"),
    (lambda: FidelityTarget.parse("psnr>=inf"), r"finite number, got inf"),
    (lambda: FidelityTarget.parse("psnr>=30", statistic="median"), r"statistic 'median'; expected one of "
                                                                    r"\('mean', 'bound'\)"),
    (lambda: _config(space=(("nosuch", (1, 2)),)), r"no option 'nosuch'; valid options: budget: int = 64"),
    (lambda: _config(options=(("budjet", 3),)), r"no option 'budjet'; valid options: budget"),
    (lambda: _config(family="nosuch"), r"unknown strategy 'nosuch'; expected one of \[.*'marche'"),
    (lambda: _config(heldout_seeds=(1, 5)), r"calibration and held-out seeds overlap in \[1\]"),
    (lambda: _config(calibration_seeds=()), r"calibration_seeds must be distinct integers, at least one; got \(\)"),
    (lambda: _config(heldout_seeds=(3, 3)), r"heldout_seeds must be distinct integers, at least one; got \(3, 3\)"),
    (lambda: _config(search="grid"), r"unknown search 'grid'; expected one of \('bisect', 'exhaustive'\)"),
    (lambda: _config(space=(("budget", (0, 16)),)), r"candidate 'budget=0' .* budget must be a positive integer"),
    (lambda: _config(options=(("budget", 16),)), r"\['budget'\] are both searched and fixed"),
    (lambda: _config(space=(("budget", ()),)), r"no candidate value for option 'budget'"),
    (lambda: _config(space=(("budget", (16, 16)),)), r"candidates of option 'budget' repeat a value: \[16, 16\]"),
    (lambda: _config(num_samples=0), r"num_samples must be a positive integer, got 0"),
    (lambda: TuneConfig(family="full", target="psnr>=30"), r"'full' has no options to tune"),
])
def test_bad_inputs_name_the_value_and_the_valid_choices(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import perturbed_tiny
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save({"model_ema": perturbed_tiny().state_dict()}, path)
    return path


def _cli(checkpoint, out, target):
    return ["tune", "--checkpoint", str(checkpoint), "--model", "mar_tiny", "--num-sampling-steps", "4",
            "--num-iter", "6", "--cfg", "3.0", "--num-samples", "2", "--family", "marche", "--param",
            "budget=8,32,64", "--strategy-opt", "selection_layer=0", "--target", target,
            "--calibration-seeds", "0,1", "--heldout-seeds", "2", "--out", str(out)]


def test_cli_writes_tune_json_and_figure(checkpoint, tmp_path, capsys):
    out = tmp_path / "tune"
    rc = cli.main(_cli(checkpoint, out, "psnr>=40"))
    report = json.loads((out / "tune.json").read_text())
    assert report["format"] == "mar_probe.tune" and report["config"]["space"] == {"budget": [8, 32, 64]}
    assert rc == (0 if report["met"] else 1) and report["chosen"] is not None
    assert (out / "tune.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"chosen: {report['chosen']}" in printed and "held-out seeds [2]" in printed
    result = TuneResult.from_dict(report)
    assert result.chosen.run.label == report["chosen"] and result.config.sampling.num_iter == 6


def test_cli_refuses_an_unreachable_target_in_one_line(checkpoint, tmp_path, capsys):
    out = tmp_path / "tune"
    assert cli.main(_cli(checkpoint, out, "psnr>=99")) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%|" not in ln]
    assert len(err) == 1 and "mar-probe tune: error: no candidate of 'marche' reaches psnr>=99" in err[0]
    assert "the closest is 'budget=" in err[0]
    report = json.loads((out / "tune.json").read_text())              # the calibration is kept for inspection
    assert report["chosen"] is None and report["heldout"] is None and len(report["candidates"]) >= 1
