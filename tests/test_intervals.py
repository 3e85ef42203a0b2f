"""The package's one interval function (issue 15 item 6): every statistic and interval against plain numpy written
here, clipping to a quantity's range and its flag, the bad-tail direction, and the refused inputs."""
import dataclasses

import numpy as np
import pytest
import xarray as xr
from scipy import stats

from mar_probe.quality.paired import STATISTICS, Interval, difference_bounds, interval, summarize

RNG = np.random.default_rng(7)
X = RNG.normal(0.5, 0.2, size=37)


def _by_hand_bootstrap(x, fn, n_boot=2000, seed=0, level=0.95):
    """Percentile bootstrap written independently: resample indices, statistic per resample, percentiles."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    reps = np.array([fn(x[row]) for row in idx])
    return np.percentile(reps, 100 * (1 - level) / 2), np.percentile(reps, 100 * (1 + level) / 2)


def test_mean_t_interval_equals_the_scipy_formula_by_hand():
    n = len(X)
    half = stats.t.ppf(0.975, n - 1) * np.std(X, ddof=1) / np.sqrt(n)
    got = interval(X)
    assert (got.statistic, got.method, got.n, got.level, got.clipped) == ("mean", "t", n, 0.95, False)
    assert got.estimate == pytest.approx(np.mean(X), rel=1e-14)
    assert (got.low, got.high) == pytest.approx((np.mean(X) - half, np.mean(X) + half), rel=1e-12)
    half90 = stats.t.ppf(0.95, n - 1) * np.std(X, ddof=1) / np.sqrt(n)
    assert interval(X, level=0.9).high == pytest.approx(np.mean(X) + half90, rel=1e-12)


@pytest.mark.parametrize("statistic, higher, fn", [
    ("mean", True, np.mean),
    ("median", True, np.median),
    ("p5", True, lambda v: np.quantile(v, 0.05)),
    ("p95", True, lambda v: np.quantile(v, 0.95)),
    ("tail", True, lambda v: np.quantile(v, 0.05)),
    ("tail", False, lambda v: np.quantile(v, 0.95)),
    ("worst", True, np.min),
    ("worst", False, np.max),
])
def test_bootstrap_reproduces_plain_numpy_with_the_same_seed(statistic, higher, fn):
    got = interval(X, statistic=statistic, method="bootstrap", higher_is_better=higher, seed=3)
    assert got.estimate == fn(X)
    assert (got.low, got.high) == pytest.approx(_by_hand_bootstrap(X, fn, seed=3), rel=1e-12, abs=1e-15)
    assert got.method == "bootstrap" and got.n == len(X) and not got.clipped
    assert interval(X, statistic=statistic, method="bootstrap", higher_is_better=higher, seed=3) == got
    if statistic == "mean":  # order statistics (median, worst) can land on the same values under another seed
        other = interval(X, statistic=statistic, method="bootstrap", higher_is_better=higher, seed=4)
        assert (other.low, other.high) != (got.low, got.high)


def test_default_method_and_n_boot():
    assert interval(X, statistic="median").method == "bootstrap" and interval(X).method == "t"
    got = interval(X, statistic="median", n_boot=50, level=0.8)
    assert (got.low, got.high) == pytest.approx(_by_hand_bootstrap(X, np.median, n_boot=50, level=0.8))


def test_worst_and_tail_follow_the_direction_of_the_metric():
    mse = np.array([0.01, 0.02, 0.03, 0.5, 0.04])                   # lower is better: the bad tail is high
    assert interval(mse, statistic="worst", higher_is_better=False).estimate == 0.5
    assert interval(mse, statistic="worst", higher_is_better=False).statistic == "max"
    assert interval(mse, statistic="tail", higher_is_better=False).estimate == np.quantile(mse, 0.95)
    assert interval(mse, statistic="tail", higher_is_better=False).statistic == "p95"
    psnr = np.array([30.0, 31.0, 12.0, 29.0])                        # higher is better: the bad tail is low
    assert interval(psnr, statistic="worst").estimate == 12.0 and interval(psnr, statistic="worst").statistic == "min"
    assert interval(psnr, statistic="tail").estimate == np.quantile(psnr, 0.05)
    # the bootstrap interval of the worst never passes the sample's worst
    w = interval(mse, statistic="worst", higher_is_better=False)
    assert w.high == 0.5 and w.low <= 0.5


def test_clipping_to_the_range_is_flagged_only_when_it_moves_an_end():
    ssim_like = np.array([1.0, 1.0, 1.0, 0.9])                       # t-interval of the mean would pass 1
    raw = interval(ssim_like)
    assert raw.high > 1 and not raw.clipped
    got = interval(ssim_like, bounds=(-1.0, 1.0))
    assert got.high == 1.0 and got.low == raw.low and got.clipped and got.estimate == raw.estimate
    inside = interval(np.array([0.8, 0.85, 0.9, 0.82]), bounds=(-1.0, 1.0))
    assert inside.high < 1 and not inside.clipped
    assert inside == interval(np.array([0.8, 0.85, 0.9, 0.82]))
    mse_like = np.array([0.0, 0.0, 0.0, 0.3])                        # low end would be below 0
    low = interval(mse_like, bounds=(0.0, np.inf))
    assert interval(mse_like).low < 0
    assert low.low == 0.0 and low.high == interval(mse_like).high and low.clipped
    assert not interval(X, statistic="median", bounds=(-np.inf, np.inf)).clipped


def test_one_value_has_no_interval_and_non_finite_values_are_skipped():
    one = interval([0.7], bounds=(0.0, 1.0))
    assert (one.estimate, one.low, one.high, one.n, one.clipped) == (0.7, None, None, 1, False)
    assert interval([0.7], statistic="worst").low is None
    got = interval(np.array([1.0, np.nan, 2.0, np.inf, 3.0]))
    assert got.n == 3 and got == interval([1.0, 2.0, 3.0])
    assert interval(xr.DataArray([1.0, 2.0, 3.0], dims="image")) == got


def test_interval_to_dict_round_trip_and_frozen():
    got = interval(X, statistic="tail", bounds=(0.0, 1.0))
    d = got.to_dict()
    assert set(d) == {"estimate", "low", "high", "n", "statistic", "method", "level", "clipped"}
    assert Interval.from_dict(d) == got
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.low = 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(values=X, statistic="p50"), r"unknown statistic 'p50'; expected one of \('mean', 'median', 'p5', 'p95', "
                                      r"'tail', 'worst'\)"),
    (dict(values=X, level=1.0), r"level must be in \(0, 1\), got 1\.0"),
    (dict(values=X, level=0), r"level must be in \(0, 1\), got 0"),
    (dict(values=X, level=95), r"level must be in \(0, 1\), got 95"),
    (dict(values=[], statistic="mean"), r"at least one finite value, got \[\]"),
    (dict(values=np.array([np.nan, np.nan])), r"at least one finite value, got array\(\[nan, nan\]\)"),
    (dict(values=X, method="jackknife"), r"unknown interval method 'jackknife'; expected one of \('t', 'bootstrap'\)"),
    (dict(values=X, statistic="median", method="t"), r"t-interval is for the mean, got statistic 'median'"),
    (dict(values=X, bounds=(1.0, 0.0)), r"bounds must be \(low, high\) with low <= high, got \(1\.0, 0\.0\)"),
    (dict(values=X, n_boot=0, statistic="median"), r"n_boot must be a positive integer, got 0"),
    (dict(values=np.ones((2, 3))), r"1-D values .* got shape \(2, 3\)"),
])
def test_bad_inputs_name_the_bad_value(kwargs, match):
    values = kwargs.pop("values")
    with pytest.raises(ValueError, match=match):
        interval(values, **kwargs)


def test_statistics_declared_once():
    assert STATISTICS == ("mean", "median", "p5", "p95", "tail", "worst")


def test_summarize_reports_every_statistic_with_its_interval():
    x = np.concatenate([RNG.uniform(0.9, 1.0, 30), [1.0, 1.0]])
    s = summarize(x, bounds=(-1.0, 1.0))
    assert (s["mean"], s["lo"], s["hi"], s["clipped"]) == (
        pytest.approx(x.mean()), s["statistics"]["mean"]["low"], s["statistics"]["mean"]["high"],
        s["statistics"]["mean"]["clipped"])
    for name in ("median", "tail", "worst"):
        assert s["statistics"][name] == interval(x, statistic=name, bounds=(-1.0, 1.0)).to_dict()
    assert s["statistics"]["worst"]["estimate"] == s["min"] and s["statistics"]["tail"]["estimate"] == s["q05"]
    low = summarize(x, higher_is_better=False)["statistics"]
    assert low["worst"]["estimate"] == x.max() and low["tail"]["statistic"] == "p95"
    clipped = summarize([1.0, 1.0, 0.8], bounds=(-1.0, 1.0))
    assert clipped["hi"] == 1.0 and clipped["clipped"]
    assert summarize([5.0])["lo"] == 5.0 and summarize([5.0], point_interval=False)["lo"] is None
    assert "statistics" not in summarize(x, statistics=False)


def test_difference_bounds_and_aggregate_share_the_t_formula():
    assert difference_bounds((0.0, 100.0)) == (-100.0, 100.0) and difference_bounds(None) is None
    from mar_probe.analysis import aggregate
    grid = RNG.normal(size=(9, 3))
    agg = aggregate(xr.DataArray(grid, dims=("sample", "layer")), "sample")
    for j in range(3):
        i = interval(grid[:, j])
        assert (float(agg["lo"][j]), float(agg["hi"][j])) == pytest.approx((i.low, i.high), rel=1e-12)
    single = aggregate(xr.DataArray(grid[:1], dims=("sample", "layer")), "sample")
    assert np.isnan(single["lo"]).all()                               # one sample: no interval
