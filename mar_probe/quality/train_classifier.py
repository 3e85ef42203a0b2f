"""Train the Fashion-MNIST quality classifier and write its reference statistics.

Usage (the command that produced the shipped files; see ``data/CLASSIFIER.md``)::

    python -m mar_probe.quality.train_classifier --out data/fashion_classifier.pt \\
        --stats data/fashion_test_stats.npz

``--stats-only`` skips training and recomputes the statistics for an existing ``--out`` classifier.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .classifier import DEFAULT_CLASSIFIER_PATH, TrainClassifierConfig, load_classifier, train_classifier
from .fashion import DEFAULT_REFERENCE_PATH, compute_reference_stats, save_reference_stats


def build_parser() -> argparse.ArgumentParser:
    d = TrainClassifierConfig()
    p = argparse.ArgumentParser(prog="python -m mar_probe.quality.train_classifier", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DEFAULT_CLASSIFIER_PATH), help="classifier file to write (.pt)")
    p.add_argument("--stats", default=str(DEFAULT_REFERENCE_PATH), help="reference statistics to write (.npz)")
    p.add_argument("--data", default=None, help="Fashion-MNIST IDX folder (default: /usr/share/datasets/fashion-mnist)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch's default)")
    p.add_argument("--no-flip", action="store_true", help="no random horizontal flips")
    p.add_argument("--stats-only", action="store_true", help="skip training; recompute --stats for --out")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run the command line; returns (and prints as JSON) what it wrote."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.stats_only:
        model = load_classifier(args.out)
        accuracy = model.test_accuracy
    else:
        cfg = TrainClassifierConfig(out=args.out, data_dir=args.data, epochs=args.epochs, batch_size=args.batch_size,
                                    lr=args.lr, seed=args.seed, threads=args.threads, flip=not args.no_flip)
        model, accuracy = train_classifier(cfg)
    train_s = time.time() - t0
    stats = compute_reference_stats(model, args.data)
    save_reference_stats(args.stats, stats)
    floors = zip(stats["floor_sizes"], stats["floor_fd"], stats["floor_fd_std"])
    summary = {"classifier": args.out, "stats": args.stats, "test_accuracy": accuracy,
               "train_wall_time_s": None if args.stats_only else round(train_s, 1),
               "stats_wall_time_s": round(time.time() - t0 - train_s, 1),
               "floor_mean_std": {int(n): [float(m), float(s)] for n, m, s in floors}}
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
