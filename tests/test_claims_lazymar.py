"""LazyMAR's two claims measured (issue 15 items 1-2): skippable tokens and the CFG residual ratio at lags 1..8.

Every quantity is checked against plain numpy loops written here, on synthetic runs with the store's dims and
bookkeeping (``synthetic_run`` of test_analysis, and a longer run for lags up to 8); known answers by construction;
bad inputs; ``mar-probe analyze --claims`` and ``mar-probe figures`` on a recorded mar_tiny store.
"""
import dask
import numpy as np
import pytest
import xarray as xr
from scipy import stats

import mar_probe.analysis as A
from mar_probe.analysis import claims as C
from test_analysis import N, S_BUF, _np_cos, synthetic_run

THRESHOLDS = (-0.5, 0.0, 0.3, 0.9)


def long_run(seed=1, samples=3, steps=10, layers=2, heads=2, dh=4, dm=4, chunked=True):
    """A run like ``synthetic_run`` with 10 steps (lags up to 8) and one step that generates nothing (step 8)."""
    rng = np.random.default_rng(seed)
    grid, buf = 9, 2
    n = buf + grid
    unknown_after = (8, 7, 6, 5, 4, 3, 2, 1, 1, 0)[:steps]
    mask, pred = np.zeros((samples, steps, n), bool), np.zeros((samples, steps, n), bool)
    for i in range(samples):
        order = rng.permutation(grid)
        before = grid
        for s, after in enumerate(unknown_after):
            mask[i, s, buf:] = order < before
            pred[i, s, buf:] = (order < before) & (order >= after)
            before = after
    img = np.arange(n) - buf
    coords = {"sample": np.arange(samples), "step": np.arange(steps), "branch": ["cond", "uncond"],
              "layer": np.arange(layers), "token": np.arange(n), "row": ("token", np.where(img >= 0, img // 3, -1))}
    lead = ("sample", "step", "branch")
    z = rng.normal(size=(samples, steps, 2, n, dm)).astype(np.float32)
    z[:, :, 1] = z[:, :, 0] - 0.3 * rng.normal(size=(samples, steps, n, dm)).astype(np.float32)
    z[:, :, :, :buf] = np.nan
    data = {"dec_v": (lead + ("layer", "token", "head", "d_head"),
                      rng.normal(size=(samples, steps, 2, layers, n, heads, dh)).astype(np.float16)),
            "z": (lead + ("token", "d_model"), z),
            "z_cfg_resid": (("sample", "step", "token", "d_model"), z[:, :, 0] - z[:, :, 1]),
            "mask": (("sample", "step", "token"), mask), "pred": (("sample", "step", "token"), pred)}
    ds = xr.Dataset(data, coords)
    return ds.chunk({"sample": 1, "step": 2}) if chunked else ds


@pytest.fixture(scope="module")
def run():
    return synthetic_run()


@pytest.fixture(scope="module")
def long():
    return long_run()


# ---- numpy references --------------------------------------------------------------------------------------------
def np_skip_counts(ds, th, layer, branch=0):
    """(skippable, candidates) per (sample, step s >= 1): candidates are neither generating at s nor at s - 1."""
    v, pred = ds["dec_v"].values, ds["pred"].values
    samples, steps = pred.shape[:2]
    skip, cand = np.zeros((samples, steps - 1)), np.zeros((samples, steps - 1))
    for i in range(samples):
        for s in range(1, steps):
            for t in range(pred.shape[2]):
                if pred[i, s, t] or pred[i, s - 1, t]:
                    continue
                cos = np.mean([_np_cos(v[i, s, branch, layer, t, h], v[i, s - 1, branch, layer, t, h])
                               for h in range(v.shape[5])])
                cand[i, s - 1] += 1
                skip[i, s - 1] += cos > th
    return skip, cand


def t_interval(values, lo_bound, hi_bound, level=0.95):
    values = np.asarray(values, float)
    n = len(values)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * values.std(ddof=1) / np.sqrt(n)
    m = values.mean()
    return m, max(m - half, lo_bound), min(m + half, hi_bound)


def np_ratios(ds, lag, tokens="all", numerator="both"):
    """Per sample: (pooled, step mean, step median) of branch-output lag-MSE over residual lag-MSE."""
    z, resid, pred = ds["z"].values.astype(np.float64), ds["z_cfg_resid"].values.astype(np.float64), ds["pred"].values
    out = []
    for i in range(z.shape[0]):
        num_sum = den_sum = 0.0
        per_step = []
        for s in range(lag, z.shape[1]):
            bn = bd = 0.0
            count = 0
            for t in range(z.shape[3]):
                if tokens == "head" and not pred[i, s, t]:
                    continue
                dc, du = z[i, s, 0, t] - z[i, s - lag, 0, t], z[i, s, 1, t] - z[i, s - lag, 1, t]
                dr = resid[i, s, t] - resid[i, s - lag, t]
                if np.isnan(dc).any() or np.isnan(du).any() or np.isnan(dr).any():
                    continue
                b = {"both": (np.mean(dc ** 2) + np.mean(du ** 2)) / 2, "cond": np.mean(dc ** 2),
                     "uncond": np.mean(du ** 2)}[numerator]
                bn, bd, count = bn + b, bd + np.mean(dr ** 2), count + 1
            if count:
                num_sum, den_sum = num_sum + bn, den_sum + bd
                per_step.append((bn / count) / (bd / count))
        out.append((num_sum / den_sum, np.mean(per_step), np.median(per_step)))
    return np.array(out)                                                   # [sample, estimator]


# ---- skippable tokens --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 2])
def test_skippable_fraction_matches_numpy_loop(run, layer):
    for th in THRESHOLDS:
        frac = C.skippable_fraction(run, th, layer=layer)
        assert dask.is_dask_collection(frac)                               # lazy until the caller computes
        assert frac.dims == ("sample", "step") and frac.attrs["threshold"] == th
        skip, cand = np_skip_counts(run, th, layer)
        np.testing.assert_allclose(frac.values, skip / cand, rtol=1e-5)


def test_skippable_per_layer_branch_and_pooled_dims(run):
    frac = C.skippable_fraction(run, 0.3, layer=None, branch=None).compute()
    assert frac.dims == ("sample", "step", "branch", "layer")
    for b in (0, 1):
        for layer in (0, 1, 2):
            skip, cand = np_skip_counts(run, 0.3, layer, branch=b)
            np.testing.assert_allclose(frac.isel(branch=b).sel(layer=layer).values, skip / cand, rtol=1e-5)
    pooled = C.skippable_fraction(run, 0.3, layer=1, dim=("step", "token")).values
    skip, cand = np_skip_counts(run, 0.3, 1)
    np.testing.assert_allclose(pooled, skip.sum(1) / cand.sum(1), rtol=1e-5)


def test_skippable_sweep_matches_numpy_with_interval(long):
    sweep = C.skippable_sweep(long, THRESHOLDS, layer=1)
    assert sweep["mean"].dims == ("threshold",) and list(sweep["threshold"].values) == list(THRESHOLDS)
    for th in THRESHOLDS:
        skip, cand = np_skip_counts(long, th, 1)
        m, lo, hi = t_interval(skip.sum(1) / cand.sum(1), 0.0, 1.0)
        got = sweep.sel(threshold=th)
        np.testing.assert_allclose([got["mean"].item(), got["lo"].item(), got["hi"].item()], [m, lo, hi], rtol=1e-5)
        assert got["n"].item() == long.sizes["sample"]
    per = C.skippable_sweep(long, THRESHOLDS, layer=[0, 1], per_sample=True)
    assert dask.is_dask_collection(per) and set(per.dims) == {"sample", "layer", "threshold"}
    boot = C.skippable_sweep(long, THRESHOLDS, layer=1, method="bootstrap")
    assert ((boot["lo"] >= 0) & (boot["hi"] <= 1) & (boot["lo"] <= boot["mean"] + 1e-12)).all()


def test_skippable_known_answers(run):
    """V constant over steps for the buffer and three image tokens, sign-flipping (cos = -1) for the others: exactly
    the constant candidates are skippable at any threshold in (-1, 1); all V constant: every candidate."""
    ds = synthetic_run(chunked=False)
    v = ds["dec_v"].values.copy()
    const = np.zeros(N, bool)
    const[:S_BUF + 3] = True
    sign = (-1.0) ** np.arange(v.shape[1])
    v[:, :, :, :, ~const] = v[:, :1, :, :, ~const] * sign[None, :, None, None, None, None, None].astype(np.float16)
    v[:, :, :, :, const] = v[:, :1, :, :, const]
    ds = ds.assign(dec_v=(ds["dec_v"].dims, v))
    pred = ds["pred"].values
    cand = ~pred[:, 1:] & ~pred[:, :-1]
    want = (cand & const).sum(-1) / cand.sum(-1)
    for th in (-0.9, 0.0, 0.9, 0.999):
        np.testing.assert_allclose(C.skippable_fraction(ds, th, layer=2).values, want, rtol=1e-6)
    all_const = ds.assign(dec_v=(ds["dec_v"].dims, np.broadcast_to(v[:, :1], v.shape).copy()))
    sweep = C.skippable_sweep(all_const, (0.5, 0.99, 0.999), layer=1)
    np.testing.assert_allclose(sweep["mean"].values, 1.0)
    np.testing.assert_allclose(sweep["hi"].values, 1.0)                   # clipped to the fraction's range


def test_default_prune_layer():
    ds = long_run(chunked=False, layers=12)
    assert C.default_prune_layer(ds) == 3                                 # the released code's constant
    assert C.default_prune_layer(ds.sel(layer=[0, 2, 5, 11])) == 2         # 3 not recorded: the nearest
    assert C.default_prune_layer(ds.sel(layer=[0, 2, 4, 11])) == 2         # a tie: the lower
    assert C.default_prune_layer(long_run(chunked=False, layers=4)) == 1   # a quarter of a 4-layer decoder
    deep = long_run(chunked=False, layers=4).assign_attrs(model_config=str({"decoder_depth": 16}))
    assert C.default_prune_layer(deep) == 3                                # depth from the store's model config
    assert C.default_prune_layer(deep.assign_attrs(model_config=str({"decoder_depth": 8}))) == 2


# ---- CFG residual ratio --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", ["all", "head"])
def test_cfg_residual_ratio_matches_numpy_every_lag_and_estimator(long, tokens):
    lags = list(range(1, 9))
    per = C.cfg_residual_ratio_per_sample(long, lags, tokens=tokens)
    assert dask.is_dask_collection(per) and per.dims == ("lag", "estimator", "sample")
    out = C.cfg_residual_ratio(long, lags, tokens=tokens)
    assert list(out["estimator"].values) == list(C.ESTIMATORS) and list(out["lag"].values) == lags
    for lag in lags:
        want = np_ratios(long, lag, tokens)
        for e, est in enumerate(C.ESTIMATORS):
            np.testing.assert_allclose(per.sel(lag=lag, estimator=est).values, want[:, e], rtol=1e-5)
            m, lo, hi = t_interval(want[:, e], 0.0, np.inf)
            got = out.sel(lag=lag, estimator=est)
            np.testing.assert_allclose([got["mean"].item(), got["lo"].item(), got["hi"].item()], [m, lo, hi],
                                       rtol=1e-5)
            assert got["n"].item() == 3 and got["n_inf"].item() == 0


def test_cfg_residual_ratio_numerators_single_estimator_and_cond_only_store(long):
    for numerator in ("cond", "uncond"):
        got = C.cfg_residual_ratio_per_sample(long, [2, 5], "step_median", "head", numerator).values
        want = np.stack([np_ratios(long, lag, "head", numerator)[:, 2] for lag in (2, 5)])
        np.testing.assert_allclose(got, want, rtol=1e-5)
    single = C.cfg_residual_ratio(long, 3, "pooled")
    assert single["mean"].dims == ("lag",) and single["estimator"].item() == "pooled"
    both = C.cfg_residual_ratio_per_sample(long, [1, 4]).values
    cond_only = C.cfg_residual_ratio_per_sample(long.sel(branch=["cond"]), [1, 4]).values  # uncond = cond - resid
    np.testing.assert_allclose(cond_only, both, rtol=1e-5)


def test_cfg_residual_ratio_constant_residual_is_infinite_explicitly(long):
    """A residual that never changes has lag-MSE 0: every ratio is +inf (never averaged away or dropped); the mean
    over samples is +inf with hi +inf, lo NaN (no finite interval), n counting finite and n_inf infinite samples;
    when the outputs do not change either the ratio is 0/0 = NaN and the sample is skipped."""
    ds = long.load().sel(branch=["cond"])
    resid = ds["z_cfg_resid"].values.copy()
    resid[0] = resid[0, :1]                                               # sample 0: residual constant over steps
    one = C.cfg_residual_ratio(ds.assign(z_cfg_resid=(ds["z_cfg_resid"].dims, resid)), [1, 3])
    per = C.cfg_residual_ratio_per_sample(ds.assign(z_cfg_resid=(ds["z_cfg_resid"].dims, resid)), [1, 3])
    assert np.isposinf(per.sel(sample=0).values).all() and np.isfinite(per.sel(sample=[1, 2]).values).all()
    assert np.isposinf(one["mean"].values).all() and np.isposinf(one["hi"].values).all()
    assert np.isnan(one["lo"].values).all() and (one["n"] == 2).all() and (one["n_inf"] == 1).all()
    resid[:] = resid[:, :1]                                               # every sample
    every = C.cfg_residual_ratio(ds.assign(z_cfg_resid=(ds["z_cfg_resid"].dims, resid)), [2])
    assert np.isposinf(every["mean"].values).all() and (every["n"] == 0).all() and (every["n_inf"] == 3).all()
    z = ds["z"].values.copy()
    z[:] = z[:, :1]                                                       # outputs constant too: 0 / 0
    still = C.cfg_residual_ratio_per_sample(ds.assign(z=(ds["z"].dims, z), z_cfg_resid=(ds["z_cfg_resid"].dims,
                                                                                          resid)), [1])
    assert np.isnan(still.values).all()


def test_bad_inputs_quote_the_value_and_list_the_valid_ones(run):
    for lags in ([0], [1, 0], [-2], [1.5]):
        with pytest.raises(ValueError, match=r"lag must be a positive integer number of steps \(1, 2, \.\.\.\), got "):
            C.cfg_residual_ratio(run, lags)
    with pytest.raises(ValueError, match=r"got 0$"):
        C.cfg_residual_ratio_per_sample(run, 0)
    with pytest.raises(ValueError, match=r"unknown estimator 'mean'; expected one of \('pooled', 'step_mean', "
                                         r"'step_median'\)"):
        C.cfg_residual_ratio(run, [1], estimator="mean")
    with pytest.raises(ValueError, match=r"unknown tokens 'gen'; expected one of \('all', 'head'\)"):
        C.cfg_residual_ratio(run, [1], tokens="gen")
    with pytest.raises(ValueError, match=r"unknown numerator 'sum'; expected one of \('both', 'cond', 'uncond'\)"):
        C.cfg_residual_ratio(run, [1], numerator="sum")
    with pytest.raises(ValueError, match=r"no step s with s - 9 also in the store; it has steps \[0, 1, 2, 3\]"):
        C.cfg_residual_ratio(run, [1, 9])
    for bad in (1.5, -1.0, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match=r"threshold must be a cosine in \(-1, 1\] .*got " + repr(bad)[:4]):
            C.skippable_fraction(run, bad)
    with pytest.raises(ValueError, match=r"got 1.01"):
        C.skippable_sweep(run, (0.5, 1.01))
    with pytest.raises(ValueError, match=r"mar-probe record --vars dec_v"):
        C.skippable_fraction(run.drop_vars("dec_v"), 0.9)
    with pytest.raises(KeyError, match=r"mar-probe record --vars dec_v"):    # a KeyError for mapping-style callers
        C.skippable_sweep(run.drop_vars("dec_v"))
    with pytest.raises(ValueError, match=r"layer \[7\] not in the store; it has layer \[0, 1, 2\]"):
        C.skippable_fraction(run, 0.9, layer=7)
    with pytest.raises(ValueError, match=r"must not include 'sample'"):
        C.skippable_sweep(run, dim=("sample", "token"))
    with pytest.raises(ValueError, match=r"one number .*skippable_sweep"):
        C.skippable_fraction(run, [0.5, 0.9])
    with pytest.raises(ValueError, match=r"mar-probe record --vars z,z_cfg_resid"):
        C.cfg_residual_ratio(run.sel(branch=["cond"]).drop_vars("z_cfg_resid"), [1])


# ---- summary, CLI and figures --------------------------------------------------------------------------------------
def test_run_summary_claims_rows_equal_the_library(long):
    ds = long.load()
    table, skipped = A.run_summary(ds, layer=0, lazymar_layer=1, k=2, threshold=0.9, claims=True)
    assert "skippable" not in skipped and "cfg_lags" not in skipped
    sk = table[table["section"] == "skippable"]
    sweep = C.skippable_sweep(ds, sorted(set(C.SWEEP_THRESHOLDS) | {0.9}), layer=1)
    assert (sk["layer"] == 1).all() and len(sk) == sweep.sizes["threshold"]
    for _, r in sk.iterrows():
        np.testing.assert_allclose(r[["mean", "lo", "hi"]].astype(float),
                                   [sweep[q].sel(threshold=r["threshold"]).item() for q in ("mean", "lo", "hi")])
    for tokens in ("all", "head"):
        rows = table[table["quantity"] == f"ratio_branches/residual_{tokens}_tokens"]
        ref = C.cfg_residual_ratio(ds, range(1, 9), tokens=tokens)          # the 10-step run has every lag 1..8
        assert len(rows) == 8 * 3
        for _, r in rows.iterrows():
            want = ref.sel(lag=r["lag"], estimator=r["estimator"])
            np.testing.assert_allclose(r[["mean", "lo", "hi"]].astype(float), [want[q].item() for q in ("mean", "lo",
                                                                                                         "hi")])
    lines = A.headlines(table)
    assert any(h.startswith("LazyMAR token cache: share of the tokens it could skip with V cosine > 0.9 at layer 1")
               for h in lines)
    assert any("CFG residual ratio_branches/residual_head_tokens: lag 1: pooled" in h for h in lines)
    plain, _ = A.run_summary(ds, layer=0, k=2)
    assert not {"skippable", "cfg_lags"} & set(plain["section"])         # opt-in: the default table is unchanged


def _text_inside(fig):
    """Everything a drawn figure shows (titles, labels, ticks, legends) lies inside its canvas."""
    fig.canvas.draw()
    tight, page = fig.get_tightbbox(fig.canvas.get_renderer()), fig.bbox_inches        # inches
    assert tight.x0 >= page.x0 - 0.01 and tight.y0 >= page.y0 - 0.01, (tight, page)
    assert tight.x1 <= page.x1 + 0.01 and tight.y1 <= page.y1 + 0.01, (tight, page)


def test_figures_plot_their_data_inside_the_canvas(long):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mar_probe.plot import claims as P
    data = P.skippable_data(long, layer=1)
    ax = P.skippable_plot(data)
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_ydata(), data.sort_values("threshold")["mean"])
    assert (data["lo"] >= 0).all() and (data["hi"] <= 1).all() and ax.get_xlabel() and ax.get_ylabel()
    assert any(np.allclose(ln.get_ydata(), C.LAZYMAR_SKIPPABLE) for ln in ax.get_lines()[1:])
    _text_inside(ax.figure)
    plt.close(ax.figure)
    data = P.residual_ratio_data(long)
    assert set(data["tokens"]) == {"all", "head"} and sorted(set(data["lag"])) == list(range(1, 9))
    axes = P.residual_ratio_plot(data)
    for ax, tokens in zip(axes[0], ("all", "head")):
        assert ax.get_yscale() == "log" and ax.get_xlabel()
        for est in C.ESTIMATORS:
            g = data[(data["tokens"] == tokens) & (data["estimator"] == est)].sort_values("lag")
            assert any(np.allclose(ln.get_ydata(), g["mean"]) for ln in ax.get_lines())
        assert any(np.allclose(ln.get_ydata(), C.LAZYMAR_RATIO) for ln in ax.get_lines())
    assert (data["lo"] >= 0).all() and axes[0][0].get_ylabel()
    _text_inside(axes[0][0].figure)
    plt.close(axes[0][0].figure)


@pytest.fixture(scope="module")
def tiny_v_store(tmp_path_factory):
    """A recorded mar_tiny store with V: 3 samples x 10 steps, CFG 3."""
    from mar_probe.cli import main
    path = tmp_path_factory.mktemp("claims") / "run.zarr"
    assert main(["record", "--model", "mar_tiny", "--num-samples", "3", "--num-iter", "10", "--cfg", "3.0",
                 "--vars", "dec_v,z,z_cfg_resid", "--out", str(path)]) == 0
    return path


def test_analyze_claims_and_figures_commands(tiny_v_store, tmp_path, capsys):
    import json
    import pandas as pd
    from mar_probe.cli import main
    from mar_probe.store import open_run
    capsys.readouterr()
    assert main(["analyze", str(tiny_v_store), "--claims", "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "[skippable]" in text and "[cfg_lags]" in text and "LazyMAR token cache" in text
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["settings"]["claims"] is True
    rows = [r for r in report["rows"] if r["section"] == "cfg_lags"]
    assert {r["lag"] for r in rows} == set(range(1, 9)) and {r["estimator"] for r in rows} == set(C.ESTIMATORS)
    ds = open_run(tiny_v_store)
    ref = C.cfg_residual_ratio(ds, range(1, 9), tokens="head")
    r = next(r for r in rows if r["lag"] == 8 and r["estimator"] == "step_median" and "head" in r["quantity"])
    assert r["mean"] == pytest.approx(ref["mean"].sel(lag=8, estimator="step_median").item(), rel=1e-6)
    out = tmp_path / "figs"
    assert main(["figures", str(tiny_v_store), "--out", str(out), "--only",
                 "lazymar_skippable,lazymar_residual_lags"]) == 0
    for name in ("lazymar_skippable", "lazymar_residual_lags"):
        assert (out / f"{name}.png").stat().st_size > 1000 and len(pd.read_csv(out / f"{name}.csv")) > 0
    assert "lazymar_residual_lags" in (out / "index.html").read_text()
    assert main(["figures", str(tiny_v_store), "--out", str(tmp_path / "nov"), "--only", "lazymar_skippable"]) == 0
    no_v = tmp_path / "no_v.zarr"
    assert main(["record", "--model", "mar_tiny", "--num-samples", "1", "--num-iter", "3", "--cfg", "3.0",
                 "--vars", "z", "--out", str(no_v)]) == 0
    capsys.readouterr()
    assert main(["figures", str(no_v), "--out", str(tmp_path / "f2"), "--only", "lazymar_skippable"]) == 0
    assert "skipped lazymar_skippable: the store lacks variable(s) ['dec_v']; record them with `mar-probe record " \
           "--vars dec_v`" in capsys.readouterr().out
