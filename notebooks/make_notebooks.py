"""Write the notebooks of this folder (without outputs) from the cell sources below: ``python notebooks/make_notebooks.py``.

Each notebook starts from nothing but the embedded default model and runs top to bottom in a few minutes on
2 CPU cores; ``MAR_PROBE_FAST=1`` (what the test suite sets) shrinks every run to seconds. Stores go to
``$MAR_PROBE_RUNS`` (default ``runs/`` beside the notebook, ignored by git). Editing a notebook in
JupyterLab is fine too: ``tests/test_notebooks.py`` only requires that it is stored without outputs and runs.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

SETUP = '''\
import os
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import mar_probe
import mar_probe.analysis as A  # also registers the ds.probe accessor
from mar_probe.plot import figures

FAST = os.environ.get("MAR_PROBE_FAST") == "1"  # the test suite sets it: tiny runs, seconds
NUM_ITER = 8 if FAST else {num_iter}  # MAR decoding steps
NUM_SAMPLES = 2 if FAST else {num_samples}  # images recorded
HEAD_STEPS = 10 if FAST else None  # diffusion-head steps (None: the model's own, 50)
RUNS = Path(os.environ.get("MAR_PROBE_RUNS", "runs"))  # stores are written here (ignored by git)
RUNS.mkdir(parents=True, exist_ok=True)
# per-category means over empty categories (e.g. t-1 at step 0) are NaN by design; don't warn about them
warnings.filterwarnings("ignore", "invalid value encountered in divide", RuntimeWarning)
print(f"FAST={{FAST}}: {{NUM_SAMPLES}} samples x {{NUM_ITER}} steps; stores in {{RUNS.resolve()}}")'''


def md(text: str):
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


def setup(num_iter: int = 32, num_samples: int = 4):
    return code(SETUP.format(num_iter=num_iter, num_samples=num_samples))


def record_cell(name: str, variables: str, branches: str = "None", cfg: float = 3.0):
    return code(f'''
        model = mar_probe.load_model(num_sampling_steps=HEAD_STEPS)  # the embedded default: data/fashion_b128.pth
        labels = np.arange(NUM_SAMPLES) % 10              # one garment class per sample
        store = RUNS / "{name}.zarr"
        spec = mar_probe.SelectionSpec(variables="{variables}", branches={branches})
        mar_probe.record(model, labels, store, spec, num_iter=NUM_ITER, cfg={cfg}, seed=0,
                         batch_size=NUM_SAMPLES, overwrite=True, progress=True)
        ds = mar_probe.open_run(store)
        print(dict(ds.sizes))''')


# ---- 01 ------------------------------------------------------------------------------------------------
NB01 = [
    md("""
    # 01 · Quickstart

    Generate Fashion-MNIST garments with the embedded MAR, record a small run with the probe, open it as an
    `xarray.Dataset`, look at its dimensions and draw one figure. Nothing is downloaded: the model ships
    with the package (`data/fashion_b128.pth`: MAR-B's 12 + 12 blocks at width 128, 256 pixel tokens on a 16x16
    grid, a buffer of 64).

    Set `MAR_PROBE_FAST=1` before starting Jupyter for a seconds-long run (what the test suite does)."""),
    setup(num_iter=32, num_samples=4),
    md("""
    ## Generate

    `mar_probe.sample` runs MAR's decoding loop: at every step a cosine schedule says how many tokens to
    generate, the transformer sees the tokens known so far, and the diffusion head samples the new ones."""),
    code("""
    model = mar_probe.load_model(num_sampling_steps=HEAD_STEPS)
    c = model.config
    print(f"{c.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{model.seq_len} tokens on a {c.seq_h}x{c.seq_h} grid, buffer of {c.buffer_size}")
    res = mar_probe.sample(model, labels=list(range(4 if FAST else 10)), num_iter=NUM_ITER, cfg=3.0, seed=0)
    print("images", res.images.shape, res.images.dtype,
          "| seconds per component:", {k: round(v, 2) for k, v in res.timings.items()})"""),
    code("""
    from mar_probe.data import FASHION_CLASSES

    fig, axes = plt.subplots(1, len(res.images), figsize=(1.2 * len(res.images), 1.9), squeeze=False)
    for ax, img, lab in zip(axes[0], res.images, res.labels):
        ax.imshow(img[..., 0], cmap="gray", vmin=0, vmax=255)
        ax.set_title(FASHION_CLASSES[lab], fontsize=8)
        ax.axis("off")"""),
    md("""
    ## Record a run

    `record` samples with the probe attached and writes every selected variable of every step into a zarr
    store: here the decoder's keys and values, the decoder output `z`, the CFG residual and the attention
    that the generating tokens pay (MARché's selection score). `estimate_size` says how big it will be first."""),
    code("""
    from mar_probe.store.schema import estimate_size, format_bytes

    model = mar_probe.load_model(num_sampling_steps=HEAD_STEPS)
    labels = np.arange(NUM_SAMPLES) % 10
    spec = mar_probe.SelectionSpec(variables="dec_k,dec_v,z,z_cfg_resid,attn_gen")
    sizes = estimate_size(spec, model, NUM_SAMPLES, NUM_ITER, cfg=3.0)
    print("uncompressed:", format_bytes(sum(sizes.values())))
    store = RUNS / "01_quickstart.zarr"
    out = mar_probe.record(model, labels, store, spec, num_iter=NUM_ITER, cfg=3.0, seed=0,
                           batch_size=NUM_SAMPLES, overwrite=True, progress=True)
    print(f"wrote {out.samples_written} samples in {out.seconds:.1f} s")"""),
    md("""
    ## Open it with xarray

    `open_run` is lazy (dask-backed): nothing is read until a value is needed. Dimensions come in the order
    `sample, step, branch, layer, token, head, d_head`; the `token` axis is the full `[buffer; image tokens]`
    sequence, with `row`/`col` coordinates (-1 on buffer rows)."""),
    code("""
    ds = mar_probe.open_run(store)
    ds"""),
    code("""
    print(dict(ds.sizes))
    print("dec_k:", ds["dec_k"].dims)
    print("model:", ds.attrs["model_preset"], "| sampling:", ds.attrs["sampling"])
    # tokens generated per step (the cosine schedule) and the CFG scale of the linear schedule
    print("generated per step:", ds["pred"].isel(sample=0).sum("token").values.tolist())
    print("cfg per step:", np.round(ds["cfg"].isel(sample=0).values, 2).tolist())"""),
    md("""
    ## One figure

    How much does each token's decoder key change from one step to the next? Cosine near 1 means the cached
    value could have been reused; LazyMAR and MARché both build on this."""),
    code("""
    ax = figures.lazymar_fig1(figures.lazymar_fig1_data(ds, var="dec_k"))"""),
]

# ---- 02 ------------------------------------------------------------------------------------------------
NB02 = [
    md("""
    # 02 · Token redundancy (LazyMAR)

    LazyMAR observes that between adjacent decoding steps most tokens' features hardly change, so their
    computation can be cached; the tokens decoded at the previous step (t-1), whose input just changed
    from the mask token to a value, change most. Here: token categories, cosine stability per layer and
    category, the papers' figures, and an explorer to look at single steps by hand.

    Categories at step s: **t** generated now, **t-1** generated at the previous step, **<t-1** generated
    earlier, **>t** still masked after this step, **buffer** the class-embedding buffer rows."""),
    setup(num_iter=32, num_samples=4),
    record_cell("02_token_redundancy", "dec_k,dec_v,dec_resid_post,enc_k", branches='("cond",)'),
    md("## Token categories"),
    code("""
    cats = ds.probe.categories()
    counts = A.category_masks(cats.isel(sample=0)).sum("token").to_pandas()
    counts.iloc[:: max(1, NUM_ITER // 8)]"""),
    md("""
    ## Cosine stability per layer and category

    Cosine of each token's decoder key between step s-1 and s; mean over tokens of a category, then over
    steps, with a 95% interval over samples. `share` is the fraction of tokens above 0.95."""),
    code("""
    summ = ds.probe.stability_summary("dec_k").sel(branch="cond", drop=True)
    mean = A.aggregate(summ["mean"].mean("step"), "sample")
    share = A.aggregate(summ["share"].sel(threshold=0.95).mean("step"), "sample")
    table = mean["mean"].to_pandas().round(4)
    table.columns.name = "mean cosine (rows: layer)"
    table"""),
    code("""
    share["mean"].to_pandas().round(3).rename_axis(columns="share of tokens with cos > 0.95")"""),
    code("""
    per_step = summ["mean"].mean("sample").compute()          # [step, layer, category]
    # one panel per decoder layer, four to a row (the embedded default has twelve)
    grid = per_step.plot.line(x="step", hue="category", col="layer", col_wrap=4, marker=".", size=2.2, aspect=1.3)
    grid.set_ylabels("cos(K[s], K[s-1])")"""),
    md("""
    ## The papers' figures

    LazyMAR Fig. 1 (hidden states per category, layers pooled) and MARché Fig. 1 (key cosine between steps
    4 and 5 at layer index 1, MARché's "layer 2", on the token grid)."""),
    code("""
    ax = figures.lazymar_fig1(figures.lazymar_fig1_data(ds, var="dec_resid_post"))"""),
    code("""
    ax = figures.marche_fig1(figures.cosine_map_data(ds, "dec_k", pairs=[(4, 5)], layers=[1]))"""),
    md("""
    ## Explore by hand

    Pick a variable, layer, step pair, branch and sample. Left: cosine of each image token between the two
    steps (grey: not processed at one of them — the encoder only sees known tokens). Right: the canvas the
    model holds after the later step, decoded from the store's tokens (still-masked tokens are zeros, mid
    grey), with the tokens generated at that step in red. It reads the store only; no model is needed."""),
    code("""
    from mar_probe.widgets import explore

    explorer = explore(ds, var="dec_k")
    explorer"""),
    code("""
    # the controls can be driven from code too
    explorer.controls["steps"].value = (NUM_ITER // 2 - 1, NUM_ITER // 2)
    print(explorer.state())"""),
]

# ---- 03 ------------------------------------------------------------------------------------------------
NB03 = [
    md("""
    # 03 · Condition redundancy (LazyMAR)

    With classifier-free guidance every step runs the transformer twice, with and without the class. LazyMAR
    observes that the *difference* of the two outputs (the CFG residual) changes far less between steps than
    either output — about 35.5x in mean squared change — so the unconditional pass can be skipped and derived
    as `cond - cached residual`. Here: the adjacent-step MSE of both branches and of the residual, their
    ratio with an interval, and what the residual's drift means for a cache kept k steps."""),
    setup(num_iter=32, num_samples=8),
    record_cell("03_condition_redundancy", "z,z_cfg_resid", cfg=3.0),
    code("""
    mse = ds.probe.cfg_mse()              # per (sample, step): cond, uncond, residual, ratios
    mse.mean("sample").to_dataframe()[["cond", "uncond", "residual", "ratio_cond"]].iloc[:: max(1, NUM_ITER // 8)]"""),
    md("""
    ## The ratio, with an interval over samples

    Per sample: the step-averaged MSE of the conditional output divided by that of the residual."""),
    code("""
    per_sample = mse["cond"].mean("step") / mse["residual"].mean("step")
    r = A.aggregate(per_sample, "sample")
    print(f"residual is {float(r['mean']):.1f}x more stable than the conditional output "
          f"(95% CI {float(r['lo']):.1f}-{float(r['hi']):.1f}, n={int(r['n'])} samples); LazyMAR reports ~35.5x")"""),
    code("""
    ax = figures.lazymar_fig2(figures.lazymar_fig2_data(ds))"""),
    md("""
    ## What a condition cache costs

    A cache that derives `uncond[s] = cond[s] - residual[s-k]` errs by exactly `residual[s] - residual[s-k]`:
    its mean squared error is the residual's MSE at lag k, against the uncached branch's own change."""),
    code("""
    lags = [k for k in (1, 2, 3, 4, 6) if k < NUM_ITER]
    rows = []
    for k in lags:
        m = ds.probe.cfg_mse(lag=k).mean(["sample", "step"]).compute()
        rows.append({"lag k": k, "cache error (residual MSE)": float(m["residual"]),
                     "uncond change (MSE)": float(m["uncond"])})
    import pandas as pd
    pd.DataFrame(rows).set_index("lag k")"""),
]

# ---- 04 ------------------------------------------------------------------------------------------------
NB04 = [
    md("""
    # 04 · Selection vs drift (MARché)

    MARché refreshes, besides the generating and just-decoded tokens, the top-K tokens by the attention that
    the generating tokens pay them at its layer 2 (index 1 here: layer indices are 0-based in mar_probe, as is
    MARché's `selection_layer`), and assumes these are the tokens whose keys and values drift.
    The review objects that this was never measured. Here: precision of that selection against the tokens
    that actually drift most (top-K by 1 - cosine of K at each later layer), against chance K/N and against
    LazyMAR's criterion; then the oracle that selects by true drift, run as a strategy."""),
    setup(num_iter=32, num_samples=4),
    record_cell("04_selection_vs_drift", "dec_k,dec_v,attn_gen", branches='("cond",)'),
    code("""
    ax = figures.selection_vs_drift(figures.selection_vs_drift_data(ds))"""),
    md("Precision at each K, per later layer (mean over steps; 95% interval over samples):"),
    code("""
    n_img = int((ds["row"] >= 0).sum())
    ks = sorted({max(1, n_img * f // 64) for f in (2, 4, 8, 16)})
    sel = ds.probe.selection_vs_drift("dec_k", layer=1, k=ks)
    prec = A.aggregate(sel["precision"].mean("step"), "sample")
    rnd = A.aggregate(sel["random_precision"].mean("step"), "sample")
    table = prec["mean"].to_pandas().round(3)
    table.loc["random (K/N)"] = rnd["mean"].mean("layer").round(3).values
    table.rename_axis(index="later layer", columns="precision at K")"""),
    md("Do layers agree on which tokens matter? MARché Fig. 12: top-K overlap of each layer with layer index 1."),
    code("""
    ax = figures.marche_fig12(figures.marche_fig12_data(ds))"""),
    md("""
    ## The oracle as a strategy

    The same budget with three selection rules, on the same labels and seed (so the same generation order and
    noise as `full`): attention (MARché), random, and the oracle that ranks tokens by their true K/V drift
    against a fresh full forward (an upper bound for any selection rule; its reference forward is not counted
    in time or FLOPs). Fidelity is paired against `full`'s images."""),
    code("""
    from IPython.display import Markdown

    from mar_probe.compare import CompareConfig, StrategyRun, compare, format_table

    runs = tuple(StrategyRun(label=rule, name="marche", options=(("budget", 32), ("selection", rule)))
                 for rule in ("attention", "random", "oracle"))
    oracle = compare(model, CompareConfig(runs=runs, num_samples=NUM_SAMPLES, num_iter=NUM_ITER, cfg=3.0, seeds=(1,)))
    Markdown(format_table(oracle.results))"""),
]

# ---- 05 ------------------------------------------------------------------------------------------------
NB05 = [
    md("""
    # 05 · Strategy trade-offs

    Every strategy on the same samples (same labels and seeds, so the same generation order and noise as
    `full`): speed over `full` (measured seconds and counted FLOPs, with intervals over seeds) and paired
    fidelity against `full`'s images (token MSE, PSNR, SSIM), images side by side; then a sweep of MARché's
    refresh budget and its Pareto front. The library calls below are what `mar-probe compare` and
    `mar-probe sweep` run:

    ```bash
    mar-probe compare --num-samples 20 --seeds 0,1 --strategies full,fewer-steps,lazymar,marche,compose --out runs/compare
    mar-probe sweep marche --param budget=16,32,64,128,192 --baselines lazymar --out runs/sweep
    ```"""),
    setup(num_iter=32, num_samples=8),
    code("""
    import pandas as pd
    from IPython.display import Markdown

    from mar_probe.compare import CompareConfig, StrategyRun, compare, format_table, sweep_runs, write_results, write_sweep
    from mar_probe.plot.compare import pareto_plot
    from mar_probe.widgets import compare_strategies

    model = mar_probe.load_model(num_sampling_steps=HEAD_STEPS)
    SEEDS = (0,) if FAST else (0, 1)
    runs = (StrategyRun(label="full", name="full"),
            StrategyRun(label="fewer-steps", name="fewer-steps", options=(("num_iter", max(1, NUM_ITER // 2)),)),
            StrategyRun(label="lazymar", name="lazymar"),
            StrategyRun(label="marche", name="marche"),
            StrategyRun(label="compose", name="compose"))
    config = CompareConfig(runs=runs, num_samples=NUM_SAMPLES, seeds=SEEDS, num_iter=NUM_ITER, cfg=3.0, grid_images=4)
    result = compare(model, config)
    out = write_results(result, RUNS / "05_compare")
    Markdown(format_table(result.results))"""),
    md("""
    Images side by side with their speed and fidelity. `fewer-steps` changes the schedule, so its images are
    new samples rather than approximations of `full`'s: its fidelity numbers measure difference, not error.
    The widget reads the output folder only (no model)."""),
    code("""
    comparison = compare_strategies(out, speed="speedup.flops", fidelity="fidelity.psnr")
    comparison"""),
    md("""
    ## Sweep: MARché's refresh budget

    Fewer refreshed tokens per step is faster and less faithful. The Pareto front joins the settings that no
    other setting beats on both axes (LazyMAR beside them, outside the fast configuration)."""),
    code("""
    grid = {"budget": [16, 64] if FAST else [16, 32, 64, 128]}
    runs = sweep_runs("marche", grid, baselines=[] if FAST else ["lazymar"])
    sweep_config = CompareConfig(runs=runs, num_samples=NUM_SAMPLES, seeds=(0,), num_iter=NUM_ITER, cfg=3.0,
                                 grid_images=4)
    sweep_out = write_sweep(compare(model, sweep_config), RUNS / "05_sweep", "marche", grid,
                            speed="speedup_flops", fidelity="psnr")
    table = pd.read_csv(sweep_out / "sweep.csv")
    ax = pareto_plot(table, "speedup_flops", "psnr")
    table[["label", "steps", "speedup_flops", "speedup_time", "psnr", "token_mse", "on_front"]]"""),
    code("""
    compare_strategies(sweep_out, speed="speedup.flops", fidelity="fidelity.psnr")"""),
]

# ---- 06 ------------------------------------------------------------------------------------------------
NB06 = [
    md("""
    # 06 · The same study on an official ImageNet MAR

    Everything above on MAR-B/L/H with the KL-16 VAE, from local files. Put them where the next cell looks,
    or point the environment variables at them:

    | file | default path (repository root) | variable |
    |---|---|---|
    | MAR checkpoint (`checkpoint-last.pth` of mar_base, mar_large or mar_huge) | `pretrained_models/mar/mar_base/checkpoint-last.pth` | `MAR_CHECKPOINT` (+ `MAR_PRESET`) |
    | KL-16 VAE (`kl16.ckpt`) | `pretrained_models/vae/kl16.ckpt` | `MAR_VAE` |

    Both are linked from the official MAR repository's README (LTH14/mar). Without a checkpoint the
    notebook says so and skips the study; without the VAE it runs on tokens only. On a CPU, MAR-B takes
    minutes per image at 64 steps: the settings below are small (use a GPU for real runs)."""),
    setup(num_iter=16, num_samples=2),
    code("""
    import torch

    ROOT = Path(os.environ.get("MAR_PROBE_ROOT", Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()))
    PRESET = os.environ.get("MAR_PRESET", "mar_base")     # "": the architecture stored in the checkpoint
    CHECKPOINT = Path(os.environ.get("MAR_CHECKPOINT", ROOT / f"pretrained_models/mar/{PRESET or 'mar_base'}/checkpoint-last.pth"))
    VAE = Path(os.environ.get("MAR_VAE", ROOT / "pretrained_models/vae/kl16.ckpt"))
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    READY = CHECKPOINT.is_file()
    if not READY:
        print(f"SKIPPED: no MAR checkpoint at {CHECKPOINT}.\\n"
              f"Download checkpoint-last.pth of {PRESET} (linked from the official MAR README, LTH14/mar) to that "
              "path, or set MAR_CHECKPOINT (and MAR_PRESET=mar_base|mar_large|mar_huge), then rerun.")
    else:
        print(f"checkpoint {CHECKPOINT} ({PRESET}) on {DEVICE}; VAE: {VAE if VAE.is_file() else 'absent (tokens only)'}")"""),
    code("""
    if READY:
        model = mar_probe.load_model(CHECKPOINT, preset=PRESET or None, device=DEVICE,
                                     num_sampling_steps=10 if FAST or DEVICE == "cpu" else None)
        vae = None
        if VAE.is_file():
            from mar_probe.models.vae import load_vae
            vae = load_vae(VAE, device=DEVICE)
        else:
            print(f"no KL-16 VAE at {VAE}: images are not decoded (set MAR_VAE to decode them)")
        labels = [207, 360, 387, 974, 88, 979, 417, 279][:NUM_SAMPLES]   # MAR's demo classes
        labels = [lab % model.num_classes for lab in labels]            # (a no-op for ImageNet's 1000)
        store = RUNS / f"06_{model.config.name}.zarr"
        depth = min(model.config.encoder_depth, model.config.decoder_depth)
        layers = tuple(sorted({0, 1, 2, 3, depth - 1} & set(range(depth))))   # MARché's layer 2, LazyMAR's 4, the last
        spec = mar_probe.SelectionSpec(variables="dec_k,dec_v,z,z_cfg_resid,attn_gen", layers=layers)
        mar_probe.record(model, labels, store, spec, num_iter=NUM_ITER, cfg=3.0, seed=0, vae=vae,
                         overwrite=True, progress=True)
        ds = mar_probe.open_run(store)
        print(dict(ds.sizes))"""),
    code("""
    if READY and "images" in ds.data_vars:
        imgs = ds["images"].values
        fig, axes = plt.subplots(1, len(imgs), figsize=(2.2 * len(imgs), 2.4), squeeze=False)
        for ax, img, lab in zip(axes[0], imgs, ds["label"].values):
            ax.imshow(img)
            ax.set_title(f"class {lab}", fontsize=8)
            ax.axis("off")"""),
    md("Token redundancy (LazyMAR Fig. 1), condition redundancy (Fig. 2) and MARché's selection vs drift:"),
    code("""
    if READY:
        figures.lazymar_fig1(figures.lazymar_fig1_data(ds, var="dec_k"))"""),
    code("""
    if READY:
        mse = ds.probe.cfg_mse()
        r = A.aggregate(mse["cond"].mean("step") / mse["residual"].mean("step"), "sample")
        print(f"residual {float(r['mean']):.1f}x more stable than cond (LazyMAR reports ~35.5x on MAR)")
        figures.lazymar_fig2(figures.lazymar_fig2_data(ds))"""),
    code("""
    if READY:
        figures.selection_vs_drift(figures.selection_vs_drift_data(ds))"""),
    code("""
    if READY:
        from mar_probe.widgets import explore
        display(explore(ds, var="dec_k"))"""),
]

NOTEBOOKS = {"01_quickstart": NB01, "02_token_redundancy": NB02, "03_condition_redundancy": NB03,
             "04_selection_vs_drift": NB04, "05_strategy_tradeoffs": NB05, "06_imagenet_models": NB06}


def build(name: str, cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name[:2]}-{i:02d}"
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        nbformat.write(build(name, cells), path)
        print(f"wrote {path.relative_to(HERE.parent)} ({len(cells)} cells)")


if __name__ == "__main__":
    main()
