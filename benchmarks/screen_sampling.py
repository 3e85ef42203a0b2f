"""The temperature / CFG screening behind the shipped model's recommended sampling settings (``data/README.md``).

For each setting (temperature, CFG scale) the model samples the same 100 images (10 per class, 16 steps, linear
CFG schedule, seed 1, the model's head steps unless ``--head-steps``; every other setting is the checkpoint's
``sampling_defaults``) and the project's classifier
scores them (:func:`mar_probe.quality.quality_report`: class accuracy, Fréchet distance of its features against
the test split, the real-vs-real floor of the same n):

    python benchmarks/screen_sampling.py --threads 1

writes ``benchmarks/results/sampling_screen.json`` (``--name`` for another file) with the command, the model's weights
SHA-256 and the machine, rewritten after every setting, so a stopped screen keeps the settings it finished; a rerun
with the same weights and protocol reuses the file's rows and samples only the settings it lacks. Each setting it
samples also leaves its sample grid beside the file, ``NAME_T<temperature>_cfg<scale>.png`` (one row per class, the
first ``--grid-per-class`` images of each; issue 14 asks for the grid beside the scores), named in the row.
``--shards N`` samples in N processes side by side (one core each at ``--threads 1``): shard k takes every N-th
label from k with seed ``seed + 1000 k`` (:func:`shard_seeds`; shard 0 keeps the seed) and the union is scored, so a
1,000-image score at the papers' 64 steps (three times the time of 16:
``benchmarks/results/sampling_steps{64,16}_b128_p27_1000_t08cfg5.json``) fits a session on two cores; the protocol
then records ``shards``. The screen of the embedded default v2 (issue 14) at 200 images:

    python benchmarks/screen_sampling.py --checkpoint data/fashion_b128.pth --per-class 20 --threads 1 \
        --settings 0.6:3.0,0.8:3.0,0.6:2.0,0.4:3.0,0.3:3.0,0.2:3.0 --name sampling_screen_b128
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_path, write_result  # noqa: E402
from pilot_architectures import _scores  # noqa: E402

NAME = "sampling_screen"
# (temperature, CFG scale): MAR's temperature 1.0 and lower ones at CFG 3.0, then a lower CFG at T 0.6
SETTINGS = ((1.0, 3.0), (0.8, 3.0), (0.6, 3.0), (0.5, 3.0), (0.6, 2.0))


def parse_settings(text: str) -> tuple[tuple[float, float], ...]:
    """``"1.0:3.0,0.6:2.0"`` -> ((1.0, 3.0), (0.6, 2.0)): temperature:cfg pairs."""
    try:
        return tuple((float(t), float(c)) for t, c in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TEMPERATURE:CFG pairs separated by commas (e.g. "
                                         f"'1.0:3.0,0.6:2.0'), got {text!r}") from None


def shard_seeds(seed: int, shards: int) -> list[int]:
    """The seed of each shard: shard 0 keeps ``seed`` (one shard is the unsharded screen), shard k takes
    ``seed + 1000 * k`` so that no two shards, nor two screens' seeds 1, 2, ..., share their draws."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards!r}")
    return [seed + 1000 * k for k in range(shards)]


def shard_labels(labels, shards: int) -> list:
    """Every ``shards``-th label from k: class-balanced shards when the labels repeat each class (np.repeat)."""
    return [labels[k::shards] for k in range(shards)]


def positive_int(text: str) -> int:
    """``--shards``: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def _draw(model, labels, seed: int, temperature: float, cfg: float, args, progress: bool) -> tuple:
    """One ``sample`` call of the screen's protocol: images, labels and the sampling settings."""
    from mar_probe import sample
    res = sample(model, labels, num_iter=args.steps, cfg=cfg, cfg_schedule="linear", temperature=temperature,
                 head_steps=args.head_steps, seed=seed, batch_size=args.batch_size, progress=progress)
    return res.images, res.labels, res.settings


def _sample_shard(checkpoint: str, labels, seed: int, temperature: float, cfg: float, args, progress: bool) -> tuple:
    """One shard in its own process (``--threads`` torch threads); shard 0 shows its progress bar (the shards keep
    pace), the others stay quiet so the bars do not interleave."""
    import torch

    from mar_probe import load_model
    torch.set_num_threads(args.threads)
    return _draw(load_model(checkpoint), labels, seed, temperature, cfg, args, progress)


def _sample(model, labels, temperature: float, cfg: float, args) -> tuple:
    """The screen's images: in this process (one shard), else ``--shards`` processes side by side, concatenated."""
    import numpy as np
    if args.shards == 1:
        return _draw(model, labels, args.seed, temperature, cfg, args, progress=True)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    n, seeds = args.shards, shard_seeds(args.seed, args.shards)
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_sample_shard, [args.checkpoint] * n, shard_labels(labels, n), seeds,
                              [temperature] * n, [cfg] * n, [args] * n, [k == 0 for k in range(n)]))
    settings = dict(parts[0][2], seed=seeds)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), settings


def screen_one(model, labels, temperature: float, cfg: float, args) -> dict:
    """Sample ``labels`` at one (temperature, cfg) and score the images with the project's classifier."""
    from mar_probe.quality import quality_report
    t0 = time.time()
    images, labels, settings = _sample(model, labels, temperature, cfg, args)
    seconds = time.time() - t0
    report = quality_report({"images": images, "labels": labels})
    grid = _save_grid(images, labels, args.grid_per_class,
                      result_path(args.name).with_name(f"{args.name}_T{temperature:g}_cfg{cfg:g}.png"))
    return dict(temperature=temperature, cfg=cfg, sample_seconds=seconds, settings=settings, grid=grid.name,
                **_scores(report))


def grid_order(labels, per_class: int) -> list[int]:
    """Indices of the first ``per_class`` images of each class, class by class (a grid row per class)."""
    import numpy as np
    labels = np.asarray(labels)
    return [int(i) for c in np.unique(labels) for i in np.flatnonzero(labels == c)[:per_class]]


def _save_grid(images, labels, per_class: int, path: Path) -> Path:
    from mar_probe.plot.grid import save_image_grid
    return save_image_grid(images[grid_order(labels, per_class)], path, ncols=per_class, scale=2)


def _earlier_rows(path: Path, head: dict) -> list[dict]:
    """The rows of an earlier screen of the same weights and protocol (none when the file is absent or differs)."""
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    same = all(old.get(k) == head[k] for k in ("weights_sha256", "protocol", "checkpoint"))
    return list(old["rows"]) if same else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="the checkpoint to screen (default: the embedded default)")
    p.add_argument("--settings", type=parse_settings, default=SETTINGS, help="TEMPERATURE:CFG pairs, comma-separated")
    p.add_argument("--per-class", type=int, default=10)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--head-steps", default=None,
                   help="the diffusion head's reverse steps (num_sampling_steps, e.g. 100; default: the model's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--grid-per-class", type=int, default=10, help="images of each class in the sample grid")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shards", type=positive_int, default=1,
                   help="processes side by side, each sampling every N-th image with its own seed (shard_seeds)")
    p.add_argument("--name", default=NAME, help="result file: benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from mar_probe import load_model
    from mar_probe.engine import SamplingConfig
    from mar_probe.models.checkpoints import DEFAULT_CHECKPOINT, read_checkpoint, read_history
    from mar_probe.probe.record import weights_sha256
    torch.set_num_threads(args.threads)
    if args.checkpoint is None:  # named as the repository names it, as a given path is
        args.checkpoint = str(DEFAULT_CHECKPOINT.relative_to(Path(__file__).resolve().parents[1]))
    model = load_model(args.checkpoint)
    labels = np.repeat(np.arange(model.num_classes), args.per_class)
    command = "python benchmarks/screen_sampling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    state = read_checkpoint(args.checkpoint)
    trained = len(read_history(args.checkpoint, state)) if "train_config" in state else 0  # 0: not by mar_probe
    head = dict(command=command, checkpoint=args.checkpoint, weights_sha256=weights_sha256(model), iterations=trained,
                protocol=dict(per_class=args.per_class, num_images=len(labels), steps=args.steps,
                              head_steps=SamplingConfig(head_steps=args.head_steps).resolve(model).head_steps,
                              cfg_schedule="linear", seed=args.seed))
    if args.shards != 1:  # only then, so that the protocol of every unsharded screen stays as it was
        head["protocol"]["shards"] = args.shards
    rows = _earlier_rows(result_path(args.name), head)
    path = write_result(args.name, dict(head, rows=rows))  # this call's head over the rows it reuses
    for t, c in args.settings:
        if (t, c) in {(r["temperature"], r["cfg"]) for r in rows}:
            continue
        rows.append(screen_one(model, labels, t, c, args))
        write_result(args.name, dict(head, rows=rows))  # after every setting: a stopped screen keeps them
    for r in rows:
        print(f"T {r['temperature']:g}, CFG {r['cfg']:g}: accuracy {r['class_accuracy']:.3f}, "
              f"Frechet {r['frechet_distance']:.1f} ({r['sample_seconds']:.0f} s)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
