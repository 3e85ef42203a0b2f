"""Paired fidelity, mar-probe compare and sweep, and their figures."""
import dataclasses
import json
import zipfile

import numpy as np
import pytest

import mar_probe
from mar_probe import cli
from mar_probe.compare import (CompareConfig, QualityJudge, SeedRun, StrategyRun, compare, format_table,
                               pareto_front, sweep_runs, write_results)
from mar_probe.quality.paired import PSNR_IDENTICAL, paired_fidelity, psnr, ssim, summarize, token_cosine, token_mse


# ---- paired metrics ----------------------------------------------------------------------------------------
def test_psnr_golden_values():
    a = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 1)).astype(np.uint8)
    b = a.copy()
    b[0, 3, 4, 0] ^= 1                                                       # one level in one pixel
    b[1] = 255 - a[1]
    got = psnr(a, b)
    assert got[0] == pytest.approx(10 * np.log10(255.0 ** 2 * 784), abs=1e-9)     # 77.07 dB
    mse1 = ((a[1].astype(float) - b[1]) ** 2).mean()
    assert got[1] == pytest.approx(10 * np.log10(255.0 ** 2 / mse1), abs=1e-9)
    assert got[2] == PSNR_IDENTICAL


def test_ssim_matches_closed_form_for_constant_images():
    # constant images: SSIM = (2 m1 m2 + C1) / (m1^2 + m2^2 + C1), C1 = (0.01 * 255)^2 (variances are 0)
    x, y = np.full((1, 16, 16), 100, np.uint8), np.full((1, 16, 16), 110, np.uint8)
    c1 = (0.01 * 255) ** 2
    assert ssim(x, y)[0] == pytest.approx((2 * 100 * 110 + c1) / (100 ** 2 + 110 ** 2 + c1), abs=1e-12)
    assert ssim(x, x)[0] == 1.0


def test_token_metrics_and_shape_errors():
    t = np.random.default_rng(1).normal(size=(2, 5, 4))
    assert np.allclose(token_cosine(t, t), 1) and np.allclose(token_cosine(t, -t), -1)
    assert np.allclose(token_mse(t, t + 0.5), 0.25)
    ds = paired_fidelity(np.zeros((2, 4, 2, 2)), np.zeros((2, 4, 2, 2)))  # [N, C, H, W] layout; zero tokens
    assert ds["token_cos"].values.tolist() == [1.0, 1.0] and "psnr" not in ds
    with pytest.raises(ValueError, match=r"same shape \[N, ...\], got \(2, 5, 4\) and \(3, 5, 4\)"):
        token_mse(t, np.zeros((3, 5, 4)))


def test_summarize_t_interval():
    s = summarize([1.0, 2.0, 3.0, np.nan])
    assert s["mean"] == 2.0 and s["n"] == 3 and s["median"] == 2.0
    assert s["hi"] - s["mean"] == pytest.approx(4.302652729911275 / np.sqrt(3), rel=1e-9)   # t(0.975, 2) * sem
    assert summarize([5.0])["lo"] == 5.0 and summarize([])["mean"] is None


# ---- compare -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from conftest import perturbed_tiny
    return perturbed_tiny(encoder_depth=3, decoder_depth=4, num_sampling_steps="4")


@pytest.fixture(scope="module")
def compared(tiny):
    runs = (StrategyRun(label="marche", name="marche", options=(("budget", 20),)),
            StrategyRun(label="exact", name="marche", options=(("refresh_period", 1),)))
    config = CompareConfig(runs=runs, num_samples=2, seeds=(0, 1), num_iter=4, cfg=3.0, grid_images=2,
                           paired_against="exact")
    return config, compare(tiny, config, progress=False)


def test_compare_is_paired_against_full(compared):
    config, result = compared
    assert [r.label for r in config.runs] == ["full", "marche", "exact"]           # full added first
    s = result.results["strategies"]
    for label in ("full", "exact"):                                              # exact = full, image by image
        f = s[label]["fidelity"]
        assert f["token_mse"]["max"] == 0 and f["psnr"]["min"] == PSNR_IDENTICAL and f["ssim"]["min"] == 1
        assert f["psnr"]["n"] == 4                                               # 2 images x 2 seeds
    assert s["marche"]["fidelity"]["token_mse"]["mean"] > 0
    full, marche = result.runs["full"], result.runs["marche"]
    assert s["marche"]["speedup"]["flops"]["mean"] == pytest.approx(
        np.mean([f.flops / m.flops for f, m in zip(full, marche)]))
    assert s["exact"]["speedup"]["flops"]["mean"] == 1.0
    assert s["full"]["quality"] == {}                                            # 8x8 images: no judge


def test_paired_against_differences_per_image(compared):
    """Every strategy minus ``exact`` (= full, image by image): full's differences are 0, marche's are its own
    fidelity minus that of identical images."""
    _, result = compared
    s = result.results["strategies"]
    assert "paired" not in s["exact"] and s["marche"]["paired"]["against"] == "exact"
    assert s["full"]["paired"]["psnr"]["mean"] == 0 and s["full"]["paired"]["psnr"]["n"] == 4
    m = s["marche"]["paired"]
    assert m["token_mse"]["mean"] == pytest.approx(s["marche"]["fidelity"]["token_mse"]["mean"])
    assert m["psnr"]["mean"] == pytest.approx(s["marche"]["fidelity"]["psnr"]["mean"] - PSNR_IDENTICAL)
    assert m["psnr"]["lo"] < m["psnr"]["mean"] < m["psnr"]["hi"] <= 0


def test_write_results_round_trip_and_widget(compared, tiny, tmp_path):
    config, result = compared
    out = write_results(result, tmp_path / "cmp")
    data = json.loads((out / "results.json").read_text())
    assert data["format"] == "mar_probe.compare" and data["version"] == 1
    # the file holds the settings as used: the model's (here the official) values in the fields left out
    assert CompareConfig.from_dict(data["settings"]) == config.resolved(tiny)
    assert (data["settings"]["temperature"], data["settings"]["head_steps"]) == (1.0, "4")
    assert data["strategies"]["marche"]["config"]["budget"] == 20
    with np.load(out / data["strategies"]["marche"]["samples_path"]) as f:
        assert f["images"].shape == (2, 8, 8, 1) and f["tokens"].shape == (2, 64, 4)    # [N, seq_len, dim]
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].startswith("label,strategy,options,steps,speedup_time") and len(csv) == 4
    assert "psnr_minus_ref" in csv[0] and "token_mse_minus_ref_lo" in csv[0]
    assert (out / "grid.png").stat().st_size > 0
    table = format_table(data)
    assert table.splitlines()[2].startswith("| full | 4 | 1 |")
    from mar_probe.widgets import load_results
    entries = {e.name: e for e in load_results(out)}
    assert set(entries) == {"full", "marche", "exact"} and entries["marche"].images.shape == (2, 8, 8, 1)


def test_fidelity_reports_median_tail_and_worst_with_intervals(compared, tmp_path):
    """Every paired fidelity metric carries mean (t), median, bad tail and worst image, each with its interval and
    clipped flag, equal to :func:`interval` over all images of all seeds; the tail and worst of token_mse are its
    high end (lower is better)."""
    from mar_probe.compare import METRICS
    from mar_probe.quality.paired import interval
    _, result = compared
    out = write_results(result, tmp_path / "stats")
    data = json.loads((out / "results.json").read_text())
    full = result.runs["full"]
    per_image = [paired_fidelity(s.tokens, f.tokens, s.images, f.images) for s, f in zip(result.runs["marche"], full)]
    for metric in ("token_mse", "token_cos", "psnr", "ssim"):
        x = np.concatenate([d[metric].values for d in per_image])
        spec = METRICS[metric]
        got = data["strategies"]["marche"]["fidelity"][metric]
        for name in ("mean", "median", "tail", "worst"):
            want = interval(x, statistic=name, bounds=spec.bounds, higher_is_better=spec.higher_is_better)
            assert got["statistics"][name] == want.to_dict()
        assert (got["lo"], got["hi"], got["clipped"]) == (got["statistics"]["mean"]["low"],
                                                           got["statistics"]["mean"]["high"],
                                                           got["statistics"]["mean"]["clipped"])
        assert spec.bounds[0] <= got["lo"] <= got["hi"] <= spec.bounds[1]
    mse = data["strategies"]["marche"]["fidelity"]["token_mse"]["statistics"]
    assert (mse["worst"]["statistic"], mse["tail"]["statistic"]) == ("max", "p95")
    assert mse["worst"]["estimate"] == data["strategies"]["marche"]["fidelity"]["token_mse"]["max"]
    psnr_stats = data["strategies"]["marche"]["fidelity"]["psnr"]["statistics"]
    assert (psnr_stats["worst"]["statistic"], psnr_stats["tail"]["statistic"]) == ("min", "p5")
    import pandas as pd
    row = pd.read_csv(out / "results.csv").set_index("label").loc["marche"]
    assert row["token_mse_worst"] == pytest.approx(mse["worst"]["estimate"])
    assert row["psnr_tail_lo"] == pytest.approx(psnr_stats["tail"]["low"])
    assert "ssim_median_clipped" in row.index


def test_table_and_pareto_plot_flag_clipped_intervals(compared):
    """A clipped interval ends in ``*`` with the footnote (CLI table and Pareto figure); without clipping, neither."""
    import copy

    import pandas as pd

    from mar_probe.compare import CLIPPED_NOTE
    from mar_probe.plot.compare import pareto_plot
    _, result = compared
    data = copy.deepcopy(result.results)

    def unclip(d):
        for k, v in d.items():
            if k == "clipped":
                d[k] = False
            elif isinstance(v, dict):
                unclip(v)

    unclip(data)
    plain = format_table(data)
    assert CLIPPED_NOTE not in plain and "*" not in plain
    data["strategies"]["marche"]["speedup"]["flops"].update(lo=0.0, hi=9.0, clipped=True)
    table = format_table(data)
    assert table.endswith("\n\n" + CLIPPED_NOTE)
    marche = next(line for line in table.splitlines() if line.startswith("| marche |"))
    assert marche.split(" | ")[3].endswith(", 9]*")
    df = pd.DataFrame({"label": ["a", "b"], "speedup_flops": [1.0, 2.0], "speedup_flops_lo": [0.5, 0.0],
                       "speedup_flops_hi": [1.5, 4.0], "speedup_flops_clipped": [False, True], "psnr": [30.0, 20.0],
                       "psnr_lo": [np.nan, 19.0], "psnr_hi": [np.nan, 21.0]})
    ax = pareto_plot(df, "speedup_flops", "psnr")
    texts = [t.get_text() for t in ax.texts + ax.get_legend().get_texts()]       # labels: in the legend
    assert "a" in texts and "b*" in texts and "* interval clipped to the metric's range" in texts
    import matplotlib.pyplot as plt
    plt.close(ax.figure)


@pytest.fixture(scope="module")
def compared28():
    """The tiny run at 28x28 (the Fashion-MNIST judge's size), three seeds: a Fréchet distance per seed."""
    from conftest import perturbed_tiny
    model = perturbed_tiny(encoder_depth=3, decoder_depth=4, num_sampling_steps="4", img_size=28, crop_size=28)
    runs = (StrategyRun(label="marche", name="marche", options=(("budget", 20),)),
            StrategyRun(label="exact", name="marche", options=(("refresh_period", 1),)))
    config = CompareConfig(runs=runs, num_samples=4, seeds=(0, 1, 2), num_iter=4, cfg=3.0, grid_images=0,
                           paired_against="marche")
    return compare(model, config, progress=False)


def test_frechet_distances_are_compared_paired_by_seed(compared28, tmp_path):
    """FD(strategy, seed) - FD(reference, seed) per seed, with a t-interval over seeds, against full and against
    --paired-against, equal to the differences of the per-seed Fréchet numbers of the same results.json."""
    from scipy import stats
    out = write_results(compared28, tmp_path / "fd")
    data = json.loads((out / "results.json").read_text())
    s = data["strategies"]
    fd = {label: {r["seed"]: r["frechet_distance"] for r in e["per_seed"]} for label, e in s.items()}
    seeds = [0, 1, 2]

    def check(p, want):
        assert [d["seed"] for d in p["per_seed"]] == seeds and p["n"] == 3 and not p["clipped"]
        assert [d["difference"] for d in p["per_seed"]] == pytest.approx(want, abs=1e-9)
        half = stats.t.ppf(0.975, 2) * np.std(want, ddof=1) / np.sqrt(3)
        assert (p["mean"], p["lo"], p["hi"]) == pytest.approx((np.mean(want), np.mean(want) - half,
                                                                np.mean(want) + half), abs=1e-9)

    for label, e in s.items():
        assert e["quality_vs_full"]["against"] == "full"
        check(e["quality_vs_full"]["frechet_distance"], [fd[label][k] - fd["full"][k] for k in seeds])
    assert s["full"]["quality_vs_full"]["frechet_distance"]["hi"] == 0                  # full - full
    assert s["exact"]["quality_vs_full"]["frechet_distance"]["mean"] == 0               # exact = full per image
    assert s["marche"]["quality_vs_full"]["frechet_distance"]["mean"] != 0
    for label in ("full", "exact"):
        assert s[label]["paired"]["against"] == "marche"
        check(s[label]["paired"]["frechet_distance"], [fd[label][k] - fd["marche"][k] for k in seeds])
    assert "paired" not in s["marche"]
    import pandas as pd
    row = pd.read_csv(out / "results.csv").set_index("label").loc["marche"]
    p = s["marche"]["quality_vs_full"]["frechet_distance"]
    assert (row["frechet_distance_minus_full"], row["frechet_distance_minus_full_lo"],
            row["frechet_distance_minus_full_hi"]) == pytest.approx((p["mean"], p["lo"], p["hi"]))
    assert row["frechet_distance_minus_full_n"] == 3
    assert pd.read_csv(out / "results.csv").set_index("label").loc["exact", "frechet_distance_minus_ref"] == \
        pytest.approx(s["exact"]["paired"]["frechet_distance"]["mean"])
    assert "frechet_distance_minus_full" in format_table(data).splitlines()[0]


def test_frechet_with_one_seed_has_no_interval_and_says_so():
    from mar_probe.compare import results_frame, seed_paired_difference
    got = seed_paired_difference([{"seed": 4, "frechet_distance": 12.5}], [{"seed": 4, "frechet_distance": 10.0}],
                                 "full")
    p = got["frechet_distance"]
    assert (p["mean"], p["lo"], p["hi"], p["n"]) == (2.5, None, None, 1) and "no interval" in p["note"]
    assert p["per_seed"] == [{"seed": 4, "difference": 2.5}] and "fid" not in got
    results = {"strategies": {"m": {"config": {"name": "marche"}, "steps": 4, "quality_vs_full": got}}}
    assert results_frame(results)["frechet_distance_minus_full_lo"].isna().all()
    assert "| m | 4 | 2.5 (n=1) |" in format_table(results)


def test_unrelated_floor_pairs_each_seed_with_the_previous_one():
    """Issue 17's zoo: full's images of seed k+1 against seed k's are the fidelity of an unrelated sample; equal
    seeds give the identical-image values, one seed gives no floor."""
    from mar_probe.compare import unrelated_floor
    rng = np.random.default_rng(0)
    tokens = [rng.normal(size=(3, 16, 4)).astype(np.float32) for _ in range(3)]
    images = [rng.integers(0, 256, (3, 8, 8, 1)).astype(np.uint8) for _ in range(3)]
    runs = [SeedRun(s, 1.0, 1, 1, tokens[k], images[k], np.array([0, 1, 2])) for k, s in enumerate((5, 6, 9))]
    floor = unrelated_floor(runs)
    assert floor["seed_pairs"] == [[5, 6], [6, 9]] and floor["psnr"]["n"] == 6
    want = np.concatenate([paired_fidelity(tokens[k + 1], tokens[k], images[k + 1], images[k])["psnr"].values
                           for k in (0, 1)])
    assert floor["psnr"]["mean"] == pytest.approx(want.mean())
    assert floor["psnr"]["lo"] < want.mean() < floor["psnr"]["hi"]
    assert 0 < floor["psnr"]["mean"] < 20 and floor["token_mse"]["mean"] > 0.5          # noise against noise
    same = unrelated_floor([runs[0], dataclasses.replace(runs[0], seed=7)])
    assert (same["psnr"]["mean"], same["token_mse"]["mean"]) == (100.0, 0.0)
    assert unrelated_floor(runs[:1]) is None


def test_fashion_judge_per_image_accuracy_and_per_seed_frechet():
    from mar_probe.quality import fashion_frechet, load_classifier, load_reference_stats, predict
    rng = np.random.default_rng(0)
    seeds = [SeedRun(s, 1.0, 1, 1, np.zeros(1), rng.integers(0, 256, (4, 28, 28, 1)).astype(np.uint8),
                     np.array([0, 1, 2, 3])) for s in (0, 1)]
    config = CompareConfig(runs=(), num_samples=4)
    per_seed = [{}, {}]
    q = QualityJudge.for_images(seeds[0].images, config)(seeds, per_seed)
    clf, ref = load_classifier(), load_reference_stats()
    correct = np.concatenate([predict(clf, s.images) == s.labels for s in seeds])
    assert q["class_accuracy"]["mean"] == correct.mean() and q["class_accuracy"]["n"] == 8
    fds = [fashion_frechet(s.images, clf, ref) for s in seeds]
    assert [r["frechet_distance"] for r in per_seed] == pytest.approx(fds)
    assert q["frechet_distance"]["mean"] == pytest.approx(np.mean(fds)) and q["frechet_distance"]["n"] == 2
    assert QualityJudge.for_images(np.zeros((2, 8, 8, 3), np.uint8), config) is None      # RGB, no weights


@pytest.mark.parametrize("kwargs, match", [
    (dict(runs=(StrategyRun(label="a", name="marche"), StrategyRun(label="a", name="lazymar"))),
     "labels must be unique"),
    (dict(runs=(StrategyRun(label="full", name="marche"),)), "'full' is the reference"),
    (dict(runs=(), seeds=(1, 1)), "seeds must be distinct"),
    (dict(runs=(), num_iter=0), "num_iter must be a positive integer, got 0"),
    (dict(runs=(), paired_against="lazymar"),
     r"paired_against must be one of the strategy labels \['full'\], got 'lazymar'"),
])
def test_compare_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompareConfig(**kwargs)


def test_strategy_run_rejects_bad_options():
    with pytest.raises(ValueError, match="has no option"):
        StrategyRun(label="m", name="marche", options=(("budjet", 3),))


# ---- sweep ---------------------------------------------------------------------------------------------------
def test_pareto_front():
    speed, fid = [1.0, 2.0, 3.0, 2.5, 1.5], [30.0, 25.0, 20.0, 10.0, 20.0]
    assert pareto_front(speed, fid).tolist() == [0, 1, 2]                     # 3 and 4 are dominated
    assert pareto_front(speed, fid, higher_is_better=False).tolist() == [3, 2]


def test_sweep_runs_grid_and_errors():
    runs = sweep_runs("marche", {"budget": [16, 32], "refresh_period": [2, 4]}, {"selection": "random"}, ["lazymar"])
    assert [r.label for r in runs] == ["full", "lazymar", "budget=16,refresh_period=2", "budget=16,refresh_period=4",
                                       "budget=32,refresh_period=2", "budget=32,refresh_period=4"]
    assert dict(runs[-1].options) == {"budget": 32, "refresh_period": 4, "selection": "random"}
    with pytest.raises(ValueError, match="both swept and fixed"):
        sweep_runs("marche", {"budget": [1]}, {"budget": 2})
    with pytest.raises(ValueError, match="one or two options, got 3"):
        sweep_runs("marche", {"budget": [1], "seed": [1], "refresh_period": [1]})


# ---- CLI -----------------------------------------------------------------------------------------------------
TINY = ["--model", "mar_tiny", "--num-samples", "1", "--num-iter", "3", "--num-sampling-steps", "2",
        "--cfg", "3.0"]  # CFG given: both branches, as the CLI fallback of 3.0 did before issue 18


def test_cli_sweep_writes_csv_and_pareto(tmp_path, capsys):
    out = tmp_path / "sw"
    assert cli.main(["sweep", "marche", "--param", "budget=20,40", "--strategy-opt", "refresh_period=2",
                     "--fidelity", "token_mse", "--out", str(out)] + TINY) == 0
    lines = (out / "sweep.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert "budget" in header and "on_front" in header and len(lines) == 4
    full = dict(zip(header, lines[1].split(",")))
    assert full["label"] == "full" and full["on_front"] == "False"       # the reference is no candidate
    assert (out / "pareto.png").stat().st_size > 0
    assert "| budget=40 |" in capsys.readouterr().out


def test_cli_compare_option_errors(tmp_path, capsys):
    base = ["compare", "--strategies", "full,m=marche", "--out", str(tmp_path)] + TINY
    assert cli.main(base + ["--strategy-opt", "marche.budget=3"]) == 2
    assert "LABEL.KEY=VALUE with LABEL one of ['full', 'm']" in capsys.readouterr().err
    assert cli.main(base + ["--strategy-opt", "m.budjet=3"]) == 2
    assert "has no option 'budjet'" in capsys.readouterr().err


def test_cli_generate_shadow_writes_store_and_figure(tmp_path):
    import xarray as xr
    out = tmp_path / "g"
    assert cli.main(["generate", "--strategy", "marche", "--strategy-opt", "budget=20", "--shadow",
                     "--out", str(out)] + TINY) == 0
    ds = xr.open_zarr(out / "shadow.zarr")
    assert ds["dec_kv_err"].sizes == {"sample": 1, "step": 3, "branch": 2, "layer": 2, "token": 68}
    assert ds["refresh"].values.tolist() == [[True, False, False]]
    assert (out / "shadow.png").stat().st_size > 0
    import pandas as pd
    from mar_probe.plot.compare import shadow_error_data
    written = pd.read_csv(out / "dec_kv_err.csv")                   # the plotted values, the figure's data
    pd.testing.assert_frame_equal(written, shadow_error_data(ds, "dec_kv_err").reset_index(drop=True),
                                  check_dtype=False)


def test_shadow_error_data_marks_refresh_steps(tiny):
    from mar_probe.plot.compare import shadow_error_data
    from mar_probe.probe.shadow import sample_with_shadow
    _, ds = sample_with_shadow(tiny, [0, 1], num_iter=4, cfg=3.0, strategy=mar_probe.strategies.create(
        "marche", budget=20, refresh_period=2))
    df = shadow_error_data(ds, "dec_kv_err")
    assert sorted(df["layer"].unique()) == [0, 1, 2, 3] and len(df) == 16
    assert df.groupby("step")["refresh"].first().tolist() == [True, False, True, False]
    cached = df[(df["step"] == 1) & (df["layer"] >= 2)]
    assert (cached["mean"] > 0).all() and (df[df["refresh"]]["mean"] == 0).all()
    assert shadow_error_data(ds, "z_err")["layer"].unique().tolist() == ["z"]
    with pytest.raises(ValueError, match="has no 'nope'"):
        shadow_error_data(ds, "nope")


def test_compare_resume_reuses_saved_runs_and_refuses_another_comparison(tiny, tmp_path, monkeypatch):
    """An interrupted comparison (one saved run deleted, as if killed before it) resumes by running only that run,
    and gives the same results; a resume with other settings is refused; without resume the folder starts afresh."""
    import mar_probe.compare as C
    runs = (StrategyRun(label="m", name="marche", options=(("budget", 20),)),)
    config = CompareConfig(runs=runs, num_samples=2, seeds=(0, 1), num_iter=3, cfg=3.0, grid_images=0, shadow=True)
    first = compare(tiny, config, progress=False, partial=tmp_path / "p")
    saved = sorted(p.name for p in (tmp_path / "p").glob("*.npz"))
    assert saved == ["full.seed0.npz", "full.seed1.npz", "m.seed0.npz", "m.seed1.npz"]
    with zipfile.ZipFile(tmp_path / "p" / "full.seed0.npz") as z:                 # saved compressed
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
    (tmp_path / "p" / "m.seed1.npz").unlink()
    calls = []
    real = C.run_strategy
    monkeypatch.setattr(C, "run_strategy", lambda *a, **k: calls.append(a[1].label) or real(*a, **k))
    again = compare(tiny, config, progress=False, partial=tmp_path / "p", resume=True)
    assert calls == ["m"]
    for label in ("full", "m"):
        for a, b in zip(first.runs[label], again.runs[label]):
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.images, b.images) and a.flops == b.flops
            assert set(a.shadow) == {"enc_kv_err", "dec_kv_err", "z_err"} and all(
                np.array_equal(a.shadow[k], b.shadow[k], equal_nan=True) for k in a.shadow)
            assert (a.seconds == b.seconds) == ((label, a.seed) != ("m", 1))   # loaded runs keep their seconds
    assert again.results["strategies"]["m"]["fidelity"]["psnr"]["mean"] == \
        first.results["strategies"]["m"]["fidelity"]["psnr"]["mean"]
    other = dataclasses.replace(config, num_iter=4)
    with pytest.raises(ValueError, match=r"cannot resume .*another comparison \(settings that differ: \['num_iter'\]"):
        compare(tiny, other, progress=False, partial=tmp_path / "p", resume=True)
    calls.clear()
    compare(tiny, config, progress=False, partial=tmp_path / "p")              # no resume: everything runs again
    assert calls == ["full", "m", "full", "m"]


def test_a_resumed_comparison_adds_strategies_and_seeds_and_refuses_a_changed_label(tiny, tmp_path, monkeypatch):
    """A screen's next arms resume beside the saved full and reference runs: only the new arm runs, the shared
    labels' runs load with their results unchanged, and the folder's stamp lists every label it holds; an added seed
    runs that seed alone; a label whose options changed is refused, naming both."""
    import mar_probe.compare as C
    m = StrategyRun(label="m", name="marche", options=(("budget", 20),))
    config = CompareConfig(runs=(m,), num_samples=2, seeds=(0,), num_iter=3, cfg=3.0, grid_images=0)
    first = compare(tiny, config, progress=False, partial=tmp_path / "p")
    calls = []
    real = C.run_strategy
    monkeypatch.setattr(C, "run_strategy", lambda *a, **k: calls.append(a[1].label) or real(*a, **k))
    lz = StrategyRun(label="lz", name="lazymar")
    added = compare(tiny, dataclasses.replace(config, runs=(lz,)), progress=False, partial=tmp_path / "p", resume=True)
    assert calls == ["lz"]                                                      # full loaded, only the new arm ran
    assert np.array_equal(added.runs["full"][0].tokens, first.runs["full"][0].tokens)
    stamp = json.loads((tmp_path / "p" / "config.json").read_text())
    assert [r["label"] for r in stamp["settings"]["runs"]] == ["full", "lz", "m"]
    calls.clear()
    again = compare(tiny, config, progress=False, partial=tmp_path / "p", resume=True)   # m's runs are still there
    assert calls == [] and again.results["strategies"]["m"] == first.results["strategies"]["m"]
    calls.clear()
    more = compare(tiny, dataclasses.replace(config, seeds=(0, 1)), progress=False, partial=tmp_path / "p",
                   resume=True)                                                 # a seed added: only its runs run
    assert calls == ["full", "m"] and np.array_equal(more.runs["m"][0].tokens, first.runs["m"][0].tokens)
    changed = dataclasses.replace(config, runs=(StrategyRun(label="m", name="marche", options=(("budget", 8),)),))
    with pytest.raises(ValueError, match=r"runs labelled 'm' are 'marche' with options \{'budget': 20\}, now "
                                         r"'marche' with options \{'budget': 8\}; give the new arm another label"):
        compare(tiny, changed, progress=False, partial=tmp_path / "p", resume=True)


def test_rank_jobs_spread_by_seed_or_by_run(tiny):
    """torchrun's split of the (seed, strategy) jobs: by seed, every strategy of a seed on one rank (3 seeds on 2
    ranks: 6 jobs and 3); by run, job k on rank k mod 2 (5 and 4); either way the ranks' jobs are disjoint and
    cover every job; an unknown spread is refused before anything runs, naming the valid ones."""
    from mar_probe.compare import _rank_jobs
    from mar_probe.launch import Ranks
    jobs = [(seed, label) for seed in (0, 1, 2) for label in ("full", "a", "b")]
    mine = {(spread, rank): _rank_jobs(jobs, (0, 1, 2), Ranks(rank=rank, world_size=2, local_rank=rank), spread)
            for spread in ("seeds", "runs") for rank in (0, 1)}
    assert mine["seeds", 0] == [j for j in jobs if j[0] in (0, 2)] and mine["seeds", 1] == jobs[3:6]
    assert mine["runs", 0] == [(0, "full"), (0, "b"), (1, "a"), (2, "full"), (2, "b")]
    assert mine["runs", 1] == [(0, "a"), (1, "full"), (1, "b"), (2, "a")]
    for spread in ("seeds", "runs"):
        assert sorted(mine[spread, 0] + mine[spread, 1]) == sorted(jobs)
    assert _rank_jobs(jobs, (0, 1, 2), None, "runs") == jobs                    # one process: every job
    config = CompareConfig(runs=(), num_samples=2, seeds=(0,), num_iter=3, grid_images=0)
    with pytest.raises(ValueError, match=r"unknown spread 'arms'; expected one of \('seeds', 'runs'\)"):
        compare(tiny, config, progress=False, spread="arms")


def test_cli_compare_saves_partial_runs_and_resumes(tmp_path, capsys):
    args = ["compare", "--strategies", "full,m=marche", "--strategy-opt", "m.budget=20", "--out", str(tmp_path)] + TINY
    assert cli.main(args) == 0
    table = capsys.readouterr().out.split("wrote")[0]
    assert sorted(p.name for p in (tmp_path / "partial").glob("*.npz")) == ["full.seed0.npz", "m.seed0.npz"]
    assert cli.main(args + ["--resume"]) == 0                                  # nothing left to run: same table
    assert capsys.readouterr().out.split("wrote")[0] == table
    assert cli.main(args + ["--resume", "--cfg", "2.0"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "['cfg']" in err
