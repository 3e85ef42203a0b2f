"""Write every figure of :mod:`mar_probe.plot.figures` for a run: images, the CSV of plotted values, an index."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xarray as xr

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
    pair = (4, 5) if (4, 5) in pairs else pairs[len(pairs) // 2]
    return F.cosine_map_data(ds, "dec_k", [pair], [F._layer(ds, 1)])


FIGURES = {
    "lazymar_fig1": FigureSpec(F.lazymar_fig1_data, F.lazymar_fig1,
                               "Adjacent-step cosine of decoder hidden states per token category (LazyMAR Fig. 1)."),
    "lazymar_fig2": FigureSpec(F.lazymar_fig2_data, F.lazymar_fig2,
                               "Adjacent-step MSE of cond, uncond and CFG residual, log scale (LazyMAR Fig. 2)."),
    "marche_fig1": FigureSpec(_fig1_data, F.marche_fig1,
                              "K cosine between two adjacent steps at MARché's layer on the token grid (Fig. 1)."),
    "marche_fig10": FigureSpec(lambda ds: F.cosine_map_data(ds, "dec_k", _pairs(ds), _layers(ds, "dec_k")),
                               F.marche_fig10, "K cosine maps over step pairs and layers (MARché Fig. 10)."),
    "marche_fig11": FigureSpec(lambda ds: F.cosine_map_data(ds, "dec_v", _pairs(ds), _layers(ds, "dec_v")),
                               F.marche_fig11, "V cosine maps over step pairs and layers (MARché Fig. 11)."),
    "marche_fig12": FigureSpec(F.marche_fig12_data, F.marche_fig12,
                               "Top-K attention overlap of each layer with the selection layer (MARché Fig. 12)."),
    "selection_vs_drift": FigureSpec(F.selection_vs_drift_data, F.selection_vs_drift,
                                     "Precision of attention / LazyMAR selection against actual top-K K drift."),
}


def _save(fig_name: str, spec: FigureSpec, ds, out: Path, formats) -> list[Path]:
    import matplotlib.pyplot as plt
    data = spec.data(ds)
    csv = out / f"{fig_name}.csv"
    data.to_csv(csv, index=False)
    drawn = spec.plot(data)
    first = drawn[0][0] if hasattr(drawn, "shape") or isinstance(drawn, list) else drawn
    fig = first.figure
    paths = [out / f"{fig_name}.{fmt}" for fmt in formats]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths + [csv]


def write_figures(ds: xr.Dataset, out, only=None, formats=("png",)) -> tuple[dict, dict]:
    """Write each figure as images plus ``NAME.csv`` and an ``index.md`` with captions.

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

    Returns
    -------
    (written, skipped) : (dict, dict)
        Figure name -> files written; figure name -> why it was skipped (e.g. a missing variable).
    """
    import matplotlib
    matplotlib.use("Agg")
    names = list(only) if only else list(FIGURES)
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise ValueError(f"unknown figure(s) {bad!r}; expected some of {list(FIGURES)!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = {}, {}
    for name in names:
        try:
            written[name] = _save(name, FIGURES[name], ds, out, formats)
        except (KeyError, ValueError) as exc:
            skipped[name] = str(exc.args[0] if isinstance(exc, KeyError) else exc)
    _index(out, written, skipped, formats[0])
    return written, skipped


def _index(out: Path, written: dict, skipped: dict, fmt: str) -> None:
    lines = ["# mar-probe figures", ""]
    for name, _ in written.items():
        lines += [f"## {name}", "", FIGURES[name].caption, "", f"![{name}]({name}.{fmt})",
                  f"([values]({name}.csv))", ""]
    for name, why in skipped.items():
        lines += [f"## {name} (skipped)", "", why, ""]
    (out / "index.md").write_text("\n".join(lines))
