"""The ``mar-probe`` command line. It only builds configs and calls library functions.

Each subcommand lives in a ``_cmd_*`` function registered in ``SUBCOMMANDS``; ``_add_*`` adds its flags.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PRESET", help="preset: alone, random weights; with --checkpoint, the "
                   "architecture to load it into (default: read from the checkpoint)")
    g.add_argument("--checkpoint", metavar="PATH", help="local checkpoint (default: the embedded Fashion-MNIST model)")
    g.add_argument("--no-ema", action="store_true", help="load the non-EMA weights of a checkpoint")
    g.add_argument("--vae", metavar="PATH", help="local kl16.ckpt to decode ImageNet latents into images")
    g.add_argument("--device", help="torch device (default: cpu; under torchrun, cuda:LOCAL_RANK when CUDA is "
                   "there, and --device cuda means cuda:LOCAL_RANK)")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1: on a shared 2-core "
                   "machine, 2 spinning threads under load ran generate 5.7x slower)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--num-samples", type=int, default=16, help="images to generate (default: 16)")
    g.add_argument("--labels", help="comma-separated class labels, cycled to --num-samples (default: 0,1,2,...)")
    g.add_argument("--samples-per-class", type=int, metavar="K",
                   help="K images of every class (or of each --labels entry); overrides --num-samples")
    g.add_argument("--seed", type=int, default=0, help="seed of the run's own generators (default: 0)")
    from .engine.sampling import CFG_SCHEDULES, OFFICIAL, RNG_MODES
    rec = "the checkpoint's recommended value, else the official"
    g.add_argument("--num-iter", type=int, help=f"MAR decoding steps (default: {rec} {OFFICIAL['num_iter']})")
    g.add_argument("--cfg", type=float, help=f"classifier-free guidance scale (default: {rec} {OFFICIAL['cfg']})")
    g.add_argument("--cfg-schedule", choices=list(CFG_SCHEDULES), help=f"(default: {rec} {OFFICIAL['cfg_schedule']})")
    g.add_argument("--temperature", type=float,
                   help=f"diffusion sampling temperature (default: {rec} {OFFICIAL['temperature']})")
    g.add_argument("--num-sampling-steps", help="diffusion steps of the head (default: the model's)")
    g.add_argument("--batch-size", type=int, default=64, help="images per forward batch (default: 64)")
    g.add_argument("--rng", default="own", choices=list(RNG_MODES), help="random-number layout")


def build_model(args):
    """The model named by --model/--checkpoint (random preset, checkpoint, or the embedded default).

    Sampling flags left unset (None) are filled in ``args`` by :meth:`~mar_probe.engine.SamplingConfig.resolve`
    (the checkpoint's recommended settings, else the official defaults), the same rule as :func:`mar_probe.sample`,
    so a command and the API sample the same images (issue 18).
    """
    import torch

    from .engine.sampling import SamplingConfig
    from .models.checkpoints import create_model, load_model, resolve_device
    if not isinstance(args.threads, int) or args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads!r}")
    torch.set_num_threads(args.threads)
    args.device = _device(args.device)
    steps = getattr(args, "num_sampling_steps", None)
    if steps is not None:
        from .models.diffusion import parse_spacing
        try:
            parse_spacing(steps)
        except ValueError as exc:
            raise ValueError(f"--num-sampling-steps: {exc}") from None
    if args.model and not args.checkpoint:
        over = {"num_sampling_steps": str(steps)} if steps else {}
        model = create_model(args.model, **over).to(resolve_device(args.device)).eval()
    else:
        model = load_model(args.checkpoint, preset=args.model, ema=not args.no_ema, device=args.device,
                           num_sampling_steps=steps)
    flags = ("num_iter", "cfg", "cfg_schedule", "temperature", "rng")
    given = {k: getattr(args, k) for k in flags if getattr(args, k, None) is not None}
    resolved = SamplingConfig(**given).resolve(model)
    for key in flags:
        if hasattr(args, key):
            setattr(args, key, getattr(resolved, key))
    return model


def _device(requested: str | None) -> str:
    """--device, or under torchrun this rank's (see :meth:`mar_probe.launch.Ranks.device`)."""
    from .launch import Ranks
    ranks = Ranks.from_env()
    return ranks.device(requested) if ranks is not None else (requested or "cpu")


def parse_labels(text: str | None, num_samples: int, num_classes: int, per_class: int | None = None) -> np.ndarray:
    """Labels from "3,5" (cycled to num_samples) or 0,1,2,... by default; ``per_class`` repeats each K times."""
    if per_class is not None and per_class < 1:
        raise ValueError(f"--samples-per-class must be >= 1, got {per_class!r}")
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples!r}")
    if text is not None:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts or not all(p.lstrip("-").isdigit() for p in parts):
            raise ValueError(f"--labels must be comma-separated integers, got {text!r}")
        base = [int(p) for p in parts]
    else:
        base = list(range(num_classes))
    if per_class is not None:
        return np.repeat(np.array(base, dtype=np.int64), per_class)
    return np.resize(np.array(base, dtype=np.int64), num_samples)


def _load_vae(args):
    if not args.vae:
        return None
    from .models.vae import load_vae
    return load_vae(args.vae, device=args.device)


def _add_generate(p):
    _add_model_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--out", default="runs/generate", help="output folder (default: runs/generate)")
    p.add_argument("--strategy", default="full", help="sampling strategy (default: full)")
    _add_strategy_opt(p)
    p.add_argument("--shadow", action="store_true", help="also run the full model beside the strategy and write "
                   "shadow.zarr (error of what it used, per step/layer/token) and shadow.png")


def _add_strategy_opt(p) -> None:
    p.add_argument("--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="strategy option, repeatable (e.g. budget=32); a wrong key lists the valid ones")


def _strategy_from_args(args):
    """The strategy object named by --strategy with its --strategy-opt options."""
    from .strategies import create, parse_options
    return create(args.strategy, **parse_options(args.strategy, args.strategy_opt))


def _write_text(path: Path, text: str) -> None:
    from ._io import atomic_path
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _cmd_generate(args) -> int:
    from ._io import atomic_path
    from .api import sample
    from .plot.grid import save_image_grid
    strategy = _strategy_from_args(args)
    model = build_model(args)
    labels = parse_labels(args.labels, args.num_samples, model.num_classes, args.samples_per_class)
    kw = dict(num_iter=args.num_iter, cfg=args.cfg, cfg_schedule=args.cfg_schedule, temperature=args.temperature,
              seed=args.seed, rng=args.rng, batch_size=args.batch_size, strategy=strategy, vae=_load_vae(args),
              progress=True)
    out = Path(args.out)
    if args.shadow:
        res = _generate_shadow(model, labels, kw, out)
    else:
        res = sample(model, labels, **kw)  # validates every setting: nothing is written before
    out.mkdir(parents=True, exist_ok=True)
    tokens = res.tokens.flatten(2).transpose(1, 2).numpy().astype(np.float32)  # [N, seq_len, token_dim]
    arrays = dict(labels=res.labels, tokens=tokens)
    if res.images is not None:
        arrays["images"] = res.images
        save_image_grid(res.images, out / "grid.png", labels=res.labels)
    with atomic_path(out / "samples.npz") as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
    _write_text(out / "settings.json", json.dumps(dict(res.settings, timings=res.timings), indent=2))
    _write_text(out / "cost.json", json.dumps(dict(strategy=res.settings["strategy"], **res.cost), indent=2))
    print(f"wrote {len(labels)} samples to {out / 'samples.npz'}" + (" and grid.png" if res.images is not None else
          " (no images: pass --vae PATH to decode latents)"))
    return 0


def _generate_shadow(model, labels, kw, out: Path):
    """Sample with the shadow attached; write shadow.zarr and the error-vs-step figure."""
    from .plot.compare import shadow_error, shadow_error_data
    from .probe.shadow import sample_with_shadow
    res, ds = sample_with_shadow(model, labels, **kw)
    out.mkdir(parents=True, exist_ok=True)
    ds.to_zarr(out / "shadow.zarr", mode="w")
    data = shadow_error_data(ds, "dec_kv_err")
    data.to_csv(out / "dec_kv_err.csv", index=False)  # the plotted values, as every figure writes them
    ax = shadow_error(data)
    ax.figure.savefig(out / "shadow.png", dpi=120)
    print(f"shadow: mean dec K/V error {float(ds['dec_kv_err'].mean()):.4g}, z error {float(ds['z_err'].mean()):.4g}"
          f"; wrote {out / 'shadow.zarr'}, shadow.png and dec_kv_err.csv")
    return res


def _add_compare_flags(p, default_samples: int) -> None:
    _add_model_flags(p)
    _add_sampling_flags(p)
    for action in p._actions:
        if action.dest == "num_samples":
            action.default, action.help = default_samples, f"images per seed (default: {default_samples})"
    p.add_argument("--seeds", help="comma-separated seeds, each a paired repetition (default: --seed)")
    p.add_argument("--shadow", action="store_true", help="also record shadow errors (slower; timings unaffected)")
    p.add_argument("--grid-images", type=int, default=8, help="images per strategy in grid.png (default: 8)")
    p.add_argument("--inception-weights", metavar="PATH", help="local pytorch-fid InceptionV3 weights (RGB models)")
    p.add_argument("--inception-reference", metavar="PATH", help="MAR-format mu/sigma .npz for FID (RGB models)")


def _add_compare(p):
    _add_compare_flags(p, 20)
    p.add_argument("--strategies", default="full,fewer-steps,lazymar,marche,compose",
                   help="comma-separated NAME or LABEL=NAME (full is always run; default: %(default)s)")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="LABEL.KEY=VALUE",
                   help="option of one strategy, repeatable (e.g. marche.budget=32)")
    p.add_argument("--paired-against", metavar="LABEL",
                   help="also report every strategy's per-image fidelity minus this strategy's (e.g. lazymar), "
                        "with an interval over all paired images (columns *_minus_ref)")
    p.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the (strategy, seed) runs an interrupted comparison saved in OUT/partial (the same "
                        "settings; strategies and seeds may be added, a saved label keeps its options)")


def _compare_config(args, runs, num_classes: int):
    from .compare import CompareConfig
    try:
        seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip()) if args.seeds else (args.seed,)
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    labels = tuple(parse_labels(args.labels, args.num_samples, num_classes, args.samples_per_class).tolist())
    return CompareConfig(runs=runs, num_samples=len(labels), labels=labels, seeds=seeds, num_iter=args.num_iter,
                         cfg=args.cfg, cfg_schedule=args.cfg_schedule, temperature=args.temperature,
                         batch_size=args.batch_size, rng=args.rng, grid_images=args.grid_images, shadow=args.shadow,
                         inception_weights=args.inception_weights, inception_reference=args.inception_reference,
                         paired_against=getattr(args, "paired_against", None))


def _cmd_compare(args) -> int:
    from .compare import compare, format_table, parse_runs, write_results
    import torch
    runs = parse_runs(args.strategies, args.strategy_opt)
    torch.manual_seed(args.seed)  # random-weight presets: the same weights when a comparison is resumed
    model = build_model(args)
    config = _compare_config(args, runs, model.num_classes)
    if args.inception_weights:  # read (and refused, if it must be) before anything is sampled
        from .quality import load_inception
        load_inception(args.inception_weights)
    from .launch import Ranks, process_group
    ranks = Ranks.from_env()  # torchrun: the seeds are spread over the ranks, rank 0 writes (issue 16)
    with process_group(ranks, args.device):
        result = compare(model, config, vae=_load_vae(args), partial=Path(args.out) / "partial",
                         resume=args.resume, ranks=ranks, command=args.command_line)
    if ranks is not None and ranks.rank != 0:
        return 0
    out = write_results(result, args.out)
    print(format_table(result.results))
    print(f"wrote {out / 'results.json'}, results.csv, grid.png and samples/")
    return 0


def _add_sweep(p):
    _add_compare_flags(p, 20)
    p.add_argument("strategy", help="the strategy to sweep, e.g. marche")
    p.add_argument("--param", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="an option and its values; once or twice (a 2-D grid)")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed option of the swept strategy, repeatable")
    p.add_argument("--baselines", default="", help="other strategies to run beside, e.g. lazymar,fewer-steps")
    p.add_argument("--speed", default="speedup_flops", choices=["speedup_flops", "speedup_time"])
    p.add_argument("--fidelity", default="psnr", help="y axis: psnr, ssim, token_mse, token_cos, class_accuracy, "
                   "frechet_distance, ... (default: psnr)")
    p.add_argument("--out", default="runs/sweep", help="output folder (default: runs/sweep)")


def parse_grid(name: str, params) -> dict:
    """``["budget=16,32"]`` -> ``{"budget": [16, 32]}`` typed as the option of strategy ``name``."""
    from .strategies import parse_options
    grid = {}
    for param in params:
        key, sep, values = param.partition("=")
        if not sep or not values.strip():
            raise ValueError(f"--param expects KEY=V1,V2,..., got {param!r}")
        key = key.strip().replace("-", "_")
        grid[key] = [parse_options(name, [f"{key}={v.strip()}"])[key] for v in values.split(",") if v.strip()]
    return grid


def _cmd_sweep(args) -> int:
    from .compare import compare, format_table, sweep_runs, write_sweep
    from .strategies import parse_options
    grid = parse_grid(args.strategy, args.param)
    runs = sweep_runs(args.strategy, grid, parse_options(args.strategy, args.strategy_opt),
                      [b.strip() for b in args.baselines.split(",") if b.strip()])
    model = build_model(args)
    config = _compare_config(args, runs, model.num_classes)
    from .launch import Ranks, process_group
    ranks = Ranks.from_env()
    with process_group(ranks, args.device):
        result = compare(model, config, vae=_load_vae(args), ranks=ranks, command=args.command_line)
    if ranks is not None and ranks.rank != 0:
        return 0
    out = write_sweep(result, args.out, args.strategy, grid, args.speed, args.fidelity)
    print(format_table(result.results))
    print(f"wrote {out / 'sweep.csv'}, pareto.png, results.json/csv, grid.png")
    return 0


ABLATE_SAMPLES, ABLATE_SEEDS = 70, "0,1,2"  # 210 paired images per arm over 3 seeds (issue 15: n >= 200, >= 3 seeds)


def _add_ablate(p):
    sub = p.add_subparsers(dest="ablation", required=True, metavar="ABLATION", parser_class=type(p))
    n = (f"{ABLATE_SAMPLES} images x seeds {ABLATE_SEEDS} = {ABLATE_SAMPLES * len(ABLATE_SEEDS.split(','))} paired "
         "images per arm (issue 15 asks n >= 200 over >= 3 seeds)")
    lz = sub.add_parser("lazymar", help="LazyMAR attribution: token, condition and head cache alone, in pairs and all "
                        "three, paired against full and against lazymar", description=(
                            "LazyMAR attribution: which of LazyMAR's three caches costs the quality. Arms: token, "
                            "condition, head, token+condition, token+head, condition+head, lazymar (all three), each "
                            "paired per image against full and against lazymar. The head interval is scaled to the "
                            "head's steps: max(1, round(7 * K / 100)) (the released code's 7 is for 100 steps). "
                            f"Defaults: {n}. Writes results.json/csv, ablation.csv, attribution.png, worst.png."))
    ms = sub.add_parser("marche-selection", help="MARche's refresh selection by attention, random, low-attention and "
                        "oracle at budgets 32 and 64, each paired per image against attention at its budget",
                        description=(
                            "MARche's premise downstream: refresh-token selection rules at each budget, every arm "
                            "paired per image against attention at the same budget (difference with a 95% interval "
                            f"over all images of all seeds). Defaults: {n}. Writes results.json/csv, ablation.csv, "
                            "selection.png and worst.png (the worst images of each arm beside full's)."))
    for q, strategy, out in ((lz, "lazymar", "runs/ablate_lazymar"), (ms, "marche", "runs/ablate_marche_selection")):
        _add_compare_flags(q, ABLATE_SAMPLES)
        for action in q._actions:
            if action.dest == "seeds":
                action.default = ABLATE_SEEDS
                action.help = f"comma-separated seeds, each a paired repetition (default: {ABLATE_SEEDS})"
        q.add_argument("--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                       help=f"{strategy} option shared by every arm, repeatable (e.g. refresh_interval=5)")
        q.add_argument("--worst", type=int, default=4, metavar="K", help="worst images per arm (lowest PSNR vs full) "
                       "in worst.png/worst.csv (default: 4; 0: none)")
        q.add_argument("--out", default=out, help=f"output folder (default: {out})")
        q.add_argument("--resume", action="store_true",
                       help="reuse the (arm, seed) runs an interrupted ablation saved in OUT/partial")
    lz.add_argument("--no-scale-head-interval", action="store_true", help="keep the head interval at the released 7 "
                    "(or a --strategy-opt head_interval=N) instead of scaling it to the head's steps")
    from .ablation import DEFAULT_BUDGETS, SELECTIONS
    ms.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                    help="comma-separated refresh budgets (default: %(default)s)")
    ms.add_argument("--selections", default=",".join(SELECTIONS),
                    help="comma-separated selection rules; attention (the reference) is always run "
                         "(default: %(default)s)")


def _ablation_plan(args):
    """The ablation's library call as (function, keyword arguments), every input checked before a model loads."""
    from .ablation import head_step_count, lazymar_attribution, lazymar_attribution_runs, marche_selection, \
        selection_runs
    from .strategies import parse_options
    if isinstance(args.worst, bool) or args.worst < 0:
        raise ValueError(f"--worst must be >= 0, got {args.worst!r}")
    if args.ablation == "lazymar":
        base = parse_options("lazymar", args.strategy_opt)
        steps = head_step_count(args.num_sampling_steps) if args.num_sampling_steps is not None else None
        scale = not args.no_scale_head_interval
        lazymar_attribution_runs(head_steps=steps, base_options=base, scale_head_interval=scale)  # checks
        return lazymar_attribution, dict(base_options=base, scale_head_interval=scale)
    base = parse_options("marche", args.strategy_opt)
    try:
        budgets = tuple(int(b) for b in args.budgets.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    selections = tuple(s.strip() for s in args.selections.split(",") if s.strip())
    selection_runs(budgets, selections, base)  # checks
    return marche_selection, dict(budgets=budgets, selections=selections, base_options=base)


def _cmd_ablate(args) -> int:
    import torch

    from .ablation import format_summary, write_ablation
    from .compare import format_table
    run, kwargs = _ablation_plan(args)
    torch.manual_seed(args.seed)  # random-weight presets: the same weights when an ablation is resumed
    model = build_model(args)
    config = _compare_config(args, (), model.num_classes)
    if args.inception_weights:
        from .quality import load_inception
        load_inception(args.inception_weights)
    from .launch import Ranks, process_group
    ranks = Ranks.from_env()
    with process_group(ranks, args.device):
        result = run(model, config, vae=_load_vae(args), partial=Path(args.out) / "partial", resume=args.resume,
                     ranks=ranks, command=args.command_line, **kwargs)
    if ranks is not None and ranks.rank != 0:
        return 0
    out = write_ablation(result, args.out, worst=args.worst)
    print(format_table(result.results))
    print()
    print(format_summary(result.results))
    figure = "attribution.png" if args.ablation == "lazymar" else "selection.png"
    print(f"wrote {out / 'results.json'}, results.csv, ablation.csv, {figure}"
          + (", worst.png/csv" if (out / "worst.png").exists() else "") + ", grid.png and samples/")
    return 0


def _add_tune(p):
    _add_model_flags(p)
    _add_sampling_flags(p)
    for action in p._actions:
        if action.dest == "num_samples":
            action.default, action.help = 8, "images per seed (default: 8)"
        if action.dest == "seed":
            action.help = "seed of a random-weight preset's weights (default: 0); the runs use the seeds below"
    p.add_argument("--family", required=True, help="the strategy to tune: marche, lazymar, disa, compose, "
                   "lazymar-disa, ... or marche-drift (online: the drift threshold of MARche's per-step refresh)")
    p.add_argument("--target", required=True, metavar="METRIC>=V|METRIC<=V",
                   help="fidelity against full: psnr>=V, ssim>=V, token_cos>=V or token_mse<=V (e.g. psnr>=30)")
    p.add_argument("--statistic", default="mean", help="what must meet the target: mean (over images, default) or "
                   "bound (the lower end of its 95%% interval for >=, the upper end for <=)")
    p.add_argument("--calibration-seeds", default="0,1", help="seeds the search runs on (default: 0,1)")
    p.add_argument("--heldout-seeds", default="2", help="seeds the choice is checked on, none of the calibration "
                   "seeds (default: 2)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="an option and its candidate values, repeatable (default: the family's grid, "
                        "mar_probe.tune.KNOBS)")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed option of every candidate, repeatable")
    p.add_argument("--search", default="bisect", help="bisect (default: cheapest first along the last option, "
                   "assuming fidelity falls as the run gets cheaper) or exhaustive (every candidate)")
    p.add_argument("--out", default="runs/tune", help="output folder: tune.json, tune.png (default: runs/tune)")


def _cmd_tune(args) -> int:
    import dataclasses

    import torch

    from .engine.sampling import SamplingConfig
    from .strategies import parse_options
    from .tune import FidelityTarget, TargetUnreachableError, TuneConfig, format_report, parse_seeds, tune, \
        write_report
    config = TuneConfig(family=args.family, target=FidelityTarget.parse(args.target, statistic=args.statistic),
                        calibration_seeds=parse_seeds(args.calibration_seeds, "--calibration-seeds"),
                        heldout_seeds=parse_seeds(args.heldout_seeds, "--heldout-seeds"),
                        space=tuple(parse_grid(args.family, args.param).items()),
                        options=tuple(parse_options(args.family, args.strategy_opt).items()), search=args.search,
                        num_samples=args.num_samples, batch_size=args.batch_size,
                        sampling=SamplingConfig.of(args))  # checked before loading
    torch.manual_seed(args.seed)  # random-weight presets: the same weights on every call
    model = build_model(args)
    labels = parse_labels(args.labels, args.num_samples, model.num_classes, args.samples_per_class)
    config = dataclasses.replace(config, labels=tuple(labels.tolist()), num_samples=len(labels))
    try:
        result = tune(model, config, vae=_load_vae(args))
    except TargetUnreachableError as exc:  # the calibration is kept; the error is the command's one line
        print(format_report(exc.result))
        print(f"wrote {write_report(exc.result, args.out) / 'tune.json'} and tune.png")
        raise
    print(format_report(result))
    print(f"wrote {write_report(result, args.out) / 'tune.json'} and tune.png")
    return 0 if result.met else 1


def _add_train(p):
    # defaults of None throughout: TrainConfig holds the one default of each (its help names it)
    p.add_argument("--preset", help="model preset to train (default: TrainConfig's, the embedded default's preset)")
    p.add_argument("--data", dest="data_dir", help="folder with the Fashion-MNIST IDX files")
    p.add_argument("--dataset", choices=["fashion", "digits"], help="fashion (default) or scikit-learn's 8x8 digits")
    p.add_argument("--out", dest="out_dir", help="checkpoint folder (default: TrainConfig's, runs/train)")
    for name, typ in (("iters", int), ("batch-size", int), ("lr", float), ("min-lr", float), ("warmup-iters", int),
                      ("weight-decay", float), ("grad-clip", float), ("ema-rate", float), ("ckpt-every", int),
                      ("seed", int), ("threads", int), ("max-minutes", float)):
        p.add_argument(f"--{name}", type=typ, help="see TrainConfig (default: its default)")
    p.add_argument("--amp", choices=["bf16", "none"])
    p.add_argument("--attention", choices=["explicit", "sdpa"],
                   help="attention kernel while training (default: explicit)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the encoder and decoder")
    p.add_argument("--device", help="cpu (default), cuda or cuda:N; the random stream stays on the CPU")
    p.add_argument("--init", metavar="PATH",
                   help="start from this checkpoint's (EMA) weights, e.g. data/fashion_b128.pth")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if a checkpoint exists")
    p.add_argument("--export", metavar="PATH", help="after training, write the EMA-only checkpoint here")


def _cmd_train(args) -> int:
    from .train import TrainConfig, export_ema, train
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
    path = train(TrainConfig(**fields), resume=not args.no_resume)
    print(f"checkpoint: {path}")
    if args.export:
        print(f"exported EMA weights to {export_ema(path, args.export)}")
    return 0


def train_main(argv: list[str]) -> int:
    """``mar-probe train ARGV`` without building the other commands' parsers, some of which import the store's
    dependencies (zarr, xarray): for a machine that has torch and nothing else of ours, such as the accelerator
    machine (issue 14, ``benchmarks/device_train.py``)."""
    parser = _Parser(prog="mar-probe train", description=SUBCOMMANDS["train"][2])
    _add_train(parser)
    args = parser.parse_args(argv)
    args.func, args.command, args.command_line = _cmd_train, "train", shlex.join(["mar-probe", "train", *argv])
    return _run(args)


def _add_quality(p):
    p.add_argument("samples", help="a samples.npz written by `mar-probe generate`")
    p.add_argument("--classifier", help="classifier file (default: data/fashion_classifier.pt)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def _cmd_quality(args) -> int:
    from .quality import format_report, quality_report
    kwargs = {"classifier": args.classifier} if args.classifier else {}
    report = quality_report(args.samples, **kwargs)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _add_presets(p):
    pass


def _cmd_presets(args) -> int:
    from .models.presets import PRESETS
    for name, kw in PRESETS.items():
        print(f"{name:18s} {kw['encoder_depth']}+{kw['decoder_depth']} blocks, width {kw['encoder_embed_dim']}, "
              f"head {kw['diffloss_d']}x{kw['diffloss_w']}, {kw['img_size']}px, tokenizer {kw.get('tokenizer')}")
    return 0


def _add_record(p):
    _add_model_flags(p)
    _add_sampling_flags(p)
    for action in p._actions:  # one sampler run per sample by default: data independent of batching
        if action.dest == "batch_size":
            action.default, action.help = 1, "samples per sampler run; part of the run's identity (default: 1)"
    p.add_argument("--out", default="runs/record.zarr", help="zarr store to write (default: runs/record.zarr)")
    p.add_argument("--strategy", default="full", help="sampling strategy (default: full)")
    _add_strategy_opt(p)
    g = p.add_argument_group("selection (flags override --spec)")
    g.add_argument("--spec", metavar="FILE", help="YAML/JSON selection spec (fields of SelectionSpec)")
    g.add_argument("--vars", help="comma-separated variables, e.g. dec_k,dec_v,z_cfg_resid,attn_gen")
    for name in ("layers", "steps", "samples"):
        g.add_argument(f"--{name}", help=f"{name} to keep, e.g. 0,2,4-7 (default: all)")
    g.add_argument("--branches", help="CFG branches to keep: cond, uncond or cond,uncond (default: all)")
    g.add_argument("--dtype", choices=["float16", "float32", "bfloat16"], help="storage dtype (default: float16)")
    g = p.add_argument_group("run")
    g.add_argument("--dry-run", action="store_true", help="print the store size per variable and exit")
    g.add_argument("--resume", action="store_true", help="complete an existing store (skips complete samples)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing store")
    g.add_argument("--repair", action="store_true", help="with --resume: first find chunks of finished steps that "
                   "are missing or undecodable (as `mar-probe verify`) and re-record their samples")
    g.add_argument("--shard", metavar="I/N", help="write the I-th of N disjoint parts (hand-run processes, job "
                   "arrays; under torchrun each rank writes RANK/WORLD_SIZE by itself)")
    g.add_argument("--queue-size", type=int, default=8, help="step records buffered for the writer (default: 8)")
    g.add_argument("--compression", default="lz4", choices=["lz4", "zstd", "none"],
                   help="codec of the data variables: lz4 (least CPU, default), zstd (~8%% smaller, ~1.6x the CPU)")
    g.add_argument("--steps-per-chunk", type=int, default=None, metavar="N",
                   help="steps in one chunk of a per-step variable (default: automatic, chunks of at most 4 MiB)")


def _selection_from_args(args):
    from .store.spec import SelectionSpec
    spec = SelectionSpec.from_file(args.spec) if args.spec else SelectionSpec()
    flags = {"variables": args.vars, "layers": args.layers, "steps": args.steps, "samples": args.samples,
             "branches": args.branches, "dtype": args.dtype}
    return spec.replace(**{k: v for k, v in flags.items() if v is not None})


def _print_dry_run(layout, num_samples: int, num_steps: int) -> None:
    """Bytes per variable, total and chunking of a resolved recording of a run of ``num_samples`` x ``num_steps``
    (``--dry-run``)."""
    from .store.schema import format_bytes
    for name, var in layout.variables.items():
        print(f"{name:16s} {format_bytes(var.nbytes):>12s}")
    print(f"{'total':16s} {format_bytes(sum(v.nbytes for v in layout.variables.values())):>12s} uncompressed, "
          f"{num_samples} samples x {num_steps} steps; nothing written (--dry-run)")
    biggest = max(v.step_nbytes for v in layout.variables.values() if v.per_step)
    print(f"chunks: {layout.steps_per_chunk} step(s) of one sample per chunk, the largest "
          f"{format_bytes(biggest * layout.steps_per_chunk)} (--steps-per-chunk to change)")


def _cmd_record(args) -> int:
    import torch

    from .launch import Ranks, check_shard, process_group
    from .probe.record import parse_shard
    from .store.schema import format_bytes
    ranks = Ranks.from_env()  # torchrun: this process's rank (issue 16); None for a plain process
    check_shard(ranks, parse_shard(args.shard))  # a --shard that disagrees: refused before the model loads
    torch.manual_seed(args.seed)  # random-weight presets: the same weights in every shard, rank and resumed process
    model = build_model(args)
    if args.dry_run:
        return _record_dry_run(args, model)
    with process_group(ranks, args.device):
        res = _record_from_args(args, model, ranks)
    # each rank reports its own part: a collective here would make the first rank done wait for the slowest
    who = f"rank {ranks.rank} of {ranks.world_size} " if ranks is not None else ""
    print(f"{who}wrote {res.samples_written} samples ({res.samples_skipped} already complete) to {res.path}: "
          f"{format_bytes(res.bytes_logical)} uncompressed in {res.seconds:.1f} s; open with "
          f"mar_probe.open_run({str(res.path)!r})")
    return 0


def _record_dry_run(args, model) -> int:
    from .probe.record import image_shape
    from .store.schema import resolve
    labels = parse_labels(args.labels, args.num_samples, model.num_classes, args.samples_per_class)
    strategy, vae = _strategy_from_args(args), _load_vae(args)
    steps = strategy.num_steps(args.num_iter)
    _print_dry_run(resolve(_selection_from_args(args), model, num_samples=len(labels), num_iter=steps, cfg=args.cfg,
                           images=image_shape(model, vae), steps_per_chunk=args.steps_per_chunk), len(labels), steps)
    return 0


def _record_from_args(args, model, ranks):
    from .models.checkpoints import DEFAULT_CHECKPOINT
    from .probe.record import record
    labels = parse_labels(args.labels, args.num_samples, model.num_classes, args.samples_per_class)
    checkpoint = None if args.model else (args.checkpoint or DEFAULT_CHECKPOINT)
    return record(model, labels, args.out, _selection_from_args(args), seed=args.seed, num_iter=args.num_iter,
                  cfg=args.cfg, cfg_schedule=args.cfg_schedule, temperature=args.temperature, rng=args.rng,
                  batch_size=args.batch_size, strategy=_strategy_from_args(args), vae=_load_vae(args),
                  checkpoint=checkpoint, resume=args.resume, overwrite=args.overwrite, repair=args.repair,
                  shard=args.shard, queue_size=args.queue_size, compression=args.compression,
                  steps_per_chunk=args.steps_per_chunk, progress=ranks is None or ranks.local_rank == 0,
                  ranks=ranks)


def _add_verify(p):
    p.add_argument("store", nargs="+", help="run store(s) written by `mar-probe record`")


def _cmd_verify(args) -> int:
    from .store.integrity import verify
    reports = [verify(path) for path in args.store]
    for report in reports:
        print(report.format())
    return 0 if all(r.ok for r in reports) else 1


def _add_cluster_flags(p) -> None:
    """--workers / --scheduler / --timeout of the commands that compute on a dask cluster (analyze, figures)."""
    from .analysis.cluster import DEFAULT_TIMEOUT
    g = p.add_argument_group("dask cluster (default: compute in this process)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--workers", type=int, metavar="N", help="compute on a local dask cluster of N worker processes "
                     "(1 thread each)")
    one.add_argument("--scheduler", metavar="ADDRESS", help="compute on a running dask cluster, e.g. tcp://HOST:8786 "
                     "(`dask scheduler`; its workers must see the store at the same path)")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S", help="seconds to reach --scheduler "
                   f"and for it to have a worker (default: {DEFAULT_TIMEOUT:g})")


def _add_figures(p):
    p.add_argument("store", nargs="+", help="run store(s) written by `mar-probe record` (several: e.g. one per "
                   "--seed of the same command; their samples are pooled)")
    p.add_argument("--out", default="figures", help="output folder or fsspec URL (default: figures)")
    p.add_argument("--only", help="comma-separated figure names (default: all)")
    p.add_argument("--format", default="png", help="image formats, e.g. png,pdf (default: png)")
    _add_cluster_flags(p)


def _cmd_figures(args) -> int:
    from .analysis import dask_cluster, open_runs
    from .plot.report import write_figures
    from .store.location import join, output_folder
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    ds = open_runs(args.store)
    with dask_cluster(scheduler=args.scheduler, workers=args.workers, timeout=args.timeout) as client, \
            output_folder(args.out) as out:  # a URL: written here, uploaded at the end
        written, skipped = write_figures(ds, out, only, args.format.split(","), progress=True, scheduler=client)
    for name, paths in written.items():
        print(f"wrote {name}: {', '.join(p.name for p in paths)}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"index: {join(args.out, 'index.md')} and index.html")
    return 0


def _add_analyze(p):
    p.add_argument("store", nargs="+", help="run store(s) written by `mar-probe record` (several are pooled)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the summary as JSON to PATH (alone: print JSON instead of the table)")
    p.add_argument("--layer", type=int, default=1, help="selection layer, 0-based (default: 1 = MARché's Layer 2)")
    p.add_argument("--lazymar-layer", type=int, help="layer of LazyMAR's V-cosine criterion (default: --layer)")
    p.add_argument("--k", type=int, default=64, help="refresh budget K (default: 64)")
    p.add_argument("--threshold", type=float, default=0.95, help="cosine threshold (default: 0.95)")
    p.add_argument("--claims", action="store_true", help="add LazyMAR's claims measured in full: the share of "
                   "skippable tokens over a threshold sweep (at --lazymar-layer, default 3 or a quarter of the depth) "
                   "and the CFG residual's lag-MSE ratio at lags 1..8 for every estimator (needs dec_v / z)")
    _add_cluster_flags(p)


def _cmd_analyze(args) -> int:
    from .analysis import dask_cluster, format_summary, open_runs, run_summary, summary_json
    ds = open_runs(args.store)
    with dask_cluster(scheduler=args.scheduler, workers=args.workers, timeout=args.timeout) as client:
        table, skipped = run_summary(ds, layer=args.layer, lazymar_layer=args.lazymar_layer, k=args.k,
                                     threshold=args.threshold, scheduler=client, claims=args.claims)
    report = summary_json(table, skipped, ds=ds, command=args.command_line)
    if args.json == "-":
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(format_summary(table, skipped), end="")
    if args.json:
        from .store.location import write_text
        write_text(args.json, json.dumps(report, indent=2, default=str))  # a path or a URL
    return 0


def _add_study(p):
    from .study import StudyConfig
    d = StudyConfig()
    _add_model_flags(p)
    p.add_argument("--out", default=d.out, help=f"output folder (default: {d.out})")
    p.add_argument("--samples-per-seed", type=int, default=d.samples_per_seed,
                   help=f"images per seed (default: {d.samples_per_seed})")
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="comma-separated run seeds, one store "
                   f"each (default: {','.join(map(str, d.seeds))})")
    p.add_argument("--num-iter", type=int, default=d.num_iter, help=f"MAR decoding steps (default: {d.num_iter})")
    p.add_argument("--cfg", type=float, default=d.cfg, help=f"guidance scale (default: {d.cfg})")
    p.add_argument("--temperature", type=float, help="diffusion temperature (default: the checkpoint's, else the "
                   "official 1.0)")
    p.add_argument("--format", default="png", help="figure formats, e.g. png,pdf (default: png)")
    p.add_argument("--overwrite", action="store_true", help="replace existing stores instead of reusing them")


def _cmd_study(args) -> int:
    res = _study(args)
    from .analysis import headlines
    for line in headlines(res.summary):
        print(f"* {line}")
    for name, why in {**res.skipped, **res.summary_skipped}.items():
        print(f"skipped {name}: {why}")
    from .store.location import join
    print(f"wrote {join(res.out, 'index.html')} (the study on one page: grid, summary, {len(res.figures)} figures), "
          f"{join(res.out, 'grid.png')}, {join(res.out, 'figures/')}, {join(res.out, 'summary.txt')}; "
          f"stores {', '.join(str(s) for s in res.stores)}; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in res.seconds.items()))
    return 0


def _study(args):
    import torch
    from .models.checkpoints import DEFAULT_CHECKPOINT
    from .store.spec import parse_index_list
    from .study import StudyConfig, run_study
    torch.manual_seed(0)  # random-weight presets: the same weights on every call, so complete stores are reused
    model = build_model(args)
    config = StudyConfig(out=args.out, samples_per_seed=args.samples_per_seed,
                         seeds=parse_index_list(args.seeds, "--seeds"), num_iter=args.num_iter, cfg=args.cfg,
                         temperature=args.temperature, formats=tuple(args.format.split(",")),
                         overwrite=args.overwrite)
    checkpoint = None if args.model and not args.checkpoint else (args.checkpoint or DEFAULT_CHECKPOINT)
    return run_study(config, model, checkpoint=checkpoint)


SUBCOMMANDS = {
    "generate": (_add_generate, _cmd_generate, "generate images and write samples.npz and a PNG grid"),
    "record": (_add_record, _cmd_record, "sample with the probe attached and write a zarr run store"),
    "train": (_add_train, _cmd_train, "train a small MAR (default: the embedded Fashion-MNIST model)"),
    "quality": (_add_quality, _cmd_quality, "class accuracy and Frechet distance of generated images"),
    "compare": (_add_compare, _cmd_compare, "strategies on the same samples: speed-up, paired fidelity, quality"),
    "sweep": (_add_sweep, _cmd_sweep, "one strategy over a grid of one or two options: trade-off CSV and Pareto plot"),
    "ablate": (_add_ablate, _cmd_ablate, "ablations judged like compare: `ablate lazymar` (which of LazyMAR's caches "
               "costs quality) and `ablate marche-selection` (MARche's selection rules vs attention)"),
    "tune": (_add_tune, _cmd_tune, "the fastest configuration of a strategy meeting a fidelity target against full "
             "on calibration seeds, checked on held-out seeds (tune.json, tune.png)"),
    "study": (_add_study, _cmd_study, "the main job: record the embedded model, write its image grid, figures "
              "and summary"),
    "verify": (_add_verify, _cmd_verify, "check that every chunk of a store's finished steps is present and "
               "decodable (exit 1 when damaged)"),
    "figures": (_add_figures, _cmd_figures, "write every analysis figure (images, CSVs, index.md/html) of a run"),
    "analyze": (_add_analyze, _cmd_analyze, "summary table of a run's redundancy measurements with intervals"),
    "presets": (_add_presets, _cmd_presets, "list model presets"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage of a command is tens of lines: --help shows it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mar-probe", description="Probe, measure and accelerate MAR image "
                                     "generators. Every command uses the embedded Fashion-MNIST model unless "
                                     "--model or --checkpoint is given.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, (add, cmd, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add(p)
        p.set_defaults(func=cmd)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _expected_errors() -> tuple[type[Exception], ...]:
    """Bad input or a failed write (DeviceError and MissingVariableError are ValueErrors); anything else is a bug.

    The store's WriteError is looked up only once its module is loaded (nothing raises it before): `mar-probe train`
    must start where zarr is missing, such as the accelerator machine (issue 14, benchmarks/device_train.py).
    """
    writer = sys.modules.get("mar_probe.store.writer")
    return (ValueError, FileNotFoundError) + ((writer.WriteError,) if writer is not None else ())


def _name_flags(message: str, args) -> str:
    """An error whose subject is a Python keyword (``num_iter must be ...``, ``TrainConfig.max_minutes must ...``)
    names the command's flag instead (``--num-iter must be ...``), so the user reads what to change (issue 18)."""
    m = re.match(r"(?:[A-Z]\w*Config\.)?([a-z][a-z0-9_]*)(?= )", message)
    if m and m.group(1) in vars(args) and m.group(1) not in ("func", "command"):
        return "--" + m.group(1).replace("_", "-") + message[m.end():]
    return message


def main(argv=None) -> int:
    import warnings
    warnings.formatwarning = _one_line_warning  # a warning is one line of the CLI's output, not two
    args = make_parser().parse_args(argv)
    args.command_line = shlex.join(["mar-probe", *(sys.argv[1:] if argv is None else argv)])  # kept in results
    return _run(args)


def _run(args) -> int:
    """Run a parsed command; an expected failure is one line on stderr and exit status 2 (130 when interrupted)."""
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:  # one line; commands that keep partial work say what and how to resume
        print(f"\nmar-probe {args.command}: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130
    except _expected_errors() as exc:  # bad input or a failed write: one line. Anything else is a bug: its traceback
        print(f"mar-probe {args.command}: error: {_name_flags(str(exc), args)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a permission: say which file and what to do
        from ._io import describe_os_error  # zarr-free, for `train_main` on the accelerator machine (issue 14)
        print(f"mar-probe {args.command}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
