"""Two training runs from the same file and seed, differing in one setting, compared iteration by iteration.

Issue 14's CPU phases (about 1,000 iterations each) restart a cosine at a peak rate; whether a lower peak gives a
lower loss cannot be read from one phase after another (each starts from different weights), so phase 22 ran two
phases side by side from the same committed file with the same ``--seed``. The seed fixes every draw of a run
(batch indices, generation orders, label drops, timesteps, noise, mask ratios: ``mar_probe.train.TrainState``) and
the rate changes none of them, so iteration ``i`` of both runs sees the same batch and the same noise: their loss
difference at ``i`` is the weights' difference alone, without the batch-to-batch noise that one run's mean carries.

    python benchmarks/compare_training_runs.py runs/fb128_p22/checkpoint-last.pth \\
        runs/fb128_p22b/checkpoint-last.pth --name train_ab_p22

writes ``benchmarks/results/NAME.json`` (each run's settings, the mean loss of each window and the paired difference,
second minus first, with its 95% Student-t interval) and ``NAME.png`` (both runs' loss in blocks, and the paired
difference with its interval per block). Consecutive differences are not independent (the weights drift slowly),
so an interval is taken over the means of blocks of ``--block`` iterations, not over single iterations.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, sci, write_result  # noqa: E402

from mar_probe.models.checkpoints import read_checkpoint  # noqa: E402
from mar_probe.quality.paired import Interval, interval  # noqa: E402
from mar_probe.train import TrainConfig  # noqa: E402

PAIRED_FIELDS = ("init", "seed", "preset", "batch_size")  # must agree for iteration i to see the same draws


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One run's checkpoint: its config and per-iteration loss (``[N]``) and cumulative seconds."""
    path: str
    config: TrainConfig
    loss: np.ndarray
    seconds: np.ndarray

    @classmethod
    def read(cls, path: str | Path) -> Run:
        state = read_checkpoint(path)
        if "train_config" not in state or "loss_history" not in state:
            raise ValueError(f"{str(path)!r} is not a run checkpoint of `mar-probe train` (it needs 'train_config' "
                             f"and 'loss_history'; got keys {sorted(state)!r})")
        rows = np.asarray(state["loss_history"], dtype=np.float64)  # [N, 3]: iteration, loss, cumulative seconds
        return cls(path=str(path), config=TrainConfig.from_dict(state["train_config"]), loss=rows[:, 1],
                   seconds=rows[:, 2])


def check_paired(first: Run, second: Run) -> None:
    """Refuse two runs whose iteration ``i`` does not see the same batch and noise."""
    for name in PAIRED_FIELDS:
        a, b = getattr(first.config, name), getattr(second.config, name)
        if a != b:
            raise ValueError(f"runs {first.path!r} and {second.path!r} differ in {name!r} ({a!r} vs {b!r}): a paired "
                             f"comparison needs the same {', '.join(PAIRED_FIELDS)}")


def block_interval(diff: np.ndarray, block: int) -> Interval:
    """t interval of the mean of ``diff`` over the means of its consecutive blocks of ``block`` (a partial last
    block is dropped): neighbouring iterations' differences are not independent, blocks nearly are."""
    blocks = diff[: (len(diff) // block) * block].reshape(-1, block)    # [blocks, block]
    return interval(blocks.mean(axis=1), method="t")


def paired_difference(first: Run, second: Run, start: int, stop: int, *, block: int) -> dict:
    """Mean loss of each run over iterations ``[start, stop)`` and the paired difference, second minus first, with
    a t interval over the means of consecutive blocks of ``block`` iterations (a partial last block is dropped)."""
    n = min(len(first.loss), len(second.loss))
    if not 0 <= start < stop <= n or stop - start < 2 * block:
        raise ValueError(f"window [{start}, {stop}) must lie within the {n} iterations both runs completed and "
                         f"hold at least two blocks of {block}")
    diff = second.loss[start:stop] - first.loss[start:stop]            # [stop - start]
    return {"start": start, "stop": stop, "first": float(first.loss[start:stop].mean()),
            "second": float(second.loss[start:stop].mean()),
            "difference": block_interval(diff, block).to_dict()}


def windows(first: Run, second: Run, *, block: int) -> dict[str, dict]:
    """The card's windows: 200 iterations after the warm-up, the last 300 and the last 100 both runs completed."""
    n = min(len(first.loss), len(second.loss))
    warm = first.config.warmup_iters
    return {"after warm-up": paired_difference(first, second, warm, min(n, warm + 200), block=block),
            "last 300": paired_difference(first, second, max(0, n - 300), n, block=block),
            "last 100": paired_difference(first, second, max(0, n - 100), n, block=block)}


def plot(first: Run, second: Run, out: Path, *, block: int, labels: tuple[str, str]) -> Path:
    """Both runs' loss in blocks of ``5 * block`` iterations (top) and their paired difference per block (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mar_probe.plot.lint import check_figure
    size = 5 * block
    n = (min(len(first.loss), len(second.loss)) // size) * size
    mid = np.arange(n // size) * size + size / 2
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for run, label in zip((first, second), labels):
        top.plot(mid, run.loss[:n].reshape(-1, size).mean(axis=1), marker="o", ms=3, label=label)
    top.set_ylabel(f"training loss\n(mean of {size} iterations)")
    top.legend()
    diffs = [block_interval(second.loss[i:i + size] - first.loss[i:i + size], block) for i in range(0, n, size)]
    est = np.array([d.estimate for d in diffs])
    err = np.array([[d.estimate - d.low, d.high - d.estimate] for d in diffs]).T  # [2, blocks]
    bottom.errorbar(mid, est, yerr=err, fmt="o", ms=3, capsize=2)
    bottom.axhline(0.0, color="0.5", lw=0.8)
    bottom.set_ylabel("loss difference")
    bottom.set_title(f"{labels[1]} minus {labels[0]}\nthe same batches and noise; 95% t over {block}-iteration blocks",
                     fontsize=9)
    bottom.set_xlabel("iteration of the phase")
    fig.tight_layout()
    check_figure(fig, out.name)  # the project's figure lint: no clipped, overlapping or unlabelled text
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="run checkpoint (checkpoint-last.pth of `mar-probe train --out DIR`)")
    p.add_argument("second", help="the other run's checkpoint: same --init, --seed, --preset, --batch-size")
    p.add_argument("--block", type=int, default=20, help="iterations per block of the intervals")
    p.add_argument("--name", default="train_ab")
    args = p.parse_args(argv)
    if args.block < 1:
        p.error(f"--block must be a positive number of iterations, got {args.block!r}")
    first, second = Run.read(args.first), Run.read(args.second)
    check_paired(first, second)
    labels = tuple(f"lr {sci(r.config.lr)} -> {sci(r.config.min_lr)}" for r in (first, second))
    runs = [{"checkpoint": r.path, "label": label, "config": r.config.to_dict(), "iterations": len(r.loss),
             "minutes": float(r.seconds[-1] / 60)} for r, label in zip((first, second), labels)]
    compared = windows(first, second, block=args.block)  # before any file: a refused window writes nothing
    png = plot(first, second, RESULTS / f"{args.name}.png", block=args.block, labels=labels)
    command = "python benchmarks/compare_training_runs.py " + " ".join(argv or sys.argv[1:])
    out = write_result(args.name, {"command": command, "runs": runs, "block": args.block, "figure": png.name,
                                   "windows": compared})
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
