"""The figure lint (mar_probe.plot.lint): each check fails on a deliberately bad figure and passes on a clean one;
then every figure the toolkit draws, on small real data (mar_tiny runs of a few steps), passes it.

Set MAR_PROBE_FIGURE_DIR to a folder to also save each toolkit figure there as PNG (to look at them).
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mar_probe.plot.lint import (FigureLintError, Problem, check_figure, declare_range, exempt_labels,  # noqa: E402
                                 lint_figure)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _clean(**kw):
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained", **kw)
    x = np.linspace(0, 1, 20)
    ax.plot(x, x ** 2, label="square")
    ax.fill_between(x, x ** 2 * 0.9, x ** 2 * 1.1, alpha=0.2)
    ax.set(xlabel="x", ylabel="y", title="a clean figure")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.text(0.01, 0.01, "footnote", fontsize="x-small")
    fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    declare_range(ax, 0, 1.2)
    return fig, ax


def _kinds(fig):
    return sorted({p.kind for p in lint_figure(fig)})


def test_a_clean_figure_passes():
    fig, _ = _clean()
    assert lint_figure(fig) == []
    check_figure(fig)


def test_text_outside_the_canvas_fails():
    fig, ax = _clean()
    ax.set_title("a title pushed off the top", y=1.4)
    problems = lint_figure(fig)
    assert [p.kind for p in problems] == ["outside"] and problems[0].artist == "a title pushed off the top"
    fig2, _ = _clean()
    fig2.text(0.5, -0.02, "a footnote below the canvas", ha="center", va="top")
    assert [p.artist for p in lint_figure(fig2)] == ["a footnote below the canvas"]


def test_overlapping_annotations_fail():
    fig, ax = _clean()
    ax.annotate("first annotation", (0.5, 0.25))
    ax.annotate("second annotation", (0.55, 0.25))
    problems = lint_figure(fig)
    assert [(p.kind, p.artist) for p in problems] == [("overlap", "first annotation")]
    assert "'second annotation'" in problems[0].detail


def test_legend_on_the_data_fails_but_not_beside_it_or_over_reference_lines():
    fig, ax = _clean()
    x = np.linspace(0, 1, 20)
    ax.plot(x, 1 - x, label="falling")                     # starts in the upper left, under the legend
    ax.legend(loc="upper left")
    assert _kinds(fig) == ["legend_covers_data"]
    fig2, ax2 = _clean()
    ax2.axhline(1.0, color="k", ls=":")                   # spans the axes: a reference line is not data
    ax2.axvline(0.05, color="k", ls=":")
    ax2.legend(loc="upper left")                          # over the reference lines, on no data
    assert lint_figure(fig2) == []


def test_footnote_over_a_legend_fails():
    fig, ax = _clean()
    ax.legend(loc="lower right")
    ax.text(0.99, 0.01, "a footnote in the corner, under the legend", transform=ax.transAxes, ha="right")
    problems = lint_figure(fig)
    assert {(p.kind, p.artist) for p in problems} == {("overlap", "a footnote in the corner, under the legend")}
    assert any("the legend 'square'" in p.detail for p in problems)      # its frame (and maybe its text 'square')


def test_axes_without_labels_fail():
    fig, ax = _clean()
    ax.set_ylabel("")
    assert [(p.kind, p.detail) for p in lint_figure(fig)] == [("unlabelled", "the y axis has no label")]
    fig2, ax2 = plt.subplots(layout="constrained")
    ax2.plot([0, 1], [0, 1])
    assert sorted(p.detail for p in lint_figure(fig2)) == ["the x axis has no label", "the y axis has no label"]


def test_label_exemptions():
    """Twin axes, shared axes, axes turned off, image axes with a labelled colour bar or marked as pictures pass;
    an image with an unlabelled colour bar does not."""
    fig, axes = plt.subplots(1, 3, figsize=(10, 3), sharey=True, layout="constrained")
    for ax in axes:
        ax.plot([0, 1], [0, 1])
        ax.set_xlabel("x")
    axes[0].set_ylabel("y")
    right = axes[2].twinx()
    right.plot([0, 1], [2, 1], color="C1")
    right.set_ylabel("other y")
    assert lint_figure(fig) == []
    fig2, (a, b, c) = plt.subplots(1, 3, figsize=(9, 3), layout="constrained")
    im = a.imshow(np.random.default_rng(0).random((4, 4)), vmin=0, vmax=1)
    fig2.colorbar(im, ax=a, label="value")
    b.imshow(np.zeros((4, 4, 3)))
    exempt_labels(b, "a sample")
    c.axis("off")
    assert lint_figure(fig2) == []
    fig3, ax3 = plt.subplots(layout="constrained")
    fig3.colorbar(ax3.imshow(np.zeros((4, 4))), ax=ax3)
    assert sorted(p.detail for p in lint_figure(fig3)) == [
        "the colour bar has no label along its y axis", "the x axis has no label", "the y axis has no label"]


def test_band_outside_its_declared_range_fails():
    fig, ax = _clean()
    ax.fill_between([0, 0.5, 1], [-0.1, 0.2, 0.5], [0.1, 0.4, 0.7], alpha=0.2, label="below zero")
    problems = lint_figure(fig)
    assert [(p.kind, p.artist) for p in problems] == [("band_range", "below zero")]
    declare_range(ax, -0.2, 1.2)
    assert lint_figure(fig) == []
    fig2, ax2 = _clean()
    ax2.fill_between([0, 1], [0.9, 0.9], [1.05, 1.3], alpha=0.2)
    declare_range(ax2, 0, 1)
    assert "band_range" in _kinds(fig2)


def test_what_is_not_a_problem():
    """A text against itself, empty and blank strings, invisible texts and tick labels matplotlib does not draw."""
    fig, ax = _clean()
    ax.text(0.5, 0.5, "")
    ax.text(0.5, 0.5, "   ")
    ax.text(0.5, 0.5, "hidden under", visible=False)
    ax.text(0.5, 0.5, "transparent", alpha=0)
    ax.text(0.52, 0.5, "visible text")
    ax.set_xlim(0.2, 0.8)                                                   # ticks outside the view exist, undrawn
    assert lint_figure(fig) == []


def test_rotated_tick_labels_are_compared_by_their_own_rectangles():
    """At 20° the axis-aligned extents of neighbouring labels overlap although the words do not; only the pair
    whose words touch ('compose-b' running into 'full-b') is a problem."""
    from mar_probe.plot.lint import _intersection
    fig, ax = plt.subplots(figsize=(3, 3), layout="constrained")
    ax.bar(["lazymar-b", "compose-b", "full-b", "compose-bw-h5"], [1, 2, 3, 4])
    ax.set(xlabel="strategy", ylabel="seconds")
    ax.tick_params(axis="x", labelrotation=20)
    problems = lint_figure(fig)
    assert [(p.kind, p.artist) for p in problems] == [("overlap", "compose-b")] and "'full-b'" in problems[0].detail
    first, second = (t.get_window_extent(fig.canvas.get_renderer()) for t in ax.get_xticklabels()[:2])
    assert min(_intersection(first, second)) > 10                    # lazymar-b / compose-b: extents overlap
    fig.set_figwidth(4.2)
    assert lint_figure(fig) == []


def test_check_figure_lists_every_problem():
    fig, ax = _clean()
    ax.set_title("off the top", y=1.4)
    ax.set_xlabel("")
    with pytest.raises(FigureLintError) as info:
        check_figure(fig, "bad")
    assert len(info.value.problems) == 2 and all(isinstance(p, Problem) for p in info.value.problems)
    assert str(info.value).startswith("bad has 2 problem(s):") and "outside: 'off the top'" in str(info.value)


# ---- every figure of the toolkit ---------------------------------------------------------------------------------
def _lint(fig, name):
    """Save ``fig`` under MAR_PROBE_FIGURE_DIR (when set), lint it, close it."""
    try:
        if os.environ.get("MAR_PROBE_FIGURE_DIR"):
            fig.savefig(Path(os.environ["MAR_PROBE_FIGURE_DIR"]) / f"{name}.png", dpi=120)
        check_figure(fig, name)
    finally:
        plt.close(fig)


def _figure(drawn):
    first = np.asarray(drawn, dtype=object).ravel()[0] if isinstance(drawn, (list, np.ndarray)) else drawn
    return first.figure


@pytest.fixture(scope="module")
def tiny():
    from conftest import perturbed_tiny
    return perturbed_tiny(encoder_depth=4, decoder_depth=4, num_sampling_steps="4")  # equal: one layer dim


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    """A recorded run of mar_tiny (4 decoder layers: the selection figure has later layers): 3 samples x 8 steps."""
    from mar_probe.analysis import open_runs
    from mar_probe.probe.record import record
    from mar_probe.store.spec import SelectionSpec
    path = tmp_path_factory.mktemp("lint") / "run.zarr"
    spec = SelectionSpec(variables=("dec_k", "dec_v", "dec_resid_post", "z", "z_cfg_resid", "attn_gen"))
    record(tiny, np.arange(3), path, spec, seed=0, num_iter=8, cfg=2.0)
    return open_runs(path)


def _report_names():
    from mar_probe.plot.report import FIGURES
    return list(FIGURES)


@pytest.mark.parametrize("name", _report_names())
def test_report_figures_pass(store, name):
    from mar_probe.plot.report import FIGURES
    spec = FIGURES[name]
    _lint(_figure(spec.plot(spec.data(store))), name)


def test_marche_fig12_has_the_chance_line_k_over_n(store):
    """Chance = K / N, N the tokens ranked at that step (not generating, with attention), mean over samples."""
    from mar_probe.plot import figures as F
    data = F.marche_fig12_data(store)
    k = int(data["k"].iloc[0])
    attn = store["attn_gen"].sel(branch="cond", layer=1).values                     # [sample, step, token]
    pred = store["pred"].values
    n = (np.isfinite(attn) & ~pred).sum(-1).mean(0)                                 # per step
    chance = data.drop_duplicates("step").sort_values("step")
    np.testing.assert_allclose(chance["chance"], np.minimum(1, k / n))
    ax = F.marche_fig12(data)
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "chance (K/N)")
    np.testing.assert_allclose(line.get_ydata(), np.minimum(1, k / n))


@pytest.fixture(scope="module")
def compared(tiny):
    """A sweep of MARché's budget (speed varies) and one of its selection (speed constant), with a grid."""
    from mar_probe.compare import CompareConfig, compare, sweep_runs
    out = {}
    for key, grid, fixed in (("budget", {"budget": [8, 24, 48]}, {}),
                             ("selection", {"selection": ["attention", "random", "low-attention"]}, {"budget": 20})):
        config = CompareConfig(runs=sweep_runs("marche", grid, fixed), num_samples=2, seeds=(0, 1), num_iter=4,
                               cfg=3.0, grid_images=3)
        result = compare(tiny, config, progress=False)
        result.results["sweep"] = {"strategy": "marche", "grid": grid}
        out[key] = (grid, result)
    return out


@pytest.mark.parametrize("key", ["budget", "selection"])
def test_sweep_pareto_passes(compared, key):
    from mar_probe.compare import FIDELITY, sweep_frame
    from mar_probe.plot.compare import pareto_plot
    grid, result = compared[key]
    df = sweep_frame(result.results, list(grid), "speedup_flops", "psnr")
    ax = pareto_plot(df[(df["label"] != "full") | ("psnr" not in FIDELITY)], "speedup_flops", "psnr",
                     options=list(grid))
    if key == "selection":                                   # one speed: the configurations along x, speed in the title
        assert [t.get_text() for t in ax.get_xticklabels()] == grid["selection"]
        assert ax.get_xlabel() == "swept option: selection"
        assert "FLOPs speed-up over full, end to end 1.1" in ax.get_title()
    else:
        assert ax.get_xlabel() == "FLOPs speed-up over full, end to end (×)" and ax.get_ylabel() == "PSNR vs full (dB)"
        assert any(line.get_label() == "Pareto front" and len(line.get_xdata()) > 1 for line in ax.get_lines())
    _lint(ax.figure, f"pareto_{key}")


def test_compare_grid_passes(compared, tmp_path):
    from mar_probe.plot.compare import strategy_grid_figure
    from mar_probe.compare import write_results
    _, result = compared["budget"]
    images = {label: seeds[0].images[:3] for label, seeds in result.runs.items()}
    fig = strategy_grid_figure(images, result.results)
    labels = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert labels[0] == "full\n(reference)" and labels[1].startswith("budget=8\nPSNR ") and len(labels) == 4
    _lint(fig, "compare_grid")
    assert (write_results(result, tmp_path / "cmp") / "grid.png").stat().st_size > 0


def test_shadow_figure_passes(tiny):
    import mar_probe.strategies
    from mar_probe.plot.compare import shadow_error, shadow_error_data
    from mar_probe.probe.shadow import sample_with_shadow
    _, ds = sample_with_shadow(tiny, [0, 1, 2], num_iter=6, cfg=3.0,
                               strategy=mar_probe.strategies.create("marche", budget=20, refresh_period=3))
    data = shadow_error_data(ds, "dec_kv_err")
    assert (data["lo"] >= 0).all()                                             # a relative error is >= 0
    _lint(shadow_error(data).figure, "shadow")


def test_tune_figure_passes(tiny):
    from mar_probe.engine.sampling import SamplingConfig
    from mar_probe.plot.tune import tune_plot
    from mar_probe.tune import TuneConfig, tune
    config = TuneConfig(family="marche", target="psnr>=45", space=(("budget", (8, 32, 64)),), num_samples=2,
                        calibration_seeds=(0, 1), heldout_seeds=(2,), sampling=SamplingConfig(num_iter=6, cfg=3.0))
    _lint(tune_plot(tune(tiny, config, progress=False)).figure, "tune")


def test_training_loss_figure_passes():
    from mar_probe.plot.training import plot_loss_curve
    rng = np.random.default_rng(0)
    history = [[i, 0.5 * np.exp(-i / 300) + 0.05 + 0.02 * rng.random(), i * 0.3] for i in range(1, 1001)]
    _lint(plot_loss_curve(history, window=50, phase_iterations=[400, 600]).figure, "training_loss")


def _benchmark(name, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))                # they import their neighbour common.py
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                                   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["strategies_vm", "strategies_vm_batched"])
def test_strategy_speed_figure_passes(name, monkeypatch):
    bench = _benchmark("bench_strategies", monkeypatch)
    payload = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    fig = bench.draw(payload)
    assert fig.axes[0].get_title().startswith("time per run") and fig.axes[0].get_ylabel().startswith("seconds")
    _lint(fig, name)


def test_training_stages_figure_passes(monkeypatch):
    import pandas as pd
    stages = _benchmark("training_stages", monkeypatch)
    frame = pd.read_csv(ROOT / "benchmarks" / "results" / "training_stages.csv")
    _lint(stages.draw(frame, list(dict.fromkeys(frame["stage"]))), "training_stages")


def test_widget_figures_pass(store, compared, tmp_path):
    pytest.importorskip("ipywidgets")
    from mar_probe.compare import write_results
    from mar_probe.widgets import compare_strategies, explore
    ex = explore(store, var="dec_k")
    _lint(ex.fig, "explorer")
    _, result = compared["budget"]
    cmp = compare_strategies(write_results(result, tmp_path / "cmp"))
    _lint(cmp.fig, "compare_widget")


def test_mar_probe_figures_warns_on_a_defect_and_writes_the_figure(store, tmp_path, monkeypatch):
    import pandas as pd

    from mar_probe.plot import report
    from mar_probe.plot.lint import FigureLintWarning

    def bad(data):
        _, ax = plt.subplots(layout="constrained")
        ax.plot(data["x"], data["x"])
        return ax

    monkeypatch.setitem(report.FIGURES, "bad", report.FigureSpec(lambda ds: pd.DataFrame({"x": [0, 1]}), bad, "bad"))
    with pytest.warns(FigureLintWarning, match="figure bad: unlabelled"):
        written, _ = report.write_figures(store, tmp_path, only=["bad"])
    assert written["bad"][0].stat().st_size > 0
