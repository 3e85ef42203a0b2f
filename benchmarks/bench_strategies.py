"""All caching strategies side by side: time and FLOPs per component, ratios against ``full``.

Default: the mar_base architecture with random weights, batch 1, 64 steps, CFG 3.0 (linear schedule), 100
diffusion steps, on the CPU — the setting of ``shared/facts.md`` (official MAR 181 s per image on 2 cores;
released LazyMAR 2.31x end to end). Every strategy runs with its default options in one process; the strategies
alternate within each of ``--rounds`` rounds (odd rounds in reverse order, so slow drifts of the machine's load
hit all alike), after a short warm-up. Seconds are reported per component as the best and the median over rounds
with their spread; speed-ups divide ``full``'s time by the strategy's (best by best, median by median, and per
round); FLOPs are what each strategy reports (see ``mar_probe.strategies.cost``) and do not vary between rounds.
The load average before and after is stored beside the numbers; ``--clock cpu --threads 1`` times this process's
CPU seconds instead of wall time, for a machine shared with other jobs. Targets from the issue: ``lazymar`` >= 2.3x end
to end, ``marche`` >= 1.6x on the transformer (encoder + decoder).

    python benchmarks/bench_strategies.py                       # writes results/strategies_<host>.json/.md/.png
    python benchmarks/bench_strategies.py --tiny --out /tmp/b   # smoke run: mar_tiny, a few steps
    python benchmarks/bench_strategies.py --device cuda         # on a GPU (CUDA-synchronised component times)
    python benchmarks/bench_strategies.py --strategies full,marche,m32=marche --strategy-opt m32.budget=32 --tag m32
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, bench_parser, command_line, machine
from mar_probe import create_model, sample, strategies
from mar_probe.compare import StrategyRun, parse_runs
from mar_probe.models.checkpoints import resolve_device
from mar_probe.strategies import Timer

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

COMPONENTS = ("encoder", "decoder", "head")
PARTS = ("end_to_end", "transformer") + COMPONENTS
DEFAULT_STRATEGIES = "full,fewer-steps,lazymar,marche,compose"
TARGETS = {"lazymar": ("end_to_end", 2.3), "marche": ("transformer", 1.6)}


def run_one(model, run: StrategyRun, args) -> dict:
    """Sample once with one strategy; seconds and FLOPs per component and their totals."""
    strategy = run.create()
    clock = CLOCKS[args.clock]
    t0 = clock()
    res = sample(model, list(range(args.batch)), num_iter=args.num_iter, cfg=args.cfg, seed=args.seed,
                 strategy=strategy, progress=args.progress)
    elapsed = clock() - t0
    tot = res.cost["totals"]
    sec = {c: tot["seconds"].get(c, 0.0) for c in COMPONENTS}
    flops = {c: sum(v for k, v in tot["flops"].items() if k.startswith(c + ".")) for c in COMPONENTS}
    sec["transformer"], flops["transformer"] = sec["encoder"] + sec["decoder"], flops["encoder"] + flops["decoder"]
    sec["end_to_end"], flops["end_to_end"] = elapsed, tot["flops_total"]
    return {"strategy": strategy.to_dict(), "steps": len(res.cost["steps"]), "seconds": sec, "flops": flops,
            "flops_by_kind": tot["flops"]}


def summarise(runs: list[dict]) -> dict:
    """Rounds of one strategy -> seconds per part (per round, best, median, spread) and its FLOPs."""
    per_round = {p: [r["seconds"][p] for r in runs] for p in PARTS}
    best = {p: min(v) for p, v in per_round.items()}
    median = {p: statistics.median(v) for p, v in per_round.items()}
    spread = {p: (max(v) - min(v)) / median[p] if median[p] else 0.0 for p, v in per_round.items()}
    first = runs[0]
    return {"strategy": first["strategy"], "steps": first["steps"], "seconds_per_round": per_round,
            "seconds": best, "seconds_median": median, "spread": spread, "flops": first["flops"],
            "flops_by_kind": first["flops_by_kind"]}


def ratios(rows: dict) -> None:
    """Add speed-ups (full time / time: best, median, per round) and FLOP ratios (full FLOPs / FLOPs) per part."""
    base = rows["full"]
    for row in rows.values():
        row["speedup"] = {k: base["seconds"][k] / v if v else None for k, v in row["seconds"].items()}
        row["speedup_median"] = {k: base["seconds_median"][k] / v if v else None
                                 for k, v in row["seconds_median"].items()}
        row["speedup_per_round"] = {k: [b / s if s else None for b, s in zip(base["seconds_per_round"][k], v)]
                                    for k, v in row["seconds_per_round"].items()}
        row["flop_ratio"] = {k: base["flops"][k] / v if v else None for k, v in row["flops"].items()}


def load_average() -> dict:
    """1/5/15-minute load averages and the number of runnable processes (None where unknown)."""
    try:
        one, five, fifteen = os.getloadavg()
        return {"1min": one, "5min": five, "15min": fifteen, "time": time.strftime("%H:%M:%S %Z")}
    except OSError:
        return {"1min": None, "5min": None, "15min": None, "time": time.strftime("%H:%M:%S %Z")}


def markdown(payload: dict) -> str:
    """A table per strategy and part: best/median seconds, spread, GFLOPs, speed-up and FLOP ratio against full."""
    s, m = payload["settings"], payload["machine"]
    lo, hi = payload["load"]["before"], payload["load"]["after"]
    lines = [f"# Strategies side by side ({s['preset']}, batch {s['batch']}, {s['num_iter']} steps, CFG {s['cfg']}, "
             f"{s['num_sampling_steps']} diffusion steps, {s['rounds']} rounds, {s['clock']} clock)", "",
             f"Machine: {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads), {m['date']}; load "
             f"average before {lo['1min']:.2f}/{lo['5min']:.2f}/{lo['15min']:.2f}, after "
             f"{hi['1min']:.2f}/{hi['5min']:.2f}/{hi['15min']:.2f} (1/5/15 min).", "",
             "| strategy | part | best s | median s | spread | GFLOPs | speed-up (best) | speed-up (median) "
             "| FLOP ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in payload["results"].items():
        for part in PARTS:
            sp, sm, fr = row["speedup"][part], row["speedup_median"][part], row["flop_ratio"][part]
            if not (sp and fr):
                lines.append(f"| {name} | {part} | - | - | - | - | - | - | - |")
                continue
            lines.append(f"| {name} | {part} | {row['seconds'][part]:.1f} | {row['seconds_median'][part]:.1f} | "
                         f"{100 * row['spread'][part]:.0f}% | {row['flops'][part] / 1e9:.0f} | {sp:.2f}x | "
                         f"{sm:.2f}x | {fr:.2f}x |")
    lines += ["", "Targets: " + "; ".join(
        f"{n} {part} >= {t}x: reached {payload['results'][n]['speedup'][part]:.2f}x (best), "
        f"{payload['results'][n]['speedup_median'][part]:.2f}x (median), FLOP ratio "
        f"{payload['results'][n]['flop_ratio'][part]:.2f}x"
        for n, (part, t) in TARGETS.items() if n in payload["results"])]
    return "\n".join(lines) + "\n"


def draw(payload: dict):
    """Bars of best seconds and of GFLOPs per component (stacked) per strategy, each bar labelled with its
    end-to-end speed-up (time) or FLOP ratio over full, transformer-only in brackets; returns the Figure."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    rows = payload["results"]
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    for ax, key, unit, scale in ((axes[0], "seconds", "seconds (best of rounds)", 1.0),
                                 (axes[1], "flops", "GFLOPs", 1e-9)):
        bottom = [0.0] * len(names)
        for comp in COMPONENTS:
            vals = [rows[n][key][comp] * scale for n in names]
            ax.bar(names, vals, bottom=bottom, label=comp)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ratio = "speedup" if key == "seconds" else "flop_ratio"
        for i, n in enumerate(names):
            r = rows[n][ratio]
            ax.annotate(f"{r['end_to_end']:.2f}x\n({r['transformer']:.2f}x)", (i, bottom[i]), ha="center",
                        va="bottom", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_ylim(0, max(bottom) * 1.25)
        ax.tick_params(axis="x", labelrotation=20)
        ax.set_xlabel("strategy")
    axes[0].set_title("time per run; bar labels: speed-up over full\n(end to end, transformer only in brackets)",
                      fontsize="medium")
    axes[1].set_title("FLOPs per run; bar labels: FLOP ratio full / strategy\n(end to end, transformer only in "
                      "brackets)", fontsize="medium")
    axes[1].legend(title="component", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    s = payload["settings"]
    fig.suptitle(f"{s['preset']}, batch {s['batch']}, {s['num_iter']} steps, CFG {s['cfg']}, "
                 f"{s['num_sampling_steps']} diffusion steps, {payload['machine']['cores']} cores")
    return fig


def figure(payload: dict, path: Path) -> Path:
    """:func:`draw` as an image at ``path``."""
    import matplotlib.pyplot as plt
    fig = draw(payload)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_rounds(model, chosen: tuple, args, on_round=None, runs: dict | None = None) -> dict:
    """``args.rounds`` rounds over the strategies (odd rounds reversed); the runs of each strategy by label.
    ``on_round(runs)``, when given, is called after every finished round with the runs so far (complete rounds
    only), so that a long run can write what it has measured before it is stopped (issue 17); ``runs`` of finished
    rounds (as ``on_round`` got them) are continued from the next round."""
    runs = {c.label: [] for c in chosen} if runs is None else {c.label: list(runs[c.label]) for c in chosen}
    for r in range(len(runs[chosen[0].label]), args.rounds):
        for c in (chosen if r % 2 == 0 else chosen[::-1]):
            res = run_one(model, c, args)
            runs[c.label].append(res)
            print(f"round {r} {c.label}: {res['seconds']['end_to_end']:.1f} s (" + ", ".join(
                f"{c} {res['seconds'][c]:.1f} s / {res['flops'][c] / 1e9:.1f} GFLOPs" for c in COMPONENTS) + ")",
                flush=True)
        if on_round is not None:
            on_round(runs)
    return runs


def parser():
    """The command line (a function, so that tests can read a recorded command back into its settings)."""
    p = bench_parser(__doc__)
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated NAME or LABEL=NAME, or 'all' for every registered one (default "
                        f"{DEFAULT_STRATEGIES}; full is always included)")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="LABEL.KEY=VALUE",
                   help="option of one strategy, repeatable (e.g. marche.budget=32)")
    p.add_argument("--tag", default="", help="suffix of the result files (strategies_<host>_<tag>.*)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all strategies (default 2)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default) or this process's CPU time (needs --threads 1; for a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--tiny", action="store_true", help="smoke run: mar_tiny, 4 steps, 5 diffusion steps")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--progress", action="store_true")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds!r}")
    if args.tiny:
        args.preset, args.num_iter, args.num_sampling_steps = "mar_tiny", 4, "5"
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures one process's CPU seconds and needs --threads 1, got {args.threads!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:                                       # names the bad value
        p.error(f"--device: {exc}")
    if args.clock == "cpu" and device.type != "cpu":
        p.error(f"--clock cpu counts this process's CPU seconds, not the GPU's; use --clock wall with --device "
                f"{args.device!r}")
    Timer.clock = staticmethod(CLOCKS[args.clock])
    text = ",".join(strategies.available()) if args.strategies == "all" else args.strategies
    chosen = parse_runs(text, args.strategy_opt)                    # fails early on bad names/options
    chosen = (StrategyRun(label="full", name="full"),) + tuple(c for c in chosen if c.label != "full")
    torch.manual_seed(0)
    model = create_model(args.preset, num_sampling_steps=args.num_sampling_steps).to(device).eval()
    before = load_average()
    sample(model, [0], num_iter=2, cfg=args.cfg, seed=0)            # warm-up (allocator, kernels)
    runs = run_rounds(model, chosen, args)
    results = {n: summarise(r) for n, r in runs.items()}
    ratios(results)
    settings = {k: getattr(args, k) for k in ("preset", "batch", "num_iter", "cfg", "num_sampling_steps", "seed",
                                              "rounds", "clock", "strategies", "strategy_opt", "device")}
    payload = {"machine": machine(), "command": command_line("bench_strategies.py", argv), "settings": settings,
               "load": {"before": before, "after": load_average()}, "results": results}
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"strategies_{socket.gethostname()}" + ("_tiny" if args.tiny else "")
            + ("_cpu" if args.clock == "cpu" else "") + ("" if device.type == "cpu" else f"_{device.type}")
            + (f"_{args.tag}" if args.tag else ""))
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{stem}.md").write_text(markdown(payload))
    figure(payload, out / f"{stem}.png")
    print(markdown(payload))


if __name__ == "__main__":
    main()
