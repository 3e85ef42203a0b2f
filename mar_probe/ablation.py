"""Ablations judged with :func:`~mar_probe.compare.compare`: ``mar-probe ablate lazymar`` and ``mar-probe ablate
marche-selection`` (issue 15, items 3 and 4).

**LazyMAR attribution** (:func:`lazymar_attribution`): LazyMAR is three caches (token, condition, diffusion head;
see :mod:`mar_probe.strategies.lazymar`). Its paper reports the token and condition caches alone and together,
never the head cache, so which cache costs the quality is not known. The arms of :func:`lazymar_attribution_runs`
are every non-empty subset of the three: each cache alone, each pair, and all three (``lazymar``, the released
code), each a ``lazymar`` run with exactly its flags set. Every arm is paired image by image against ``full``
(its fidelity) and against ``lazymar`` (``paired``: the arm's per-image PSNR minus lazymar's, so a pair arm says
what removing the third cache from lazymar changes). The head cache's interval is scaled to the number of head
steps (:func:`scaled_head_interval`): the released 7 is for 100 diffusion steps, and on a head of 50 steps an
interval of 7 recomputes half as often per unit of the reverse process.

**MARché's premise, downstream** (:func:`marche_selection`): MARché refreshes the tokens most attended by the
generating tokens; the review (``marche-review.md``, objection 2) asks whether attention picks the tokens that
matter. :func:`selection_runs` makes the arms ``attention@B``, ``random@B``, ``low-attention@B`` and ``oracle@B``
(the true K/V drift, an upper bound) per budget B, and each arm is paired per image against ``attention@B`` (the
same budget) over all images of all seeds (``paired`` in ``results.json``, the same function as ``compare
--paired-against``: :func:`~mar_probe.compare.paired_difference`).

Both write what ``compare`` writes (``results.json``, ``results.csv``, ``samples/``, ``grid.png``) and add
``results["ablation"]`` (its kind, settings and summary rows), ``ablation.csv`` (the summary rows), a figure
(``attribution.png`` or ``selection.png``, :mod:`mar_probe.plot.ablation`) and the worst images of each arm beside
``full``'s (``worst.png``, ``worst.csv``: the ``worst`` images with the lowest PSNR against ``full`` over all
seeds).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from .compare import (CompareConfig, CompareResult, StrategyRun, _json_default, compare, paired_difference,
                      seed_paired_difference, write_results)
from .quality.paired import paired_fidelity

# The released LazyMAR code (feihongyan1/LazyMAR, its CachedDiffLoss) recomputes the diffusion head every 7th reverse
# index, for MAR's default head of 100 sampling steps (num_sampling_steps="100" in the official main_mar.py).
RELEASED_HEAD_INTERVAL = 7
RELEASED_HEAD_STEPS = 100
CACHES = ("token", "condition", "head")
LAZYMAR_LABEL = "lazymar"            # the arm with all three caches: the released LazyMAR
SELECTIONS = ("attention", "random", "low-attention", "oracle")
REFERENCE_SELECTION = "attention"    # what every arm of a budget is paired against
DEFAULT_BUDGETS = (32, 64)
DEFAULT_WORST = 4


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def scaled_head_interval(head_steps: int) -> int:
    """The head cache's recompute interval for a head sampling with ``head_steps`` reverse steps.

    The released LazyMAR code recomputes the head every ``RELEASED_HEAD_INTERVAL = 7`` reverse indices (its
    ``CachedDiffLoss``) and was run with MAR's default head of ``RELEASED_HEAD_STEPS = 100`` diffusion steps
    (``num_sampling_steps="100"``, the official ``main_mar.py``). Kept as the same *fraction* of the reverse
    process, the interval for K steps is ``max(1, round(7 * K / 100))``, rounded half up (integer arithmetic, so
    50 steps give 4 rather than Python's round-half-to-even 4 or 3 by accident): 100 -> 7, 50 -> 4, 64 -> 4,
    10 -> 1, 5 -> 1.
    """
    k = _check_count("head_steps", head_steps)
    return max(1, (RELEASED_HEAD_INTERVAL * k + RELEASED_HEAD_STEPS // 2) // RELEASED_HEAD_STEPS)


def head_step_count(spacing) -> int:
    """Reverse steps of a head spacing (``"50"`` -> 50, per-section ``"25,25"`` -> 50); every section >= 1."""
    from .models.diffusion import parse_spacing
    counts = parse_spacing(spacing)
    if any(c < 1 for c in counts):
        raise ValueError(f"head steps must be >= 1 in every section, got {spacing!r}")
    return sum(counts)


def _arm_label(caches) -> str:
    return LAZYMAR_LABEL if len(caches) == len(CACHES) else "+".join(caches)


def lazymar_attribution_runs(*, head_steps: int | None = None, base_options=None,
                             scale_head_interval: bool = True) -> tuple[StrategyRun, ...]:
    """The arms of the LazyMAR attribution: each cache alone, each pair, all three.

    Parameters
    ----------
    head_steps : reverse steps of the model's diffusion head (None: the released code's 100, interval 7).
    base_options : other ``lazymar`` options shared by every arm (e.g. ``{"refresh_interval": 5}``); the three
        cache flags are the arms' and refused here, as is ``head_interval`` while ``scale_head_interval`` is on.
    scale_head_interval : the head interval from :func:`scaled_head_interval` (default); off: ``base_options``'
        ``head_interval``, else the released 7.

    Returns
    -------
    Seven ``lazymar`` :class:`~mar_probe.compare.StrategyRun` labelled ``token``, ``condition``, ``head``,
    ``token+condition``, ``token+head``, ``condition+head`` and ``lazymar``, each with ``token_cache``,
    ``condition_cache`` and ``head_cache`` set (True for its caches, False for the others) and the
    ``head_interval`` used (recorded in ``results.json`` for every arm, also those without the head cache).
    """
    base = dict(base_options or {})
    flags = sorted({f"{c}_cache" for c in CACHES} & set(base))
    if flags:
        raise ValueError(f"the cache flags are the arms of the attribution, got {flags!r} in the base options")
    steps = RELEASED_HEAD_STEPS if head_steps is None else _check_count("head_steps", head_steps)
    if scale_head_interval:
        if "head_interval" in base:
            raise ValueError(f"head_interval {base['head_interval']!r} given while the head interval is scaled to "
                             "the head steps; expected one of the two (turn scaling off to set it by hand)")
        base["head_interval"] = scaled_head_interval(steps)
    else:
        base.setdefault("head_interval", RELEASED_HEAD_INTERVAL)
    runs = []
    for n in range(1, len(CACHES) + 1):
        for caches in itertools.combinations(CACHES, n):
            opts = {**base, **{f"{c}_cache": c in caches for c in CACHES}}
            runs.append(StrategyRun(label=_arm_label(caches), name="lazymar", options=tuple(opts.items())))
    return tuple(runs)


def selection_runs(budgets=DEFAULT_BUDGETS, selections=SELECTIONS, base_options=None) -> tuple[StrategyRun, ...]:
    """MARché arms ``SELECTION@BUDGET`` (``attention@32``, ``random@32``, ...), budget by budget.

    ``attention`` (the paper's rule and every arm's reference) is added first when ``selections`` leaves it out;
    ``base_options`` are other ``marche`` options shared by every arm (not ``budget`` or ``selection``).
    """
    from .strategies.marche import SELECTIONS as VALID
    budgets, selections = tuple(budgets), tuple(selections)
    for s in selections:
        if s not in VALID:
            raise ValueError(f"unknown selection rule {s!r}; expected some of {VALID!r}")
    budgets = tuple(_check_count("budget", b) for b in budgets)
    if not budgets or not selections:
        raise ValueError(f"expected at least one budget and one selection rule, got budgets {budgets!r} and "
                         f"selections {selections!r}")
    for name, values in (("budgets", budgets), ("selections", selections)):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} must be distinct, got {values!r}")
    base = dict(base_options or {})
    clash = sorted({"budget", "selection"} & set(base))
    if clash:
        raise ValueError(f"the arms set {clash!r}; expected them out of the base options")
    if REFERENCE_SELECTION not in selections:
        selections = (REFERENCE_SELECTION,) + selections
    return tuple(StrategyRun(label=f"{s}@{b}", name="marche", options=tuple({**base, "budget": b, "selection": s}
                                                                         .items()))
                 for b in budgets for s in selections)


def _only_full(config: CompareConfig, what: str) -> None:
    extra = [r.label for r in config.runs if r.label != "full"]
    if extra:
        raise ValueError(f"the {what} chooses its own arms; expected a CompareConfig with runs=(), got {extra!r}")


def _run(model, config: CompareConfig, runs, paired_against, **kw) -> CompareResult:
    config = dataclasses.replace(config, runs=runs, paired_against=paired_against)
    return compare(model, config, **kw)


# ---- LazyMAR attribution -------------------------------------------------------------------------------------
def lazymar_attribution(model, config: CompareConfig, *, base_options=None, scale_head_interval: bool = True,
                        vae=None, progress: bool = True, partial=None, resume: bool = False, ranks=None,
                        command: str | None = None) -> CompareResult:
    """Run the seven :func:`lazymar_attribution_runs` arms and ``full`` with ``config``'s samples, seeds and
    sampling settings (its ``runs`` must be empty), paired against ``full`` and against ``lazymar``.

    The head steps are the config's (``head_steps``), else the model's. Returns :func:`~mar_probe.compare.compare`'s
    result with ``results["ablation"]``: ``{"kind": "lazymar-attribution", "head_steps", "head_interval",
    "head_interval_scaled", "head_interval_rule", "metric", "reference", "rows": attribution_summary(...),
    "verdict": [...], "notes": [...]}`` (notes: fewer images or seeds than a claim needs, CFG 1.0).
    """
    _only_full(config, "LazyMAR attribution")
    resolved = config.resolved(model)
    steps = head_step_count(resolved.head_steps)
    runs = lazymar_attribution_runs(head_steps=steps, base_options=base_options,
                                    scale_head_interval=scale_head_interval)
    result = _run(model, config, runs, LAZYMAR_LABEL, vae=vae, progress=progress, partial=partial, resume=resume,
                  ranks=ranks, command=command)
    results = result.results
    rows = attribution_summary(results)
    results["ablation"] = {
        "kind": "lazymar-attribution", "head_steps": steps, "head_interval": dict(runs[0].options)["head_interval"],
        "head_interval_scaled": bool(scale_head_interval),
        "head_interval_rule": f"max(1, floor({RELEASED_HEAD_INTERVAL} * head_steps / {RELEASED_HEAD_STEPS} + 1/2))"
                              if scale_head_interval else "given",
        "metric": _metric(results), "reference": LAZYMAR_LABEL, "rows": rows,
        "verdict": attribution_verdict(rows, _metric(results)), "notes": _notes(config)}
    if resolved.cfg == 1.0:
        results["ablation"]["notes"].append("cfg 1.0: no unconditional branch, so the condition cache has nothing "
                                            "to cache (its arms equal those without it); give --cfg > 1")
    return result


MIN_IMAGES, MIN_SEEDS = 200, 3   # issue 15: n >= 200 paired images per arm over >= 3 seeds


def _notes(config: CompareConfig) -> list[str]:
    """What a reader should know before trusting the intervals: fewer images or seeds than issue 15 asks."""
    n, seeds = config.num_samples * len(config.seeds), len(config.seeds)
    if n >= MIN_IMAGES and seeds >= MIN_SEEDS:
        return []
    return [f"{n} paired images per arm over {seeds} seed(s): below the n >= {MIN_IMAGES} over >= {MIN_SEEDS} "
            "seeds a claim needs (issue 15); read the intervals as a smoke test"]


def _metric(results: dict) -> str:
    """The fidelity metric the summaries rank by: PSNR against full, token MSE when there are no images."""
    full = results["strategies"]["full"]["fidelity"]
    return "psnr" if "psnr" in full else "token_mse"


def _caches(entry: dict) -> list[str]:
    config = entry["config"]
    return [c for c in CACHES if config.get(f"{c}_cache")]


def _i(entry: dict | None) -> dict | None:
    """An ``I`` (or fidelity ``D``) dict reduced to mean, lo, hi, n, clipped."""
    if not isinstance(entry, dict):
        return None
    return {k: entry.get(k) for k in ("mean", "lo", "hi", "n", "clipped")}


def attribution_summary(results: dict, metric: str | None = None) -> list[dict]:
    """One row per arm (not ``full``), sorted by fidelity loss, largest first (lowest PSNR against ``full``;
    highest token MSE without images): ``label``, ``order`` (its place in the run), ``caches``, ``n_caches``,
    ``speedup_flops``, ``speedup_time``, ``metric``, ``vs_full`` (the arm's ``metric`` against full, ``I``),
    ``vs_full_tail`` (its bad tail, an Interval dict) and ``vs_lazymar`` (the paired per-image difference against
    ``lazymar``, ``I``; None for lazymar itself)."""
    from .compare import METRICS
    metric = metric or _metric(results)
    rows = []
    for order, (label, e) in enumerate(results["strategies"].items()):
        if label == "full":
            continue
        fid = e["fidelity"].get(metric, {})
        rows.append({"label": label, "order": order, "caches": _caches(e), "n_caches": len(_caches(e)),
                     "speedup_flops": _i(e["speedup"]["flops"]), "speedup_time": _i(e["speedup"]["time"]),
                     "metric": metric, "vs_full": _i(fid),
                     "vs_full_tail": (fid.get("statistics") or {}).get("tail"),
                     "vs_lazymar": _i((e.get("paired") or {}).get(metric))})
    sign = 1.0 if METRICS[metric].higher_is_better else -1.0
    rows.sort(key=lambda r: sign * (r["vs_full"]["mean"] if r["vs_full"] and r["vs_full"]["mean"] is not None
                                    else np.inf))
    return rows


def _fmt(i: dict | None, unit: str = "") -> str:
    if not i or i.get("mean") is None:
        return "-"
    star = "*" if i.get("clipped") else ""
    if i.get("lo") is None:
        return f"{i['mean']:.3g}{unit} (n={i.get('n')})"
    return f"{i['mean']:.3g}{unit} [{i['lo']:.3g}, {i['hi']:.3g}]{star} (n={i.get('n')})"


def _overlaps(a: dict, b: dict) -> bool:
    """Whether two ``I`` intervals overlap (True when either has none: nothing separates them)."""
    if a.get("lo") is None or b.get("lo") is None:
        return True
    return a["lo"] <= b["hi"] and b["lo"] <= a["hi"]


def attribution_verdict(rows: list[dict], metric: str) -> list[str]:
    """Sentences read off the summary rows: the single cache that loses the most fidelity against ``full`` and
    what removing each cache from ``lazymar`` changes (the pair without it, paired per image against lazymar)."""
    unit = " dB" if metric == "psnr" else ""
    by = {r["label"]: r for r in rows}
    singles = [r for r in rows if r["n_caches"] == 1 and r["vs_full"] and r["vs_full"]["mean"] is not None]
    out = []
    if singles:
        worst = singles[0]                                      # rows are sorted by loss, largest first
        line = (f"alone, the {worst['label']} cache loses the most: {metric} vs full {_fmt(worst['vs_full'], unit)}"
                + "; the others: " + ", ".join(f"{r['label']} {_fmt(r['vs_full'], unit)}" for r in singles[1:]))
        overlap = [r["label"] for r in singles[1:] if _overlaps(worst["vs_full"], r["vs_full"])]
        if overlap:
            line += f" (its interval overlaps that of {', '.join(overlap)}: this n does not separate them)"
        out.append(line)
    for cache in CACHES:
        without = "+".join(c for c in CACHES if c != cache)
        if without in by and by[without]["vs_lazymar"]:
            out.append(f"removing the {cache} cache from lazymar ({without}) changes {metric} vs full by "
                       f"{_fmt(by[without]['vs_lazymar'], unit)} per image")
    return out


# ---- MARché selection ----------------------------------------------------------------------------------------
def marche_selection(model, config: CompareConfig, *, budgets=DEFAULT_BUDGETS, selections=SELECTIONS,
                     base_options=None, vae=None, progress: bool = True, partial=None, resume: bool = False,
                     ranks=None, command: str | None = None) -> CompareResult:
    """Run the :func:`selection_runs` arms and ``full`` with ``config``'s samples, seeds and sampling settings (its
    ``runs`` must be empty); pair every arm per image against ``attention@B`` of its budget.

    Every arm but the references gets ``paired`` (``{"against": "attention@B", METRIC: I, ...}`` over all images of
    all seeds, :func:`~mar_probe.compare.paired_difference`; plus the Fréchet distance or FID compared seed by seed
    with a quality judge). ``results["ablation"]``: ``{"kind": "marche-selection", "budgets", "selections",
    "reference": "attention", "metric", "rows": selection_summary(...), "notes"}``.
    """
    _only_full(config, "MARché selection ablation")
    runs = selection_runs(budgets, selections, base_options)
    result = _run(model, config, runs, None, vae=vae, progress=progress, partial=partial, resume=resume,
                  ranks=ranks, command=command)
    results, fid = result.results, per_image_fidelity(result)
    strategies = results["strategies"]
    for r in runs:
        opts = dict(r.options)
        ref = f"{REFERENCE_SELECTION}@{opts['budget']}"
        if r.label == ref:
            continue
        paired = paired_difference(fid[r.label], fid[ref], ref)
        paired.update({k: v for k, v in seed_paired_difference(
            strategies[r.label]["per_seed"], strategies[ref]["per_seed"], ref).items() if k != "against"})
        strategies[r.label]["paired"] = paired
    budgets = sorted({dict(r.options)["budget"] for r in runs})
    rules = list(dict.fromkeys(dict(r.options)["selection"] for r in runs))
    results["ablation"] = {"kind": "marche-selection", "budgets": budgets, "selections": rules,
                           "reference": REFERENCE_SELECTION, "metric": _metric(results),
                           "rows": selection_summary(results), "notes": _notes(config)}
    return result


def selection_summary(results: dict, metric: str | None = None) -> list[dict]:
    """One row per MARché arm, budget by budget: ``label``, ``budget``, ``selection``, ``against`` (its reference,
    None for the references themselves), ``speedup_flops``,
    ``vs_full`` (``metric`` against full, ``I``) and ``vs_attention`` (paired per-image difference against
    ``attention@budget``, ``I``; None for the reference)."""
    metric = metric or _metric(results)
    rows = []
    for label, e in results["strategies"].items():
        if e["config"].get("name") != "marche":
            continue
        rows.append({"label": label, "budget": e["config"]["budget"], "selection": e["config"]["selection"],
                     "against": (e.get("paired") or {}).get("against"),
                     "speedup_flops": _i(e["speedup"]["flops"]), "metric": metric,
                     "vs_full": _i(e["fidelity"].get(metric)),
                     "vs_attention": _i((e.get("paired") or {}).get(metric))})
    return rows


# ---- per-image fidelity and worst images ---------------------------------------------------------------------
def per_image_fidelity(result: CompareResult) -> dict:
    """Per label, the per-seed :func:`~mar_probe.quality.paired.paired_fidelity` against ``full`` (what
    :func:`compare` judged; recomputed from the runs, which compare does not return)."""
    full = result.runs["full"]
    return {label: [paired_fidelity(s.tokens, f.tokens, s.images, f.images) for s, f in zip(seeds, full)]
            for label, seeds in result.runs.items()}


def worst_images(result: CompareResult, k: int = DEFAULT_WORST, fid: dict | None = None) -> dict:
    """Per arm (not ``full``), its ``k`` images with the lowest PSNR against ``full`` over all seeds, lowest first
    (``fid``: :func:`per_image_fidelity` when already computed; else the PSNR alone is computed):
    ``{label: [{"seed", "index", "class_label", "psnr", "image", "full"}, ...]}`` (``image``/``full`` uint8
    [H, W, C]). Empty when the runs have no images."""
    from .quality.paired import psnr
    k = _check_count("worst", k)
    if result.runs["full"][0].images is None:
        return {}
    full = result.runs["full"]
    out = {}
    for label, seeds in result.runs.items():
        if label == "full":
            continue
        values = [d["psnr"].values for d in fid[label]] if fid is not None else \
            [psnr(s.images, f.images) for s, f in zip(seeds, full)]
        cand = [(float(v), si, i) for si, vs in enumerate(values) for i, v in enumerate(vs)]
        cand.sort(key=lambda c: (c[0], c[1], c[2]))            # ties: the earlier seed and image first
        out[label] = [{"seed": seeds[si].seed, "index": i, "class_label": int(seeds[si].labels[i]), "psnr": v,
                       "image": seeds[si].images[i], "full": full[si].images[i]} for v, si, i in cand[:k]]
    return out


# ---- writing -------------------------------------------------------------------------------------------------
def write_ablation(result: CompareResult, out, worst: int = DEFAULT_WORST) -> Path:
    """:func:`~mar_probe.compare.write_results` plus ``ablation.csv`` (the summary rows), the figure
    (``attribution.png`` or ``selection.png``) and ``worst.png``/``worst.csv`` (``worst`` images per arm; 0: none).
    """
    import pandas as pd

    from .plot.ablation import attribution_plot, save_worst_images, selection_plot
    kind = result.results.get("ablation", {}).get("kind")
    if kind not in ("lazymar-attribution", "marche-selection"):
        raise ValueError(f"not an ablation result (results['ablation']['kind'] is {kind!r}); expected "
                         "lazymar_attribution's or marche_selection's")
    out = write_results(result, out)
    ab = result.results["ablation"]
    pd.DataFrame([_flat(r) for r in ab["rows"]]).to_csv(out / "ablation.csv", index=False)
    plot = attribution_plot if kind == "lazymar-attribution" else selection_plot
    fig = plot(ab["rows"]).figure
    fig.savefig(out / ("attribution.png" if kind == "lazymar-attribution" else "selection.png"), dpi=120)
    _close(fig)
    if worst:
        chosen = worst_images(result, worst)
        if chosen:
            save_worst_images(chosen, out / "worst.png")
            pd.DataFrame([{"label": lab, "rank": n, **{k: v for k, v in w.items() if k not in ("image", "full")}}
                          for lab, ws in chosen.items() for n, w in enumerate(ws)]).to_csv(out / "worst.csv",
                                                                                             index=False)
    (out / "results.json").write_text(json.dumps(result.results, indent=2, default=_json_default))
    return out


def _flat(row: dict) -> dict:
    """A summary row as CSV columns: ``KEY``, ``KEY_lo``, ``KEY_hi``, ``KEY_n``, ``KEY_clipped`` per interval."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, dict) and "mean" in value:
            flat.update({key: value["mean"], f"{key}_lo": value["lo"], f"{key}_hi": value["hi"],
                         f"{key}_n": value["n"], f"{key}_clipped": value["clipped"]})
        elif isinstance(value, dict) and "estimate" in value:
            flat.update({key: value["estimate"], f"{key}_lo": value["low"], f"{key}_hi": value["high"],
                         f"{key}_n": value["n"], f"{key}_clipped": value["clipped"]})
        elif isinstance(value, list):
            flat[key] = "+".join(map(str, value))
        else:
            flat[key] = value
    return flat


def _close(fig) -> None:
    import matplotlib.pyplot as plt
    plt.close(fig)


def format_summary(results: dict) -> str:
    """The ablation's summary as Markdown: one row per arm (metric vs full, paired difference vs the reference,
    FLOP speed-up), then the verdict sentences of an attribution."""
    ab = results["ablation"]
    ref_key = "vs_lazymar" if ab["kind"] == "lazymar-attribution" else "vs_attention"
    ref = "lazymar" if ab["kind"] == "lazymar-attribution" else "attention@budget"
    metric = ab["metric"]
    lines = [f"| arm | FLOP speed-up (end to end) | {metric} vs full | {metric} minus {ref} (paired) |",
             "|---|---:|---:|---:|"]
    for r in ab["rows"]:
        lines.append(f"| {r['label']} | {_fmt(r['speedup_flops'])} | {_fmt(r['vs_full'])} | {_fmt(r[ref_key])} |")
    if any("*" in line for line in lines[2:]):
        from .compare import CLIPPED_NOTE
        lines += ["", CLIPPED_NOTE]
    lines += [f"* {v}" for v in ab.get("verdict", [])]
    lines += [f"note: {n}" for n in ab.get("notes", [])]
    return "\n".join(lines)


__all__ = ["CACHES", "SELECTIONS", "attribution_summary", "attribution_verdict", "format_summary", "head_step_count",
           "lazymar_attribution", "lazymar_attribution_runs", "marche_selection", "per_image_fidelity",
           "scaled_head_interval", "selection_runs", "selection_summary", "worst_images", "write_ablation"]
