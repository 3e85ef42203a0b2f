"""The embedded default v2 along its training, scored with the architecture pilots' protocol (issue 14).

Each checkpoint (an EMA export; a warm-started phase carries all earlier phases) samples the pilots' evaluation
set (50 images per class, 16 steps, CFG 3.0 linear, temperature 0.6, seed 0) and the project's classifier scores
it, so a row reads beside ``benchmarks/results/pilots.md``:

    python benchmarks/training_progress.py pilot=runs/pilots/fashion_b128/ema.pth phase1=runs/fb128/fashion_b128.pth

writes ``benchmarks/results/training_progress.{json,md}`` (rows of earlier calls are kept, by label).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_result  # noqa: E402
from pilot_architectures import PilotSettings, evaluate_file  # noqa: E402

NAME = "training_progress"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    s = PilotSettings(minutes=0, threads=args.threads, lr=0, batch_size=0, compile=False, eval_per_class=50,
                      eval_steps=16, eval_seed=0)
    old = RESULTS / f"{NAME}.json"
    rows = {r["preset"]: r for r in json.loads(old.read_text())["rows"]} if old.is_file() else {}
    for spec in args.checkpoints:
        label, path = spec.split("=", 1)
        # each row records the machine it was scored on: the file's top-level machine is only the last call's
        rows[label] = dict(evaluate_file(Path(path), s, label), source=path, machine=machine())
    command = "python benchmarks/training_progress.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_result(NAME, dict(command=command, protocol="50 per class, 16 steps, CFG 3.0 linear, T 0.6, seed 0",
                            rows=list(rows.values())))
    lines = ["# Embedded default v2 (fashion_b128) along its training", "", f"Command: `{command}`", "",
             "Protocol of `pilots.md`: 500 images (50 per class), 16 steps, CFG 3.0 linear, temperature 0.6, "
             "seed 0, EMA weights. Iterations and seconds are cumulative over the phases in the file.", "",
             "| checkpoint | iterations | train seconds | class accuracy | worst class | Frechet | floor | ratio |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows.values():
        worst = min(r["per_class_accuracy"].items(), key=lambda kv: kv[1])
        lines.append(f"| {r['preset']} | {r['iterations']} | {r['train_seconds']:.0f} | {r['class_accuracy']:.3f} | "
                     f"{worst[0]} {worst[1]:.2f} | {r['frechet_distance']:.1f} | {r['frechet_floor']:.2f} | "
                     f"{r['frechet_ratio']:.1f}x |")
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
