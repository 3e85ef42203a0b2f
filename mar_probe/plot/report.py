"""Write every figure of :mod:`mar_probe.plot.figures` for a run: images, the CSV of plotted values, an index."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import xarray as xr

from . import claims as CL
from . import figures as F


@dataclass(frozen=True)
class FigureSpec:
    """A figure: how to compute its data from a run, how to draw it, and a one-line caption."""
    data: Callable
    plot: Callable
    caption: str


def _pairs(ds: xr.Dataset, n: int = 3) -> list[tuple[int, int]]:
    steps = [int(s) for s in ds["step"].values]
    pairs = [(s, s + 1) for s in steps if s + 1 in steps]
    idx = sorted({round(i * (len(pairs) - 1) / max(n - 1, 1)) for i in range(n)}) if pairs else []
    return [pairs[i] for i in idx]


def _layers(ds: xr.Dataset, var: str, n: int = 4) -> list[int]:
    layers = [int(v) for v in ds[var]["layer"].values] if var in ds.data_vars else []
    return sorted({layers[round(i * (len(layers) - 1) / max(n - 1, 1))] for i in range(n)}) if layers else []


def _fig1_data(ds):
    F.require_var(ds, "dec_k")
    pairs = _pairs(ds, 99)
    if not pairs:
        raise ValueError(f"no two adjacent steps in the store; it has step {ds['step'].values.tolist()!r}")
    pair = (4, 5) if (4, 5) in pairs else pairs[len(pairs) // 2]
    return F.cosine_map_data(ds, "dec_k", [pair], [1])


FIGURES = {
    "lazymar_fig1": FigureSpec(F.lazymar_fig1_data, F.lazymar_fig1,
                               "Adjacent-step cosine of the decoder's hidden states per token category, mean over "
                               "layers, 95% CI over samples (LazyMAR Fig. 1)."),
    "lazymar_fig2": FigureSpec(F.lazymar_fig2_data, F.lazymar_fig2,
                               "Adjacent-step MSE of the cond and uncond outputs and their CFG residual (log), and "
                               "their ratio, 95% CI over samples (LazyMAR Fig. 2)."),
    "marche_fig1": FigureSpec(_fig1_data, F.marche_fig1,
                              "K cosine between two adjacent steps at layer 1 (MARché's Layer 2) on the token grid "
                              "of one sample, with the share above 0.95 over all samples (MARché Fig. 1)."),
    "marche_fig10": FigureSpec(lambda ds: F.cosine_map_data(ds, "dec_k", _pairs(ds), _layers(ds, "dec_k")),
                               F.marche_fig10, "K cosine maps over step pairs and layers, with the share above "
                               "0.95 over all samples (MARché Fig. 10)."),
    "marche_fig11": FigureSpec(lambda ds: F.cosine_map_data(ds, "dec_v", _pairs(ds), _layers(ds, "dec_v")),
                               F.marche_fig11, "V cosine maps over step pairs and layers, with the share above "
                               "0.95 over all samples (MARché Fig. 11)."),
    "marche_fig12": FigureSpec(F.marche_fig12_data, F.marche_fig12,
                               "Top-K attention overlap of each layer with the selection layer per step, 95% CI "
                               "over samples (MARché Fig. 12)."),
    "selection_vs_drift": FigureSpec(F.selection_vs_drift_data, F.selection_vs_drift,
                                     "Precision (= recall) of attention and LazyMAR V-cosine selection against the "
                                     "top-K K-drifting tokens vs K, with chance K/N (the review's open question)."),
    "lazymar_skippable": FigureSpec(CL.skippable_data, CL.skippable_plot,
                                    "Share of the tokens LazyMAR's token cache could skip whose V cosine to the "
                                    "previous step (mean over heads, layer 3 or a quarter of the depth) exceeds each "
                                    "threshold, pooled per sample, 95% CI over samples; LazyMAR: ~84%."),
    "lazymar_residual_lags": FigureSpec(CL.residual_ratio_data, CL.residual_ratio_plot,
                                        "How many times more the CFG branch outputs change than their residual between "
                                        "steps s - L and s, per estimator and lag, all tokens and the tokens the head "
                                        "reads, 95% CI over samples (LazyMAR: 35.5x)."),
}


def _check_formats(formats) -> list[str]:
    from matplotlib.figure import Figure
    formats = [f.strip().lower() for f in formats if f.strip()]
    valid = sorted(Figure().canvas.get_supported_filetypes())
    bad = [f for f in formats if f not in valid]
    if bad or not formats:
        raise ValueError(f"unknown image format(s) {bad or formats!r}; expected some of {valid!r}")
    return formats


def _warn_defects(fig_name: str, fig) -> None:
    """A warning per defect :func:`mar_probe.plot.lint.lint_figure` finds (the figure is written all the same)."""
    import warnings
    from .lint import FigureLintWarning, lint_figure
    for problem in lint_figure(fig):
        warnings.warn(f"figure {fig_name}: {problem}", FigureLintWarning, stacklevel=2)


def _save(fig_name: str, spec: FigureSpec, ds, out: Path, formats) -> list[Path]:
    import matplotlib.pyplot as plt
    data = spec.data(ds)
    csv = out / f"{fig_name}.csv"
    data.to_csv(csv, index=False)
    drawn = spec.plot(data)
    first = drawn[0][0] if hasattr(drawn, "shape") or isinstance(drawn, list) else drawn
    fig = first.figure
    _warn_defects(fig_name, fig)
    paths = [out / f"{fig_name}.{fmt}" for fmt in formats]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths + [csv]


def write_figures(ds: xr.Dataset, out, only=None, formats=("png",), progress: bool = False,
                  scheduler=None) -> tuple[dict, dict]:
    """Write each figure as images plus ``NAME.csv`` (its plotted values) and ``index.md``/``index.html``.

    Parameters
    ----------
    ds : xarray.Dataset
        A run from :func:`mar_probe.store.open_run`.
    out : str or Path
        Output folder (created).
    only : sequence of str, optional
        Figure names to write (default: all of :data:`FIGURES`).
    formats : sequence of str
        Image formats (``png``, ``pdf``, ``svg``).
    progress : bool
        Show a progress bar over the figures.
    scheduler : str or distributed.Client, optional
        Where the figures' reductions compute (as for :func:`~mar_probe.analysis.run_summary`): a dask scheduler
        name, a :class:`distributed.Client` (:func:`~mar_probe.analysis.cluster.dask_cluster`), or None: dask's
        default.

    Returns
    -------
    (written, skipped) : (dict, dict)
        Figure name -> files written; figure name -> why it was skipped (e.g. a missing variable).
    """
    import matplotlib
    matplotlib.use("Agg")
    from ..analysis._checks import require_completed
    from ..analysis.cluster import using_scheduler
    with using_scheduler(scheduler):  # its read of the done flags too
        require_completed(ds)
    names = list(only) if only else list(FIGURES)
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise ValueError(f"unknown figure(s) {bad!r}; expected some of {list(FIGURES)!r}")
    formats = _check_formats(formats)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = {}, {}
    from tqdm.auto import tqdm
    with using_scheduler(scheduler):
        for name in tqdm(names, desc="figures", unit="fig", disable=not progress):
            try:
                written[name] = _save(name, FIGURES[name], ds, out, formats)
            except (KeyError, ValueError) as exc:
                skipped[name] = str(exc.args[0] if isinstance(exc, KeyError) else exc)
    _index(out, written, skipped, formats[0])
    return written, skipped


@dataclass(frozen=True)
class IndexEntry:
    """One section of an HTML index: a title, a caption, an image (None: text only), a link to its values and a
    preformatted text block."""
    title: str
    caption: str
    image: str | None = None
    values: str | None = None
    text: str | None = None


def index_html(title: str, entries) -> str:
    """A self-contained HTML page of ``entries`` (:class:`IndexEntry`), one section each."""
    import html
    body = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;max-width:60em;margin:auto}img{max-width:100%}</style>",
            f"<h1>{html.escape(title)}</h1>"]
    for e in entries:
        link = f" (<a href='{e.values}'>values</a>)" if e.values else ""
        body += [f"<h2>{html.escape(e.title)}</h2>", f"<p>{html.escape(e.caption)}{link}</p>"]
        body += [f"<img src='{e.image}' alt='{html.escape(e.title)}'>"] if e.image else []
        body += [f"<pre>{html.escape(e.text)}</pre>"] if e.text else []
    return "\n".join(body) + "\n"


def figure_entries(written, skipped: dict, fmt: str, folder: str = "") -> list[IndexEntry]:
    """Index entries of written figures (image and values under ``folder``) and of skipped ones (why)."""
    out = [IndexEntry(name, FIGURES[name].caption, f"{folder}{name}.{fmt}", f"{folder}{name}.csv") for name in written]
    return out + [IndexEntry(f"{name} (skipped)", why) for name, why in skipped.items()]


def _index(out: Path, written: dict, skipped: dict, fmt: str) -> None:
    """``index.md`` and ``index.html``: every figure with its one-line caption and a link to its values."""
    lines = ["# mar-probe figures", ""]
    for name in written:
        cap = FIGURES[name].caption
        lines += [f"## {name}", "", cap, "", f"![{name}]({name}.{fmt})", f"([values]({name}.csv))", ""]
    for name, why in skipped.items():
        lines += [f"## {name} (skipped)", "", why, ""]
    (out / "index.md").write_text("\n".join(lines))
    (out / "index.html").write_text(index_html("mar-probe figures", figure_entries(written, skipped, fmt)))
