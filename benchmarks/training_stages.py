"""The headline measurements of docs/findings.md at several training stages of one architecture (issue 14).

Which conclusions are properties of the architecture and the decoding schedule, and which move with training?
Each stage (random initialisation, an early checkpoint, the final model) is recorded and summarised as
``mar-probe study`` does (same samples, seeds and sampling settings for every stage), and ``full``, ``marche``
and ``lazymar`` sample the same labels and seeds for their paired fidelity against ``full``:

    python benchmarks/training_stages.py --stage init=init:fashion_b128 \\
        --stage early=runs/pilots/fashion_b128/ema.pth --stage final=data/fashion_b.pth --out runs/stages

writes ``benchmarks/results/training_stages.{csv,json,png}``: one row per (stage, quantity) with the mean, its
95% t-interval over samples (images for the fidelity rows) and n. ``init:PRESET`` is the preset's random
initialisation exactly as ``mar-probe train`` draws it (seed 0); ``git:REV:PATH`` a checkpoint as commit REV
held it (every training phase commits its weights, so a stage outlives the machine that trained it):

    python benchmarks/training_stages.py --stage init=init:fashion_b128 \\
        --stage phase1=git:9bcf235:data/training/fashion_b128.pth --stage latest=data/fashion_b128.pth

``--reuse benchmarks/results/training_stages.json`` takes every stage the committed file measured with the same
weights and settings from it, so adding the next phase's column measures that stage only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine  # noqa: E402

NAME = "training_stages"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    """What every stage is measured with (identical across stages, so the rows compare)."""
    samples_per_seed: int
    seeds: tuple[int, ...]
    compare_samples: int
    compare_seeds: tuple[int, ...]
    num_iter: int
    cfg: float
    temperature: float
    layer: int          # MARche's selection layer, 0-based (its "Layer 2" is 1)
    lazymar_layer: int  # LazyMAR's pruning layer, 0-based (index 3 of MAR-B's 12 decoder layers)
    k: int


def committed_checkpoint(rev_path: str, folder: Path) -> Path:
    """``REV:PATH`` of this repository (a checkpoint as an earlier commit held it: each training phase commits
    the weights, so every stage stays reachable after the machine that trained it is gone) -> a file in
    ``folder``."""
    got = subprocess.run(["git", "show", rev_path], cwd=ROOT, capture_output=True, check=False)
    if got.returncode != 0:
        raise ValueError(f"git show {rev_path!r} failed ({got.stderr.decode().strip()}); expected REV:PATH of a "
                         f"committed checkpoint, e.g. 9bcf235:data/training/fashion_b128.pth")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "committed.pth"
    path.write_bytes(got.stdout)
    return path


def load_stage(spec: str, folder: Path):
    """``init:PRESET`` (the training run's random initialisation), ``git:REV:PATH`` (a committed checkpoint,
    written to ``folder``) or a checkpoint path -> (model, checkpoint path or None)."""
    import torch

    from mar_probe.models import MAR, preset_config
    from mar_probe.models.checkpoints import load_model
    if spec.startswith("init:"):
        torch.manual_seed(0)  # as mar_probe.train.train draws the initial weights
        return MAR(preset_config(spec[len("init:"):])).eval(), None
    path = committed_checkpoint(spec[len("git:"):], folder) if spec.startswith("git:") else spec
    return load_model(path), str(path)


def _row(stage: str, quantity: str, r) -> dict:
    return dict(stage=stage, quantity=quantity, mean=float(r["mean"]), lo=float(r["lo"]), hi=float(r["hi"]),
                n=int(r["n"]))


def summary_rows(stage: str, table: pd.DataFrame, s: StageSettings) -> list[dict]:
    """The findings' headline numbers, read off a run_summary table."""
    def one(**match):
        sel = np.ones(len(table), bool)
        for col, val in match.items():
            sel &= (table[col] == val).to_numpy()
        if not sel.any():
            raise KeyError(f"no summary row matches {match!r}")
        return table[sel].iloc[0]
    gaps = table[(table["quantity"] == "mean_cos_minus_t-1") & (table["var"] == "dec_resid_post")]
    nxt = s.layer + 1
    rows = [_row(stage, "t-1 mean cosine (hidden state)", one(quantity="mean_cos", var="dec_resid_post",
                                                              category="t-1")),
            _row(stage, "closest category minus t-1 (cosine)", gaps.loc[gaps["mean"].idxmin()]),
            _row(stage, "CFG residual ratio, step-averaged MSE", one(quantity="ratio_cond/residual")),
            _row(stage, "CFG residual ratio, median step", one(quantity="median_step_ratio_cond/residual"))]
    for selector, label in ((f"attention@layer{s.layer}", "attention"),
                            (f"lazymar_vcos@layer{s.lazymar_layer}", "LazyMAR V-cosine"), ("random", "random")):
        r = one(section="selection", quantity="precision_topk_drift", selector=selector, layer=nxt)
        rows.append(_row(stage, f"top-{s.k} precision vs K drift at layer {nxt}: {label}", r))
    rows.append(_row(stage, f"top-{s.k} attention overlap, layer {nxt} with layer {s.layer}",
                     one(quantity=f"topk_overlap_with_layer{s.layer}", layer=nxt)))
    return rows


def study_stage(stage: str, model, checkpoint, out: Path, s: StageSettings) -> list[dict]:
    from mar_probe.analysis import open_runs, run_summary
    from mar_probe.study import StudyConfig, record_stores
    cfg = StudyConfig(out=str(out), samples_per_seed=s.samples_per_seed, seeds=s.seeds, num_iter=s.num_iter,
                      cfg=s.cfg, temperature=s.temperature, layer=s.layer, k=s.k)
    out.mkdir(parents=True, exist_ok=True)
    ds = open_runs(record_stores(model, cfg, checkpoint=checkpoint))
    table, skipped = run_summary(ds, layer=s.layer, lazymar_layer=s.lazymar_layer, k=s.k)
    if skipped:
        raise SystemExit(f"stage {stage!r}: summary sections skipped: {skipped!r}")
    return summary_rows(stage, table, s)


def compare_stage(stage: str, model, s: StageSettings) -> list[dict]:
    """marche and lazymar against full on the same images: PSNR, and marche minus lazymar per image."""
    from mar_probe.compare import CompareConfig, StrategyRun, compare
    runs = (StrategyRun(label="marche", name="marche"), StrategyRun(label="lazymar", name="lazymar"))
    config = CompareConfig(runs=runs,
                           num_samples=s.compare_samples, seeds=s.compare_seeds, num_iter=s.num_iter, cfg=s.cfg,
                           temperature=s.temperature, batch_size=s.compare_samples, paired_against="lazymar",
                           grid_images=0)
    res = compare(model, config).results["strategies"]
    return [_row(stage, "marche PSNR vs full (dB)", res["marche"]["fidelity"]["psnr"]),
            _row(stage, "lazymar PSNR vs full (dB)", res["lazymar"]["fidelity"]["psnr"]),
            _row(stage, "marche minus lazymar PSNR, paired (dB)", res["marche"]["paired"]["psnr"])]


def earlier_rows(path: Path | None, name: str, source: dict, s: StageSettings) -> list[dict] | None:
    """Rows of an earlier result file (``--reuse``) for the same weights measured with the same settings, under
    stage ``name``, else None. The ``out`` folder's cache dies with the machine; the committed file does not, so a
    later session adds a stage (the next training phase) without measuring the committed ones again (issue 14).
    The weights are matched by their SHA-256 under whichever name and source the file gave them: when a later phase
    ships, the file's ``final`` stage becomes a named phase (``git:REV:PATH``) and is reused as such."""
    if path is None:
        return None
    old = json.loads(path.read_text())
    if old["settings"] != json.loads(json.dumps(s.__dict__)):
        return None
    names = [n for n, src in old["stages"].items() if src["weights_sha256"] == source["weights_sha256"]]
    if not names:
        return None
    return [{**r, "stage": name} for r in old["rows"] if r["stage"] == names[0]]


def measure_stage(name: str, spec: str, out: Path, s: StageSettings,
                  reuse: Path | None = None) -> tuple[list[dict], dict]:
    """One stage's rows, reused from ``out/rows.json`` or the ``reuse`` result file when the same weights were
    measured with the same settings (so stages can be measured in separate calls, e.g. while a later stage still
    trains)."""
    from mar_probe.probe.record import weights_sha256
    model, checkpoint = load_stage(spec, out)
    source = {"source": spec, "weights_sha256": weights_sha256(model)}
    found = earlier_rows(reuse, name, source, s)
    if found:
        return found, source
    cache = out / "rows.json"
    key = {"source": source, "settings": s.__dict__}
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["key"] == json.loads(json.dumps(key)):
            return saved["rows"], source
    rows = study_stage(name, model, checkpoint, out, s) + compare_stage(name, model, s)
    cache.write_text(json.dumps({"key": key, "rows": rows}))
    return rows, source


def _panel(quantity: str) -> tuple[str, str]:
    """(panel title, line label): selectors of one precision share a panel, as do the strategies' PSNR."""
    if ": " in quantity:
        title, label = quantity.split(": ", 1)
        return title, label
    if quantity.endswith(" PSNR vs full (dB)"):
        return "PSNR vs full (dB); 100 = identical images", quantity.split()[0]
    return quantity, ""


def draw(frame: pd.DataFrame, stages: list[str]):
    """One panel per measured quantity: mean and 95% t-interval per training stage; returns the Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict[str, list[tuple[str, str]]] = {}
    for q in dict.fromkeys(frame["quantity"]):
        title, label = _panel(q)
        panels.setdefault(title, []).append((q, label))
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.2 * rows), squeeze=False, layout="constrained")
    x = np.arange(len(stages))
    for ax, (title, lines) in zip(axes.ravel(), panels.items()):
        for i, (q, label) in enumerate(lines):
            d = frame[frame["quantity"] == q].set_index("stage").reindex(stages)
            err = np.vstack([d["mean"] - d["lo"], d["hi"] - d["mean"]])
            style = dict(ls="--", color="grey") if label == "random" else dict(ls="-")
            ax.errorbar(x + 0.04 * i, d["mean"], yerr=np.nan_to_num(err), fmt="o", capsize=4, label=label or None,
                        **style)
        if any(label for _, label in lines):
            ax.legend(fontsize=7, loc="best")
        # Rotated: seven stage names overlap at this width when level (CI, phase 24's column).
        ax.set_xticks(x, stages, rotation=30, ha="right", rotation_mode="anchor")
        ax.set_xlabel("training stage")
        ax.set_ylabel("mean [95% CI]")
        ax.set_title(title, fontsize=9)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    fig.suptitle("Headline measurements across training stages (mean and 95% t-interval over samples)")
    return fig


def plot(frame: pd.DataFrame, stages: list[str], path: Path) -> Path:
    """:func:`draw` as an image at ``path``."""
    import matplotlib.pyplot as plt
    fig = draw(frame, stages)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", action="append", required=True, metavar="NAME=init:PRESET|git:REV:PATH|PATH")
    p.add_argument("--samples-per-seed", type=int, default=10)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--compare-samples", type=int, default=10)
    p.add_argument("--compare-seeds", default="0,1")
    p.add_argument("--num-iter", type=int, default=64)
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--lazymar-layer", type=int, default=3)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/stages", help="the stages' stores and rows (default runs/stages)")
    p.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                   help="an earlier training_stages.json: its stages with the same source, weights and settings "
                        "are taken from it, not measured again (e.g. benchmarks/results/training_stages.json)")
    p.add_argument("--results", default=str(RESULTS), help="where training_stages.{csv,json,png} go "
                                                         "(default benchmarks/results)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    s = StageSettings(samples_per_seed=args.samples_per_seed, seeds=tuple(map(int, args.seeds.split(","))),
                      compare_samples=args.compare_samples,
                      compare_seeds=tuple(map(int, args.compare_seeds.split(","))), num_iter=args.num_iter,
                      cfg=args.cfg, temperature=args.temperature, layer=args.layer, lazymar_layer=args.lazymar_layer,
                      k=args.k)
    stages = dict(spec.split("=", 1) for spec in args.stage)
    rows, seconds, sources = [], {}, {}
    for name, spec in stages.items():
        t0 = time.time()
        try:
            stage_rows, sources[name] = measure_stage(name, spec, Path(args.out) / name, s, args.reuse)
        except ValueError as exc:
            p.error(f"--stage {name}={spec}: {exc}")
        rows += stage_rows
        seconds[name] = time.time() - t0
    frame = pd.DataFrame(rows)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    frame.to_csv(results / f"{NAME}.csv", index=False)
    command = "python benchmarks/training_stages.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (results / f"{NAME}.json").write_text(json.dumps(
        {"command": command, "machine": machine(), "settings": s.__dict__, "stages": sources,
         "seconds": seconds, "rows": rows}, indent=2))
    plot(frame, list(stages), results / f"{NAME}.png")
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
