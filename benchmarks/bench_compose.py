"""Rank compositions of the head side with the token side (issue 17, item 2) and name the best candidate.

Every composition is one ``compose`` strategy: a token side (MARché, LazyMAR's token cache or ReCAP, each with or
without the condition cache) and a head side (DiSA's schedule ``head_schedule=disa`` at its published 50 -> 5, alone,
with batched modulation only (``head_interval=1``) or with LazyMAR's head cache at interval 7 or 5 and batched
modulation; or the head cache alone). Two measurements, both cheap:

1. **FLOPs on ``mar_base``** (random weights, batch 1, CFG 3.0, ``--num-iter`` steps, ``--num-sampling-steps`` head
   steps; deterministic, no timing): the FLOPs of every strategy here are a function of the schedule only (fixed
   budgets, retention counts and step roles, never of the values), the transformer's are the token side's and the
   head's are the head side's. So the grid is measured along two axes — every token side with one head side
   (``AXIS_HEAD``), every head side with one token side (``AXIS_TOKENS``) — and each cell is the sum of its
   transformer and head FLOPs; one off-axis composition (``CHECK``) is run in full and must equal its sum exactly
   (the script stops otherwise). ``full``, ``full-b`` (``full`` with only the head's batched modulation, the fair
   reference, see docs/strategies.md) and ``lazymar`` (= ``compose tokens=lazymar``, bit for bit:
   tests/test_compose_head.py) are cells of the same sums (``full`` is run).
2. **Fidelity on the embedded default** (``mar_probe.load_model()``, ``--fidelity-iter`` steps,
   ``--fidelity-samples`` images per seed, its recommended CFG): every composition against ``full`` and, image by
   image, against ``lazymar`` (the issue's fidelity bar), in two protocols: *paired*, :func:`mar_probe.compare.compare`
   at the model's temperature (the issue's measure; a head-step schedule makes its images new samples, since the
   head's noise comes from one stream, one draw per reverse step), and *noise-free* (:func:`noise_free`: temperature
   0, the head's initial noise from a generator of its own, so that the difference is the approximation alone).

The named candidate follows ``RULE``; FLOP ratios ignore that batched modulation is what makes the head fast on a CPU
(every head side but ``disa`` uses it; see docs/strategies.md), so the zoo benchmark's time is the judge. Results:
``benchmarks/results/compose_rank.{json,md}`` with the machine, its load, the command and settings;
``--reuse-flops`` takes the (deterministic) FLOP runs of a previous result with the same settings.

    OMP_NUM_THREADS=1 python benchmarks/bench_compose.py --threads 1             # the committed result
    python benchmarks/bench_compose.py --tiny --out /tmp/rank                      # smoke run: mar_tiny, 2 images
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench_strategies import load_average
from common import RESULTS, bench_parser, machine
from mar_probe import create_model, load_model, sample, strategies
from mar_probe.compare import CompareConfig, StrategyRun, compare

TOKEN_SIDES = {                     # label -> compose token-side options
    "marche+cc": dict(tokens="marche"),
    "marche+cc-w5": dict(tokens="marche", condition_warmup=5),
    "marche": dict(tokens="marche", condition_cache=False),
    "lazymar": dict(tokens="lazymar"),                 # compose's condition cache is lazymar's (the same part)
    "lazymar-nocc": dict(tokens="lazymar", condition_cache=False),
    "recap+cc": dict(tokens="recap"),
    "recap": dict(tokens="recap", condition_cache=False),
}
DISA = dict(head_schedule="disa")                                               # 50 -> 5 linear, clamp 950
HEAD_SIDES = {                      # label -> compose head-side options (the grid)
    "disa": dict(DISA, head_cache=False),
    "disa+h1b": dict(DISA, head_interval=1, head_batch_modulation=True),        # DiSA's head, batched, no reuse
    "disa+h7b": dict(DISA, head_interval=7, head_batch_modulation=True),
    "disa+h5b": dict(DISA, head_interval=5, head_batch_modulation=True),
    "h7b": dict(head_interval=7, head_batch_modulation=True),
    "h5b": dict(head_interval=5, head_batch_modulation=True),
}
REFERENCE_HEADS = {                 # head sides of the references, measured on the head axis too
    "h7": dict(head_interval=7),                                                # lazymar's head cache
    "h1b": dict(head_interval=1, head_batch_modulation=True),                   # full-b's head
}
AXIS_TOKENS, AXIS_HEAD = "lazymar", "disa+h7b"
CHECK = ("marche+cc", "disa")       # an off-axis cell run in full: its FLOPs must be the sum of its sides'
REFERENCES = {"full": ("full", None), "full-b": ("full", "h1b"), "lazymar": ("lazymar", "h7")}


def options(tokens: str, head: str) -> dict:
    """The compose options of one composition."""
    heads = dict(HEAD_SIDES, **REFERENCE_HEADS)
    return dict(TOKEN_SIDES[tokens], **heads[head])


def flops_of(res) -> dict:
    """FLOPs of one sampling run by part."""
    tot = res.cost["totals"]["flops"]
    part = {c: sum(v for k, v in tot.items() if k.startswith(c + ".")) for c in ("encoder", "decoder", "head")}
    return {"transformer": part["encoder"] + part["decoder"], "head": part["head"],
            "end_to_end": res.cost["totals"]["flops_total"], "by_kind": dict(tot)}


FLOP_SETTINGS = ("preset", "batch", "num_iter", "cfg", "num_sampling_steps", "seed")


def _jsonable(obj):
    return json.loads(json.dumps(obj))


def reusable_runs(args) -> dict:
    """FLOP runs of ``--reuse-flops FILE`` (a previous result with the same FLOP settings), by label: FLOPs are a
    function of the settings and options only, so a run with the same label and options is not run again."""
    if not args.reuse_flops:
        return {}
    old = json.loads(Path(args.reuse_flops).read_text())
    mine = {k: getattr(args, k) for k in FLOP_SETTINGS}
    theirs = {k: old["settings"].get(k) for k in FLOP_SETTINGS}
    if mine != theirs:
        raise SystemExit(f"--reuse-flops {args.reuse_flops}: its FLOP settings {theirs} are not these {mine}")
    return {label: {k: v for k, v in r.items() if k != "reused"} for label, r in old["flops"]["runs"].items()}


def measure_flops(args) -> dict:
    """Both axes, the check cell and full on the architecture of ``args.preset`` (see the module docstring)."""
    torch.manual_seed(0)
    model = create_model(args.preset, num_sampling_steps=args.num_sampling_steps).eval()
    kw = dict(num_iter=args.num_iter, cfg=args.cfg, seed=args.seed)
    labels = list(range(args.batch))
    runs, started = {}, time.time()
    reuse = reusable_runs(args)

    def run(label, strategy, opts=None):
        old = reuse.get(label)
        if old is not None and old["options"] == _jsonable(opts):
            runs[label] = dict(old, reused=True)
            return runs[label]
        t0 = time.time()
        res = sample(model, labels, strategy=strategies.create(strategy, **(opts or {})), **kw)
        runs[label] = dict(options=_jsonable(opts), **flops_of(res))
        print(f"flops {label}: {runs[label]['end_to_end'] / 1e9:.0f} GFLOPs ({time.time() - t0:.0f} s)", flush=True)
        return runs[label]

    run("full", "full")
    for t in TOKEN_SIDES:
        run(f"{t}/{AXIS_HEAD}", "compose", options(t, AXIS_HEAD))
    for h in dict(HEAD_SIDES, **REFERENCE_HEADS):
        if h != AXIS_HEAD:
            run(f"{AXIS_TOKENS}/{h}", "compose", options(AXIS_TOKENS, h))
    transformer = {t: runs[f"{t}/{AXIS_HEAD}"]["transformer"] for t in TOKEN_SIDES}
    transformer["full"] = runs["full"]["transformer"]
    head = {h: runs[f"{AXIS_TOKENS}/{h}"]["head"] for h in dict(HEAD_SIDES, **REFERENCE_HEADS)}
    head[None] = runs["full"]["head"]
    axis_heads = {runs[f"{t}/{AXIS_HEAD}"]["head"] for t in TOKEN_SIDES}
    axis_tokens = {runs[f"{AXIS_TOKENS}/{h}"]["transformer"] for h in head if h is not None}
    check = run(f"{CHECK[0]}/{CHECK[1]}", "compose", options(*CHECK))
    factorises = (axis_heads == {head[AXIS_HEAD]} and axis_tokens == {transformer[AXIS_TOKENS]}
                  and check["transformer"] == transformer[CHECK[0]] and check["head"] == head[CHECK[1]])
    if not factorises:
        raise SystemExit(f"the FLOPs do not factorise into token and head sides (head FLOPs on the token axis "
                         f"{sorted(axis_heads)}, transformer FLOPs on the head axis {sorted(axis_tokens)}, check cell "
                         f"{check['transformer']}+{check['head']}): measure every cell instead")

    def cell(t, h):
        tf, hf = transformer[t], head[h]
        return {"transformer": tf, "head": hf, "end_to_end": tf + hf}

    grid = {f"{t}/{h}": cell(t, h) for t in TOKEN_SIDES for h in HEAD_SIDES}
    refs = {name: cell(*sides) for name, sides in REFERENCES.items()}
    base, fair = refs["full"], refs["full-b"]
    for row in list(grid.values()) + list(refs.values()):
        row["ratio"] = {p: base[p] / row[p] for p in ("end_to_end", "transformer", "head")}
        row["ratio_over_full_b"] = fair["end_to_end"] / row["end_to_end"]
    return {"runs": runs, "factorises": factorises, "check_cell": "/".join(CHECK),
            "transformer_by_token_side": transformer, "head_by_head_side": {str(k): v for k, v in head.items()},
            "grid": grid, "references": refs, "seconds": time.time() - started}


def _summary(values) -> dict:
    from mar_probe.quality.paired import summarize
    d = summarize(np.asarray(values, dtype=np.float64))
    return {k: d[k] for k in ("mean", "lo", "hi", "n")}


def _row(fid, ref=None) -> dict:
    """Fidelity summaries of one strategy (per-image paired_fidelity datasets of its seeds), and image by image
    against ``ref``'s (the same images) when given."""
    row = {k: _summary(np.concatenate([d[k].values for d in fid])) for k in ("psnr", "token_mse")}
    if ref is not None:
        row["vs_lazymar"] = {k: _summary(np.concatenate([d[k].values - r[k].values for d, r in zip(fid, ref)]))
                             for k in ("psnr", "token_mse")}
    return row


def noise_free(model, strategy, labels, seed: int, num_iter: int):
    """Tokens and images with the head's per-step noise off (temperature 0) and its initial noise from a generator
    of its own (the engine's ``SampleRNG`` with separate generators, as tests/test_disa.py does): every strategy then
    sees the same orders and initial noise at every step whatever its number of reverse steps, so the difference
    to full is the approximation alone."""
    from mar_probe.api import decode_images
    from mar_probe.engine import SamplingConfig
    from mar_probe.engine.loop import SampleRNG, Sampler
    s = SamplingConfig(num_iter=num_iter).resolve(model)                   # the model's CFG; temperature 0
    rng = SampleRNG("own", np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                    torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        toks, _ = Sampler(model, strategy).run(torch.as_tensor(labels), rng, num_iter=s.num_iter, cfg=s.cfg,
                                               cfg_schedule=s.cfg_schedule, temperature=0.0)
    tokens = model.unpatchify(toks).float().cpu()
    return tokens.numpy(), decode_images(model, tokens, None)


def measure_fidelity(args) -> dict:
    """Every composition against full on the embedded default, and image by image against lazymar, in two
    protocols: ``paired`` (:func:`mar_probe.compare.compare` at the model's sampling settings: the issue's measure)
    and ``noise_free`` (:func:`noise_free`)."""
    from mar_probe.quality.paired import paired_fidelity
    model = load_model().eval()
    runs = [StrategyRun(label="lazymar", name="lazymar")]
    runs += [StrategyRun(label=f"{t}/{h}", name="compose", options=tuple(options(t, h).items()))
             for t in TOKEN_SIDES for h in HEAD_SIDES]
    config = CompareConfig(runs=tuple(runs), num_samples=args.fidelity_samples, seeds=tuple(args.fidelity_seeds),
                           num_iter=args.fidelity_iter, batch_size=args.fidelity_samples, grid_images=0,
                           paired_against="lazymar")
    started = time.time()
    result = compare(model, config, progress=False)
    paired = {}
    for label, entry in result.results["strategies"].items():
        fid = entry["fidelity"]
        row = {"flop_ratio": entry["speedup"]["flops"]["mean"], "quality": entry.get("quality", {}),
               **{k: {q: fid[k][q] for q in ("mean", "lo", "hi", "n")} for k in ("psnr", "token_mse")}}
        if "paired" in entry:
            row["vs_lazymar"] = {k: entry["paired"][k] for k in ("psnr", "token_mse")}
        paired[label] = row
    print(f"fidelity (paired): {time.time() - started:.0f} s", flush=True)
    labels = config.label_array(model.num_classes)
    tokens = {r.label: [noise_free(model, r.create(), labels, seed, args.fidelity_iter) for seed in config.seeds]
              for r in config.runs}
    fid = {label: [paired_fidelity(t, f[0], i, f[1]) for (t, i), f in zip(per_seed, tokens["full"])]
           for label, per_seed in tokens.items()}
    free = {label: _row(f, None if label in ("full", "lazymar") else fid["lazymar"]) for label, f in fid.items()}
    settings = {k: v for k, v in result.results["settings"].items() if k not in ("runs", "labels")}
    return {"model": result.results["model"], "settings": settings,
            "protocols": {"paired": paired, "noise_free": free}, "seconds": time.time() - started}


RULE = ("the highest mar_base end-to-end FLOP ratio over full among the compositions whose PSNR against full is, "
        "image by image, on average at least lazymar's (mean difference >= 0) on the embedded default: in the "
        "noise-free protocol, and in the paired protocol too unless the composition has a head-step schedule (whose "
        "paired images are new samples, see docs/strategies.md)")


def rank(flops: dict, fidelity: dict) -> dict:
    """Compositions by mar_base FLOP ratio with their fidelity against lazymar in both protocols; the candidates."""
    rows = []
    for label, cell in flops["grid"].items():
        opts = options(*label.split("/"))
        row = {"composition": label, "options": opts, "head_schedule": opts.get("head_schedule"),
               "flop_ratio": cell["ratio"], "flop_ratio_over_full_b": cell["ratio_over_full_b"]}
        for name, per in fidelity["protocols"].items():
            fid = per[label]
            row[name] = {"psnr": fid["psnr"], "psnr_vs_lazymar": fid["vs_lazymar"]["psnr"],
                         "token_mse_vs_lazymar": fid["vs_lazymar"]["token_mse"],
                         "at_least_lazymar": fid["vs_lazymar"]["psnr"]["mean"] >= 0}
        row["embedded_flop_ratio"] = fidelity["protocols"]["paired"][label]["flop_ratio"]
        row["qualifies"] = row["noise_free"]["at_least_lazymar"] and (
            row["paired"]["at_least_lazymar"] or row["head_schedule"] is not None)
        rows.append(row)
    rows.sort(key=lambda r: -r["flop_ratio"]["end_to_end"])

    def first(pred):
        hit = next((r for r in rows if pred(r)), None)
        return hit["composition"] if hit else None

    best = first(lambda r: r["qualifies"])
    return {"rule": RULE, "ranking": rows, "best": best,
            "best_options": options(*best.split("/")) if best else None,
            "best_paired_only": first(lambda r: r["paired"]["at_least_lazymar"]),
            "best_noise_free_only": first(lambda r: r["noise_free"]["at_least_lazymar"]),
            "fastest_overall": rows[0]["composition"]}


def _i(d: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(d['mean'])} [{fmt.format(d['lo'])}, {fmt.format(d['hi'])}]"


def markdown(payload: dict) -> str:
    s, m, f, q, r = (payload[k] for k in ("settings", "machine", "flops", "fidelity", "rank"))
    lo, hi = payload["load"]["before"], payload["load"]["after"]
    refs, fs, prot = f["references"], q["settings"], q["protocols"]
    reused = sorted(k for k, v in f["runs"].items() if v.get("reused"))
    lines = [
        "# Composed strategies ranked (issue 17, item 2)", "",
        f"Command: `{payload['command']}`", "",
        f"Machine: {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads), {m['date']}; load average "
        f"before {lo['1min']:.2f}/{lo['5min']:.2f}/{lo['15min']:.2f}, after {hi['1min']:.2f}/{hi['5min']:.2f}/"
        f"{hi['15min']:.2f} (1/5/15 min).", "",
        f"FLOPs: `{s['preset']}` (random weights), batch {s['batch']}, {s['num_iter']} steps, CFG {s['cfg']}, "
        f"{s['num_sampling_steps']} head steps, seed {s['seed']}; token axis with head `{AXIS_HEAD}`, head axis with "
        f"tokens `{AXIS_TOKENS}`; check cell `{f['check_cell']}` run in full: the sum holds exactly "
        f"({f['factorises']})" + (f"; runs reused from `{s['reuse_flops']}` (same settings): {len(reused)}"
                                  if reused else "") + ". "
        f"References over `full` (FLOPs, end to end): `full-b` {refs['full-b']['ratio']['end_to_end']:.2f}x, "
        f"`lazymar` {refs['lazymar']['ratio']['end_to_end']:.2f}x.", "",
        f"Fidelity: the embedded default (`{q['model']}`), {fs['num_iter']} steps, CFG {fs['cfg']} "
        f"({fs['cfg_schedule']}), {fs['num_samples']} images x seeds {fs['seeds']}; PSNR against `full`, and its "
        f"difference to `lazymar`'s image by image, with 95% t-intervals. *paired*: `compare()` at temperature "
        f"{fs['temperature']} (`lazymar` {_i(prot['paired']['lazymar']['psnr'])} dB); *noise-free*: temperature 0, "
        f"the head's initial noise from its own generator (`lazymar` {_i(prot['noise_free']['lazymar']['psnr'])} dB).",
        "",
        "| composition | FLOPs over `full` | over `full-b` | transformer | head | paired PSNR - lazymar dB | "
        "noise-free PSNR - lazymar dB | qualifies |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in r["ranking"]:
        fr = row["flop_ratio"]
        mark = "**" if row["composition"] == r["best"] else ""
        lines.append(f"| {mark}`{row['composition']}`{mark} | {fr['end_to_end']:.2f}x | "
                     f"{row['flop_ratio_over_full_b']:.2f}x | {fr['transformer']:.2f}x | {fr['head']:.2f}x | "
                     f"{_i(row['paired']['psnr_vs_lazymar'])} | {_i(row['noise_free']['psnr_vs_lazymar'])} | "
                     f"{'yes' if row['qualifies'] else 'no'} |")
    best = r["best"]
    lines += ["", f"Rule: {r['rule']}.", "",
              (f"Named candidate: `{best}` = `compose` with " + ", ".join(
                  f"`{k}={v}`" for k, v in r["best_options"].items()) + ".") if best else
              "No composition qualifies.",
              f"By the paired protocol alone: `{r['best_paired_only']}`; by the noise-free one alone: "
              f"`{r['best_noise_free_only']}`; fastest overall: `{r['fastest_overall']}`."]
    lines += ["", "Token sides: " + "; ".join(f"`{k}` {v}" for k, v in TOKEN_SIDES.items()) + ".",
              "Head sides: " + "; ".join(f"`{k}` {v}" for k, v in dict(HEAD_SIDES, **REFERENCE_HEADS).items())
              + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = bench_parser(__doc__)
    p.set_defaults(num_iter=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--fidelity-iter", type=int, default=32, help="steps of the fidelity runs (default 32)")
    p.add_argument("--fidelity-samples", type=int, default=16, help="images per seed (default 16)")
    p.add_argument("--fidelity-seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0],
                   help="comma-separated seeds of the fidelity runs (default 0)")
    p.add_argument("--tiny", action="store_true", help="smoke run: mar_tiny, 4 steps, 2 images at 4 steps")
    p.add_argument("--reuse-flops", metavar="FILE",
                   help="a previous compose_rank.json with the same FLOP settings: its runs are not run again")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    args = p.parse_args(argv)
    if args.tiny:
        args.preset, args.num_iter, args.num_sampling_steps = "mar_tiny", 4, "5"
        args.fidelity_iter, args.fidelity_samples = 4, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    before = load_average()
    flops = measure_flops(args)
    fidelity = measure_fidelity(args)
    settings = {k: getattr(args, k) for k in ("preset", "batch", "num_iter", "cfg", "num_sampling_steps", "seed",
                                              "threads", "fidelity_iter", "fidelity_samples", "fidelity_seeds",
                                              "reuse_flops")}
    payload = {"machine": machine(), "command": " ".join(["python", "benchmarks/bench_compose.py"] + sys.argv[1:]),
               "settings": settings, "load": {"before": before, "after": load_average()},
               "token_sides": TOKEN_SIDES, "head_sides": dict(HEAD_SIDES, **REFERENCE_HEADS),
               "flops": flops, "fidelity": fidelity, "rank": rank(flops, fidelity)}
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = "compose_rank" + ("_tiny" if args.tiny else "")
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / f"{stem}.md").write_text(markdown(payload))
    print(markdown(payload))


if __name__ == "__main__":
    main()
