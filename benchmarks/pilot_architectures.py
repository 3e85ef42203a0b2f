"""Pilot runs that choose the embedded default's architecture by measurement (issue 14).

Each candidate preset trains for the same wall-clock budget, all of them at once with the same number of torch
threads each (so they share the machine alike), with the same recipe (constant learning rate after warm-up, so
that a run stopped by the clock is not favoured by a schedule tuned to its length). Then each EMA checkpoint
samples the same labels with the same settings, and the project's classifier scores them: class accuracy and
Frechet distance against the test split, beside the real-vs-real floor of the same n.

    python benchmarks/pilot_architectures.py --minutes 25 --out runs/pilots

writes ``benchmarks/results/pilots.{json,md}``. The training runs are resumable (a rerun with the same --out
skips finished candidates and only evaluates).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class PilotSettings:
    minutes: float
    threads: int
    lr: float
    batch_size: int
    compile: bool
    eval_per_class: int
    eval_steps: int
    eval_seed: int


def _train_command(preset: str, out: Path, s: PilotSettings) -> list[str]:
    exe = shutil.which("mar-probe") or "mar-probe"
    cmd = [exe, "train", "--preset", preset, "--out", str(out), "--iters", "100000", "--max-minutes", str(s.minutes),
           "--lr", str(s.lr), "--min-lr", str(s.lr), "--batch-size", str(s.batch_size), "--threads", str(s.threads),
           "--ckpt-every", "50", "--export", str(out / "ema.pth")]
    return cmd + (["--compile"] if s.compile else [])


def train_all(presets: list[str], root: Path, s: PilotSettings) -> dict[str, float]:
    """Train every candidate at once (one process each, lowered priority); returns each run's wall seconds."""
    procs, started = {}, {}
    for preset in presets:
        out = root / preset
        if (out / "ema.pth").exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "train.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
        procs[preset] = subprocess.Popen(["nice", "-n", "5", *_train_command(preset, out, s)], stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        started[preset] = time.time()
    walls = {}
    for preset, proc in procs.items():
        if proc.wait():
            raise SystemExit(f"training {preset!r} failed (exit {proc.returncode}); see {root / preset / 'train.log'}")
        walls[preset] = time.time() - started[preset]
    return walls


def evaluate(preset: str, root: Path, s: PilotSettings) -> dict:
    """Sample eval_per_class images of every class from the candidate's EMA weights and score them."""
    return evaluate_file(root / preset / "ema.pth", s, label=preset)


def evaluate_file(path: Path, s: PilotSettings, label: str) -> dict:
    """The pilots' evaluation of any exported checkpoint (so later training phases compare with the pilots)."""
    import numpy as np

    from mar_probe import load_model, sample
    from mar_probe.models.checkpoints import read_checkpoint, read_history
    from mar_probe.quality import quality_report
    state = read_checkpoint(path)
    history = read_history(path, state)
    model = load_model(path)
    labels = np.repeat(np.arange(model.num_classes), s.eval_per_class)
    t0 = time.time()
    res = sample(model, labels, num_iter=s.eval_steps, cfg=3.0, cfg_schedule="linear", temperature=0.6,
                 seed=s.eval_seed, batch_size=100, progress=True)
    sample_s = time.time() - t0
    report = quality_report({"images": res.images, "labels": res.labels})
    n_params = sum(p.numel() for p in model.parameters())
    tail = [h[1] for h in history[-100:]]
    return dict(preset=label, params=n_params, iterations=len(history), train_seconds=history[-1][2],
                seconds_per_iteration=history[-1][2] / len(history), final_loss_mean100=float(np.mean(tail)),
                sample_seconds=sample_s, **_scores(report))


def _scores(report: dict) -> dict:
    keep = ("num_images", "class_accuracy", "per_class_accuracy", "frechet_distance", "frechet_floor",
            "frechet_floor_std", "frechet_ratio")
    return {k: report[k] for k in keep if k in report}


def write_table(rows: list[dict], s: PilotSettings, command: str) -> Path:
    lines = [f"# Architecture pilots (issue 14): {s.minutes:g} min of training each, all candidates at once, "
             f"{s.threads} thread(s) each", "", f"Command: `{command}`", "",
             f"Evaluation: {s.eval_per_class} images per class, {s.eval_steps} steps, CFG 3.0 linear, "
             f"temperature 0.6, seed {s.eval_seed}, EMA weights; classifier `data/fashion_classifier.pt`.", "",
             "| preset | parameters | iterations | s/iteration | loss (last 100) | class accuracy | Frechet | "
             "floor (same n) | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['preset']}` | {r['params'] / 1e6:.2f}M | {r['iterations']} | "
                     f"{r['seconds_per_iteration']:.2f} | {r['final_loss_mean100']:.4f} | {r['class_accuracy']:.3f} | "
                     f"{r['frechet_distance']:.1f} | {r['frechet_floor']:.2f} | {r['frechet_ratio']:.1f}x |")
    path = RESULTS / "pilots.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="fashion_b128,fashion_b192,fashion_b256")
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--eval-per-class", type=int, default=50)
    p.add_argument("--eval-steps", type=int, default=16)
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--out", default="runs/pilots")
    args = p.parse_args(argv)
    s = PilotSettings(minutes=args.minutes, threads=args.threads, lr=args.lr, batch_size=args.batch_size,
                      compile=not args.no_compile, eval_per_class=args.eval_per_class, eval_steps=args.eval_steps,
                      eval_seed=args.eval_seed)
    presets, root = args.presets.split(","), Path(args.out)
    train_all(presets, root, s)
    import torch
    torch.set_num_threads(2)
    rows = [evaluate(preset, root, s) for preset in presets]
    command = "python benchmarks/pilot_architectures.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_result("pilots", dict(command=command, settings=s.__dict__, candidates=rows))
    print(write_table(rows, s, command).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
