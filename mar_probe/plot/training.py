"""Training curves."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_loss_curve(history, path=None, ax=None, window: int = 50, phase_iterations=None):
    """Plot the training loss (raw and a moving average) against iterations.

    Parameters
    ----------
    history : sequence of [iteration, loss, seconds], or a packed [N, 2] tensor
        A run checkpoint's ``loss_history``, or a packed one (``history_rows``); an export's lies beside it
        (:func:`plot_checkpoint_loss` reads it).
    path : str or Path, optional
        Save the figure here.
    ax : matplotlib Axes, optional
    window : int
        Width of the moving average.
    phase_iterations : sequence of int, optional
        Iterations of each training phase (an export's ``phase_iterations``): a dotted line marks each new phase.
    """
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from ._style import legend_beside
    from ..models.checkpoints import history_rows
    h = np.asarray(history_rows(history), dtype=float)                  # [N, 3] iteration, loss, seconds
    if ax is None:
        _, ax = plt.subplots(figsize=(7.6, 3.5), layout="constrained")
    ax.plot(h[:, 0], h[:, 1], lw=0.5, alpha=0.35, label="loss per iteration")
    if len(h) >= window:
        smooth = np.convolve(h[:, 1], np.ones(window) / window, mode="valid")
        ax.plot(h[window - 1:, 0], smooth, lw=1.5, label=f"moving average ({window})")
    for start in np.cumsum(phase_iterations or [])[:-1]:
        ax.axvline(start, color="grey", ls=":", lw=1)
    ax.set(xlabel="iteration", ylabel="diffusion loss (MSE + VB)", yscale="log",
           title=f"training loss, {h[-1, 2] / 60:.0f} min wall time")
    legend_beside(ax)
    if path is not None:
        ax.figure.savefig(Path(path), dpi=120)
    return ax


def plot_checkpoint_loss(checkpoint, path=None, ax=None, window: int = 50):
    """:func:`plot_loss_curve` of a trained checkpoint: its loss history (beside an export, or inside a run
    checkpoint: :func:`~mar_probe.models.checkpoints.read_history`) with a dotted line where each phase began.

    The model card's figure: ``plot_checkpoint_loss("data/fashion_b128.pth",
    "data/fashion_b128_loss.png")``."""
    from ..models.checkpoints import read_checkpoint, read_history
    state = read_checkpoint(checkpoint)
    return plot_loss_curve(read_history(checkpoint, state), path, ax=ax, window=window,
                           phase_iterations=state.get("phase_iterations"))
