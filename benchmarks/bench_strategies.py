"""All caching strategies side by side: time and FLOPs per component, ratios against ``full``.

Default: the mar_base architecture with random weights, batch 1, 64 steps, CFG 3.0 (linear schedule), 100
diffusion steps, on the CPU — the setting of ``shared/facts.md`` (official MAR 181 s per image on 2 cores;
released LazyMAR 2.31x end to end). Every strategy runs with its default options in one process, one after the
other, after a short warm-up; FLOPs are what each strategy reports (see ``mar_probe.strategies.cost``).
Targets from the issue: ``lazymar`` >= 2.3x end to end, ``marche`` >= 1.6x on the transformer (encoder + decoder).

    python benchmarks/bench_strategies.py                       # writes results/strategies_<host>.json/.md
    python benchmarks/bench_strategies.py --tiny --out /tmp/b   # smoke run: mar_tiny, a few steps
    python benchmarks/bench_strategies.py --strategies full,marche --strategy-opt marche:budget=32
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch

from common import RESULTS, bench_parser, machine
from mar_probe import create_model, sample, strategies

COMPONENTS = ("encoder", "decoder", "head")
TARGETS = {"lazymar": ("end_to_end", 2.3), "marche": ("transformer", 1.6)}


def run_one(model, name: str, options: dict, args) -> dict:
    """Sample once with one strategy; seconds and FLOPs per component and their totals."""
    strategy = strategies.create(name, **options)
    t0 = time.perf_counter()
    res = sample(model, list(range(args.batch)), num_iter=args.num_iter, cfg=args.cfg, seed=args.seed,
                 strategy=strategy, progress=args.progress)
    wall = time.perf_counter() - t0
    tot = res.cost["totals"]
    sec = {c: tot["seconds"].get(c, 0.0) for c in COMPONENTS}
    flops = {c: sum(v for k, v in tot["flops"].items() if k.startswith(c + ".")) for c in COMPONENTS}
    sec["transformer"], flops["transformer"] = sec["encoder"] + sec["decoder"], flops["encoder"] + flops["decoder"]
    sec["end_to_end"], flops["end_to_end"] = wall, tot["flops_total"]
    return {"strategy": strategy.to_dict(), "steps": len(res.cost["steps"]), "seconds": sec, "flops": flops,
            "flops_by_kind": tot["flops"]}


def ratios(rows: dict) -> None:
    """Add speed-up (full time / time) and FLOP ratio (full FLOPs / FLOPs) per part to every row."""
    base = rows["full"]
    for row in rows.values():
        row["speedup"] = {k: base["seconds"][k] / v if v else None for k, v in row["seconds"].items()}
        row["flop_ratio"] = {k: base["flops"][k] / v if v else None for k, v in row["flops"].items()}


def markdown(payload: dict) -> str:
    """A table per part: seconds, GFLOPs, speed-up and FLOP ratio against full."""
    s = payload["settings"]
    lines = [f"# Strategies side by side ({s['preset']}, batch {s['batch']}, {s['num_iter']} steps, CFG {s['cfg']}, "
             f"{s['num_sampling_steps']} diffusion steps)", "",
             f"Machine: {payload['machine']['cpu']} ({payload['machine']['cores']} cores, "
             f"{payload['machine']['torch_threads']} torch threads), {payload['machine']['date']}.", "",
             "| strategy | part | seconds | GFLOPs | speed-up | FLOP ratio |", "|---|---|---:|---:|---:|---:|"]
    for name, row in payload["results"].items():
        for part in ("end_to_end", "transformer") + COMPONENTS:
            sp, fr = row["speedup"][part], row["flop_ratio"][part]
            lines.append(f"| {name} | {part} | {row['seconds'][part]:.2f} | {row['flops'][part] / 1e9:.1f} | "
                         f"{sp:.2f}x | {fr:.2f}x |" if sp and fr else f"| {name} | {part} | - | - | - | - |")
    lines += ["", "Targets: " + "; ".join(
        f"{n} {part} >= {t}x: reached {payload['results'][n]['speedup'][part]:.2f}x"
        for n, (part, t) in TARGETS.items() if n in payload["results"])]
    return "\n".join(lines) + "\n"


def parse_strategy_opts(pairs) -> dict:
    """``["marche:budget=32"]`` -> ``{"marche": {"budget": 32}}``."""
    out: dict = {}
    for pair in pairs:
        name, sep, kv = pair.partition(":")
        if not sep:
            raise ValueError(f"--strategy-opt expects NAME:KEY=VALUE, got {pair!r}")
        out.setdefault(name, {}).update(strategies.parse_options(name, [kv]))
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--strategies", default=",".join(strategies.available()),
                   help="comma-separated names (full is always included)")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="NAME:KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--tiny", action="store_true", help="smoke run: mar_tiny, 4 steps, 5 diffusion steps")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.preset, args.num_iter, args.num_sampling_steps = "mar_tiny", 4, "5"
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ["full"] + [n for n in args.strategies.split(",") if n and n != "full"]
    opts = parse_strategy_opts(args.strategy_opt)
    for n in names:
        strategies.create(n, **opts.get(n, {}))                     # fail early on bad names/options
    torch.manual_seed(0)
    model = create_model(args.preset, num_sampling_steps=args.num_sampling_steps).eval()
    sample(model, [0], num_iter=2, cfg=args.cfg, seed=0)            # warm-up (allocator, kernels)
    results = {}
    for n in names:
        results[n] = run_one(model, n, opts.get(n, {}), args)
        r = results[n]
        print(f"{n}: {r['seconds']['end_to_end']:.1f} s (" + ", ".join(
            f"{c} {r['seconds'][c]:.1f} s / {r['flops'][c] / 1e9:.1f} GFLOPs" for c in COMPONENTS) + ")", flush=True)
    ratios(results)
    settings = {k: getattr(args, k) for k in ("preset", "batch", "num_iter", "cfg", "num_sampling_steps", "seed")}
    payload = {"machine": machine(), "settings": settings, "results": results}
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = f"strategies_{socket.gethostname()}" + ("_tiny" if args.tiny else "")
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{stem}.md").write_text(markdown(payload))
    print(markdown(payload))


if __name__ == "__main__":
    main()
