"""The figure of ``mar-probe tune``: the calibration candidates' speed against fidelity, the target and the choice."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .compare import axis_label

if TYPE_CHECKING:
    from ..tune import TuneResult


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _bars(intervals) -> np.ndarray:
    """[2, n] distances from each mean to its interval's ends (errorbar's layout)."""
    return np.array([[i.mean - i.lo for i in intervals], [i.hi - i.mean for i in intervals]], dtype=np.float64)


def tune_plot(result: TuneResult, ax=None):
    """FLOPs speed-up over ``full`` (x) against the target metric (y, mean over images) of every calibration
    candidate, with interval bars; candidates meeting the target filled, the others hollow; the target as a dashed
    line, the chosen configuration starred and its held-out measurement as a diamond."""
    from ._style import legend_beside
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(8.4, 4.4), layout="constrained")
    target = result.config.target
    for meets, style in ((True, dict(fmt="o", label="meets the target (calibration)")),
                         (False, dict(fmt="o", mfc="none", label="misses it (calibration)"))):
        evs = [e for e in result.candidates if result.meets(e) == meets]
        if not evs:
            continue
        speed, fid = [e.speedup_flops for e in evs], [e.metric(target.metric) for e in evs]
        ax.errorbar([s.mean for s in speed], [f.mean for f in fid], xerr=_bars(speed), yerr=_bars(fid), ms=5,
                    lw=0.8, capsize=2, color="C0" if meets else "C3", **style)
        for e, s, f in zip(evs, speed, fid):
            ax.annotate(e.run.label, (s.mean, f.mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(target.value, color="k", ls="--", lw=1, label=f"target {target.describe}")
    if result.chosen is not None:
        c = result.chosen
        ax.plot([c.speedup_flops.mean], [c.metric(target.metric).mean], "*", ms=16, color="C2", mec="k",
                label=f"chosen: {c.run.label}")
    if result.heldout is not None:
        h = result.heldout
        ax.errorbar([h.speedup_flops.mean], [h.metric(target.metric).mean], xerr=_bars([h.speedup_flops]),
                    yerr=_bars([h.metric(target.metric)]), fmt="D", ms=6, color="C1", capsize=2,
                    label=f"chosen on held-out seeds ({'met' if result.met else 'not met'})")
    ax.set(xlabel=axis_label("speedup_flops"), ylabel=axis_label(target.metric),
           title=f"tune {result.config.family}: {result.config.search} search")
    ax.grid(alpha=0.3)
    legend_beside(ax, fontsize=7)
    return ax


def save_tune_plot(result: TuneResult, path) -> Path:
    """:func:`tune_plot` as a PNG at ``path``."""
    plt = _plt()
    ax = tune_plot(result)
    path = Path(path)
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)
    return path
