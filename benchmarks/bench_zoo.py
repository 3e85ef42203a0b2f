"""The zoo benchmark (issue 17, item 4): every strategy and the best compositions in one run, speed and fidelity.

Arms: every registered strategy with its defaults (``mar_probe.strategies.available()``, read when the script runs),
the fair reference ``full-b`` (``full`` with only the head's batched modulation: ``lazymar token_cache=false
condition_cache=false refresh_interval=1 head_interval=1 head_batch_modulation=true``, as bench_strategies' batched
run defines it, see docs/strategies.md), ``lazymar-b`` (``lazymar head_batch_modulation=true``, the fastest run of
``strategies_vm_batched``), the compositions ``compose-bw-h5`` (docs/judging.md) and the candidates that
``bench_compose.py`` named (read from ``--rank``, default ``benchmarks/results/compose_rank.json``: ``rank.best``, and
``rank.best_paired_only`` when it is another one), and any ``--strategies LABEL=NAME`` / ``--strategy-opt`` extras.

1. **Speed on ``mar_base``** (random weights, batch 1, 64 steps, CFG 3.0, 100 head steps; bench_strategies'
   ``run_rounds``, ``summarise`` and ``ratios``): every arm once per round, interleaved in one process (odd rounds
   reversed); per part (end to end, transformer, encoder, decoder, head) the time ratio of each round, ``full``'s
   seconds of that round over the arm's, and the FLOP ratio. Over ``full-b`` every ratio is the ratio over
   ``full`` divided by ``full-b``'s ratio over ``full`` (the same round for times), so both columns come from the
   same runs. The headline is the median of the per-round ratios (absolute seconds here are noisy; a ratio within a
   round is not).
2. **Fidelity on the embedded default** (:func:`mar_probe.compare.compare` with the same arms, ``--num-samples``
   images x ``--seeds``, ``--fidelity-iter`` steps, the model's CFG and temperature): per-image PSNR, SSIM and
   token MSE against ``full``, their per-image differences against ``lazymar`` (``paired_against``), and the
   Fréchet distance compared seed by seed against ``full`` and against ``lazymar`` (``quality_vs_full``,
   ``paired``), with 95% t-intervals, clipped and flagged as compare does.
3. **The goal** of issue 17, from these numbers (:func:`goal_verdict`): an arm meets it when its median end-to-end
   time ratio over ``full`` is >= 5 and over ``full-b`` >= 3 on ``mar_base`` and the lower end of the 95% interval
   of its per-image PSNR difference against ``lazymar`` is >= 0 (fidelity at least lazymar's; ``fidelity_not_worse``
   records the weaker reading, the upper end >= 0, beside it).

Results: ``benchmarks/results/zoo.{json,md,png}`` (``zoo_quick.*`` with ``--quick``) with the machine, the load
average before and after, the command and the SHA-256 of both models' weights. The figure: x the end-to-end speed-up
over ``full`` (filled) and over ``full-b`` (hollow, same arm on the same row), y the paired PSNR against ``full`` with
its interval; lazymar's interval as a band and the goal's speed-ups as lines.

Commands (the full-size run is hours on a CPU; the committed result ran in parts over several sessions, as below):

    # a GPU machine: both parts on the GPU (CUDA-synchronised component times)
    python benchmarks/bench_zoo.py --device cuda
    # this 2-core CPU: compare's finished (arm, seed) runs kept, so that a stopped run resumes (add --resume)
    python benchmarks/bench_zoo.py --threads 2 --partial runs/zoo_partial
    # the same in two sessions: the speed part (benchmarks/results/zoo_speed.json, rewritten after every round, so a
    # stopped run keeps its finished rounds), then the fidelity part, which reads it and writes zoo.{json,md,png}
    python benchmarks/bench_zoo.py --part speed --threads 1
    python benchmarks/bench_zoo.py --part fidelity --threads 2 --partial runs/zoo_partial
    # more speed rounds later: --resume keeps the speed file's rounds and measures up to --rounds; arms the file
    # lacks (a strategy registered since, an extra) are added in rounds of their own beside full and full-b, whose
    # seconds there give their ratios (marked in the table), the first rounds kept as they were
    python benchmarks/bench_zoo.py --part speed --threads 1 --resume
    # the fidelity part over 2 processes (torchrun, one thread each): the (seed, arm) runs are spread over the
    # ranks (run k of the seed-major list on rank k mod 2), the finished runs kept in the same --partial folder,
    # and rank 0 writes the gathered result; a single process and torchrun resume each other's folder
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_zoo.py --part fidelity --threads 1 \
        --partial runs/zoo_partial --resume
    # smoke run (the test's): perturbed mar_tiny for both parts, 2 images x seeds 0,1, 4 steps, 1 round (~6 s)
    OMP_NUM_THREADS=1 python benchmarks/bench_zoo.py --quick --threads 1 --out /tmp/zoo

Wall time, estimated (not measured). The run is ``arms x rounds`` sampling runs on ``mar_base`` plus ``arms x
seeds`` compare runs of 70 images on the embedded default, 15 arms by default; ``--quick`` makes the same runs on
tiny models (15 x 1 + 15 x 2, ~6 s here), so its time says nothing about the real one, which is scaled from the
committed timings on this CPU instead:

* speed, one round (seconds per arm, batch 1, 64 steps, from ``strategies_vm.json`` and ``strategies_vm_batched.json``):
  ``full`` 224-244, ``full-b`` 133, ``lazymar`` 90, ``lazymar-b`` 51, ``compose-bw-h5`` 61, ``marche+cc/h7b`` (=
  ``compose-b``) 56, ``marche`` 202, ``fewer-steps`` 108, ``compose`` 96; never timed on ``mar_base``, scaled from
  ``full``'s split (transformer 81 s, head 163 s at 100 head steps): ``disa`` ~125 (the head at ~27 of 100 reverse
  steps on average), the DiSA candidate ~80, ``recap`` ~160, the MARché variants ~200-250. About 2,100 s, so 2
  rounds ~70 min.
* fidelity, one seed of 70 images at 64 steps (``compare_fashion_70x3``: ``full`` 176-203 s, ``lazymar`` 72-85,
  ``marche`` 145-157, ``fewer-steps`` 99, ``compose-b`` 86-93, the oracle 156; the rest scaled as above): about
  1,750 s per seed, so 3 seeds ~90 min.
* in all ~2.7 h on the idle machine, 2.5-3.5 h with load. Measured since: one speed round at ONE thread beside
  training on the other core took more than twice the estimate (``seconds`` in ``zoo_speed.json``; ``full`` about twice
  its 2-thread time), so at one thread plan a session per speed round. On a GPU the same runs are seconds each:
  minutes in all (not measured: no GPU was available when this was written).
* measured since on ``fashion_b128`` (the default since issue 14; the ``seconds`` of each (arm, seed) run, in
  ``zoo.json``'s fidelity part under ``per_seed``, 2026-12-07, two torchrun ranks of one thread side by side, the
  test suite beside them for the first hour): one seed of 70 images takes ~2.5 hours of one core, ``full`` ~1,150 s,
  ``disa`` ~1,015 (this model spends its time in the transformer, not the head), ``full-b`` ~795, ``fewer-steps``
  ~655, ``compose`` ~625, ``recap`` ~610, ``marche`` ~540, ``marche-adaptive`` ~530, ``marche-drift`` ~430,
  ``lazymar`` ~345, ``compose-bw-h5`` ~350, ``lazymar-b`` ~285, and ``marche-oracle`` ~675 in its own count but
  ~1,280 between its files (its reference pass is not counted). So the 3 seeds are ~4 hours on the 2 cores: two
  sessions here, the finished runs kept between them in a committed ``--partial`` folder
  (``benchmarks/results/zoo_b128_partial/``, resumed with ``--resume`` and removed once ``zoo.json`` was written
  from it; git history keeps it).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import bench_strategies as BS
from common import RESULTS, bench_parser, machine
from mar_probe import create_model, load_model, sample, strategies
from mar_probe.engine import RNG_MODES
from mar_probe.compare import CompareConfig, StrategyRun, _json_default, compare, parse_runs
from mar_probe.launch import Ranks, process_group
from mar_probe.models.checkpoints import create_perturbed_model, resolve_device
from mar_probe.probe.record import weights_sha256
from mar_probe.quality.paired import PSNR_IDENTICAL
from mar_probe.strategies import Timer
from mar_probe.strategies.head_schedule import HEAD_SCHEDULES

PARTS = ("end_to_end", "transformer", "encoder", "decoder", "head")
REFERENCE, AGAINST = "full-b", "lazymar"
GOAL = {"over_full": 5.0, "over_full_b": 3.0, "against": AGAINST}
# the references and compositions beside the registry, as bench_strategies' command line takes them
FIXED_ARMS = "full-b=lazymar,lazymar-b=lazymar,compose-bw-h5=compose"
FIXED_OPTS = ("full-b.token_cache=false", "full-b.condition_cache=false", "full-b.refresh_interval=1",
              "full-b.head_interval=1", "full-b.head_batch_modulation=true",
              "lazymar-b.head_batch_modulation=true",
              "compose-bw-h5.head_batch_modulation=true", "compose-bw-h5.condition_warmup=5",
              "compose-bw-h5.head_interval=5")
RANK_FILE = RESULTS / "compose_rank.json"
ROLES = ("registry", "reference", "variant", "composition", "extra")
# the speed part (hours on mar_base on a CPU) and the fidelity part can run in different sessions: the speed file
# keeps every finished round (issue 17: nothing lost on interruption)
PART_CHOICES = ("all", "speed", "fidelity")


# ---- arms ------------------------------------------------------------------------------------------------------
def ranked_compositions(path) -> list[StrategyRun]:
    """The compositions bench_compose named in ``path`` (``rank.best``, then ``rank.best_paired_only`` when it
    differs), as ``compose`` runs labelled with bench_compose's names."""
    rank = json.loads(Path(path).read_text())["rank"]
    by_label = {r["composition"]: r["options"] for r in rank["ranking"]}
    names = [n for n in (rank.get("best"), rank.get("best_paired_only")) if n]
    return [StrategyRun(label=n, name="compose", options=tuple(by_label[n].items()))
            for n in dict.fromkeys(names)]


def zoo_arms(rank_path=RANK_FILE, extra: str = "", extra_opts=()) -> tuple[tuple[StrategyRun, ...], dict]:
    """Every arm (``full`` first, then the registry, the references, the compositions, the extras) and each arm's
    role by label."""
    registry = [StrategyRun(label=n, name=n) for n in strategies.available()]
    fixed = list(parse_runs(FIXED_ARMS, FIXED_OPTS))
    ranked = ranked_compositions(rank_path) if rank_path else []
    extras = list(parse_runs(extra, extra_opts)) if extra else []
    roles: dict = {}
    arms: list = []
    for run, role in ([(r, "registry") for r in registry] + [(fixed[0], "reference"), (fixed[1], "variant")]
                      + [(r, "composition") for r in fixed[2:] + ranked] + [(r, "extra") for r in extras]):
        if run.label in roles:
            raise ValueError(f"arm label {run.label!r} given twice (registry, references, compositions or "
                             f"--strategies); expected unique labels")
        roles[run.label] = role
        arms.append(run)
    arms.sort(key=lambda r: r.label != "full")                           # full first (the reference of both parts)
    return tuple(arms), roles


# ---- speed -----------------------------------------------------------------------------------------------------
def _spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_round": values}


def speed_table(results: dict) -> dict:
    """bench_strategies' summaries (after ``ratios``) -> per arm and part the time ratio of every round over
    ``full`` and over ``full-b`` (= over full / full-b's over full, round by round) with median, min and max, and
    the FLOP ratios over both."""
    fb = results[REFERENCE]
    out = {}
    for label, row in results.items():
        over_full = {p: row["speedup_per_round"][p] for p in PARTS}
        over_fb = {p: [r / b for r, b in zip(over_full[p], fb["speedup_per_round"][p])] for p in PARTS}
        out[label] = {
            "steps": row["steps"], "seconds_per_round": {p: row["seconds_per_round"][p] for p in PARTS},
            "flops": {p: row["flops"][p] for p in PARTS},
            "over_full": {p: _spread(v) for p, v in over_full.items()},
            "over_full_b": {p: _spread(v) for p, v in over_fb.items()},
            "flop_ratio_over_full": {p: row["flop_ratio"][p] for p in PARTS},
            "flop_ratio_over_full_b": {p: row["flop_ratio"][p] / fb["flop_ratio"][p] for p in PARTS}}
    return out


SPEED_SETTINGS = ("preset", "batch", "num_iter", "cfg", "num_sampling_steps", "seed", "rounds", "clock", "threads",
                  "device")


def arm_record(run: StrategyRun) -> dict:
    """An arm as the speed file records it (label, strategy, options), to check that a later fidelity part
    measures the same arms."""
    return {"label": run.label, "name": run.name, "options": dict(run.options)}


def speed_result(model, runs: dict, started: float, before: dict) -> dict:
    """The speed part from the runs of the finished rounds: model, ratios (:func:`speed_table`), rounds done,
    seconds and the load average before and now."""
    results = {label: BS.summarise(r) for label, r in runs.items()}
    BS.ratios(results)
    return {"model": model.config.name, "weights_sha256": weights_sha256(model), "table": speed_table(results),
            "rounds_done": len(runs["full"]), "seconds": time.time() - started,
            "load": {"before": before, "after": BS.load_average()}, "runs": runs}


def measure_speed(model, arms, args, on_round=None, previous: dict | None = None) -> dict:
    """bench_strategies' rounds over every arm on ``model`` (:func:`speed_model`: ``args.preset`` with random
    weights; ``--quick``: a perturbed mar_tiny) and the ratios of :func:`speed_table`; ``on_round(result)`` after
    every finished round. With ``previous`` (a speed file of the same arms, settings and weights, ``--resume``) its
    rounds are kept and the next ones measured; its seconds and first load average carry over."""
    started, before, runs = time.time(), BS.load_average(), None
    if previous is not None:
        started, before, runs = started - previous["seconds"], previous["load"]["before"], previous["runs"]
    sample(model, [0], num_iter=2, cfg=args.cfg, seed=0)                # warm-up (allocator, kernels)
    report = None if on_round is None else (lambda runs: on_round(speed_result(model, runs, started, before)))
    runs = BS.run_rounds(model, arms, args, on_round=report, runs=runs)
    return speed_result(model, runs, started, before)


def speed_group(arms, args, command: str, result: dict) -> dict:
    """One measurement of the speed part (its rounds interleave these arms): the machine, command, settings, arms
    and the result with every round's raw runs."""
    return {"machine": machine(), "command": command, "arms": [arm_record(r) for r in arms],
            "settings": {k: getattr(args, k) for k in SPEED_SETTINGS}, **result}


def write_speed(path: Path, arms, args, command: str, result: dict, added: list | None = None) -> None:
    """The speed part on its own (``--part speed``; rewritten after every round, so that a stopped run keeps its
    finished rounds): the first measurement (:func:`speed_group`) and, under ``added``, the groups measured later
    for arms it lacks (:func:`add_arms`)."""
    payload = speed_group(arms, args, command, result)
    _write_json(path, dict(payload, added=added) if added else payload)


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_json_default))
    tmp.replace(path)                                                   # never a half-written file


def speed_groups(data: dict) -> list[dict]:
    """The speed file's measurements: the first, then the added groups."""
    return [data] + list(data.get("added", []))


def measured_arms(data: dict) -> dict[str, tuple[dict, int]]:
    """Per label the arm record and the index of the group whose rounds give its ratios (0: the first; the
    references ``full`` and ``full-b`` of every group are the first group's)."""
    out: dict = {}
    for k, group in enumerate(speed_groups(data)):
        for record in group["arms"]:
            out.setdefault(record["label"], (record, k))
    return out


def arm_differences(data: dict, arms) -> tuple[list, list, list]:
    """Labels of ``arms`` the speed file measured with other options (changed), did not measure (missing), and
    labels it measured that are not among ``arms`` (extra)."""
    have, want = measured_arms(data), [arm_record(r) for r in arms]
    changed = [a["label"] for a in want if a["label"] in have and have[a["label"]][0] != a]
    missing = [a["label"] for a in want if a["label"] not in have]
    extra = [label for label in have if label not in {a["label"] for a in want}]
    return changed, missing, extra


def _load_speed(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"speed file {str(path)!r} not found; expected the output of --part speed")
    return json.loads(path.read_text())


def _check_rounds(path: Path, data: dict) -> None:
    for k, group in enumerate(speed_groups(data)):
        if group.get("rounds_done", 0) < 1:
            raise ValueError(f"speed file {str(path)!r} has no finished round (rounds_done="
                             f"{group.get('rounds_done')!r}{f' in added group {k}' if k else ''}); expected >= 1")


def read_speed(path: Path, arms) -> dict:
    """A speed file written by ``--part speed`` for these arms, its added groups' rows merged into ``table``
    (each arm's ratios from the rounds it ran in), or ValueError naming what differs."""
    data = _load_speed(path)
    changed, missing, extra = arm_differences(data, arms)
    if changed or missing or extra:
        raise ValueError(f"speed file {str(path)!r} measured other arms: missing or changed {changed + missing!r}, "
                         f"not asked for {extra!r}; rerun --part speed with the same arms (arms it lacks, none "
                         f"changed: add them with --part speed --resume)")
    _check_rounds(path, data)
    groups, table = speed_groups(data), dict(data["table"])
    for label, (_, k) in measured_arms(data).items():
        if k:                                                           # an arm of an added group
            table[label] = groups[k]["table"][label]
    return {**data, "table": table}


def perturbed_tiny(seed: int = 1, scale: float = 0.05, **overrides):
    """mar_tiny with seeded noise on every parameter (``create_perturbed_model``, as the tests build theirs)."""
    return create_perturbed_model("mar_tiny", seed=seed, scale=scale, **overrides)


QUICK_TINY = dict(encoder_depth=4, decoder_depth=5, diffloss_d=5)       # deep enough for every cache


def speed_model(args):
    if args.quick:
        return perturbed_tiny(num_sampling_steps=args.num_sampling_steps, **QUICK_TINY)
    torch.manual_seed(0)
    return create_model(args.preset, num_sampling_steps=args.num_sampling_steps)


def fidelity_model(args, device):
    """The embedded default, or with ``--quick`` a perturbed mar_tiny at 28x28 (the Fréchet judge's size)."""
    if args.quick:
        return perturbed_tiny(num_sampling_steps=args.num_sampling_steps, img_size=28, crop_size=28,
                              **QUICK_TINY).to(device)
    return load_model(device=device)


# ---- fidelity --------------------------------------------------------------------------------------------------
def measure_fidelity(arms, args, device, command: str, ranks: Ranks | None = None) -> dict:
    """:func:`mar_probe.compare.compare` over every arm, paired against full and against lazymar; under torchrun
    (``ranks``) the (seed, arm) runs are spread over the ranks and every rank returns the gathered result."""
    model = fidelity_model(args, device).eval()
    config = CompareConfig(runs=arms, num_samples=args.num_samples, seeds=tuple(args.seeds),
                           num_iter=args.fidelity_iter, batch_size=min(args.num_samples, args.fidelity_batch),
                           grid_images=0, paired_against=AGAINST, rng=args.rng)
    started = time.time()
    # spread="runs": the (seed, arm) jobs, not whole seeds, go round the ranks, since 3 seeds on 2 ranks left one
    # idle a third of the run (issue 17); the zoo's speed comes from its speed part, not from these runs' seconds
    result = compare(model, config, progress=args.progress and (ranks is None or ranks.rank == 0),
                     partial=args.partial, resume=args.resume, ranks=ranks, spread="runs", command=command)
    return {"results": result.results, "seconds": time.time() - started}


def measure_noise_free(arms, args, device) -> dict:
    """Optional (``--noise-free``): bench_compose's noise-free protocol over every arm (temperature 0, the head's
    initial noise from a generator of its own, so that arms with a head-step schedule are judged on their
    approximation, not on new samples): PSNR and token MSE against full, and image by image against lazymar."""
    from bench_compose import _row, noise_free
    from mar_probe.quality.paired import paired_fidelity
    model = fidelity_model(args, device).eval()
    labels = CompareConfig(runs=arms, num_samples=args.num_samples).label_array(model.num_classes)
    started = time.time()
    runs = {r.label: [noise_free(model, r.create(), labels, seed, args.fidelity_iter) for seed in args.seeds]
            for r in arms}
    fid = {label: [paired_fidelity(t, f[0], i, f[1]) for (t, i), f in zip(per_seed, runs["full"])]
           for label, per_seed in runs.items()}
    rows = {label: _row(f, None if label in ("full", AGAINST) else fid[AGAINST]) for label, f in fid.items()}
    return {"rows": rows, "seconds": time.time() - started}


_KEEP = ("mean", "lo", "hi", "n", "clipped")


def _pick(d: dict | None) -> dict | None:
    return None if d is None else {k: d.get(k) for k in _KEEP}


def fidelity_row(label: str, entry: dict, free: dict | None = None) -> dict:
    """One arm's fidelity from compare's entry: against full per image (PSNR, SSIM, token MSE), the per-image
    PSNR and token-MSE differences against lazymar (exactly 0 for lazymar itself), the Fréchet distance and its
    seed-by-seed differences against full and against lazymar."""
    fid, quality = entry["fidelity"], entry.get("quality", {})
    paired = entry.get("paired")
    if label == AGAINST:                                    # the reference itself: every difference is 0
        zero = {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": fid["psnr"]["n"], "clipped": False}
        paired = {"psnr": zero, "token_mse": zero, "frechet_distance": zero if "frechet_distance" in quality
                  else None}
    paired = paired or {}
    return {"psnr": _pick(fid.get("psnr")), "ssim": _pick(fid.get("ssim")), "token_mse": _pick(fid.get("token_mse")),
            "psnr_vs_lazymar": _pick(paired.get("psnr")), "token_mse_vs_lazymar": _pick(paired.get("token_mse")),
            "frechet_distance": _pick(quality.get("frechet_distance")),
            "frechet_vs_full": _pick(entry.get("quality_vs_full", {}).get("frechet_distance")),
            "frechet_vs_lazymar": _pick(paired.get("frechet_distance")),
            "speedup_flops_embedded": _pick(entry["speedup"]["flops"]),
            "noise_free": None if free is None else {
                "psnr": free["psnr"], "psnr_vs_lazymar": free.get("vs_lazymar", {}).get("psnr", (
                    {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": free["psnr"]["n"]} if label == AGAINST else None))}}


# ---- the goal --------------------------------------------------------------------------------------------------
def goal_verdict(over_full: float | None, over_full_b: float | None, psnr_vs_lazymar: dict | None,
                 goal: dict = GOAL) -> dict:
    """Issue 17's goal for one arm: ``over_full >= goal['over_full']`` and ``over_full_b >= goal['over_full_b']``
    (end-to-end time ratios on mar_base) and the per-image PSNR difference against lazymar at least 0 at the lower
    end of its 95% interval (no interval: not shown, so not met). ``fidelity_not_worse`` (upper end >= 0) is the
    weaker reading, reported beside it, not part of ``meets``."""
    lo = None if psnr_vs_lazymar is None else psnr_vs_lazymar.get("lo")
    hi = None if psnr_vs_lazymar is None else psnr_vs_lazymar.get("hi")
    checks = {"over_full": over_full is not None and over_full >= goal["over_full"],
              "over_full_b": over_full_b is not None and over_full_b >= goal["over_full_b"],
              "fidelity": lo is not None and lo >= 0}
    return {"meets": all(checks.values()), "checks": checks, "fidelity_not_worse": hi is not None and hi >= 0,
            "values": {"over_full": over_full, "over_full_b": over_full_b, "psnr_vs_lazymar_lo": lo,
                       "psnr_vs_lazymar_hi": hi}}


def floor_check(fidelity: dict, rows: dict) -> dict | None:
    """Where the goal's fidelity reference lies against the unrelated-sample floor (compare's
    ``unrelated_floor``: full's images of each seed against the previous seed's): ``above`` when the lower end of
    ``lazymar``'s PSNR interval against full is above the floor's upper end. When it is not, "at least lazymar's
    fidelity" is met by images as unrelated to full's as another sample of the class, so the goal's fidelity check
    separates nothing on this model (the zoo on the shipped default, issue 14's model). None without a floor (one
    seed)."""
    floor = (fidelity["results"].get("unrelated_floor") or {}).get("psnr")
    ref = rows[AGAINST]["fidelity"]["psnr"] if AGAINST in rows else None
    if floor is None or floor.get("hi") is None or ref is None or ref.get("lo") is None:
        return None
    return {"floor_psnr": floor, "reference": AGAINST, "reference_psnr": ref, "above": ref["lo"] > floor["hi"]}


def floor_note(check: dict | None) -> str:
    """The sentence under the goal saying whether lazymar's fidelity is above the unrelated-sample floor."""
    if check is None:
        return ""
    f, r = check["floor_psnr"], check["reference_psnr"]
    text = (f"Unrelated-sample floor (`full`'s images of each seed against the previous seed's, the same labels): "
            f"PSNR {_iv(f, '{:.1f}')} dB; `{check['reference']}` against `full`: {_iv(r, '{:.1f}')} dB, ")
    if check["above"]:
        return text + "above the floor, so the goal's fidelity check compares images related to `full`'s."
    return text + ("**not above the floor**: its images are no closer to `full`'s than another sample of the "
                   "same class, so \"at least lazymar's fidelity\" admits any arm whose images are unrelated to "
                   "`full`'s and separates nothing on this model; read the Fréchet column (distribution quality) "
                   "for what such arms keep.")


def arm_median_seconds(row: dict) -> dict:
    """An arm's median seconds over rounds, per part (a row of :func:`combine`)."""
    return {p: statistics.median(v) for p, v in row["speed"]["seconds_per_round"].items()}


def goal_gap(rows: dict, goal: dict = GOAL) -> dict:
    """How far the zoo is from the goal, in seconds (a blocked goal is reported with the measurement that shows
    why): the end-to-end budgets the two speed-ups allow (``full``'s and ``full-b``'s median seconds over the
    goal's ratios) and the fastest arm by median end-to-end ratio over ``full`` among those not shown worse than
    ``lazymar`` (``fidelity_not_worse``, the weaker reading), with its median seconds per part (``None`` when no
    such arm ran); ``goal`` beside them, so that the sentence of :func:`gap_note` quotes the ratios it used."""
    kept = [k for k, r in rows.items() if k not in ("full", REFERENCE) and r["goal"]["fidelity_not_worse"]]
    fastest = max(kept, key=lambda k: rows[k]["speed"]["over_full"]["end_to_end"]["median"], default=None)
    full_s, reference_s = (arm_median_seconds(rows[k])["end_to_end"] for k in ("full", REFERENCE))
    return {"goal": goal, "budget_seconds": {"over_full": full_s / goal["over_full"],
                                             "over_full_b": reference_s / goal["over_full_b"]},
            "fastest_not_worse": None if fastest is None else {
                "label": fastest, "seconds": arm_median_seconds(rows[fastest]),
                "over_full": rows[fastest]["speed"]["over_full"]["end_to_end"]["median"],
                "over_full_b": rows[fastest]["speed"]["over_full_b"]["end_to_end"]["median"]}}


def gap_note(gap: dict) -> str:
    """The sentence of :func:`goal_gap`: the budgets in seconds and where the fastest arm at lazymar's fidelity
    spends its time."""
    g, b, f = gap["goal"], gap["budget_seconds"], gap["fastest_not_worse"]
    text = (f"In seconds (medians over rounds): the goal allows {b['over_full']:.3g} s end to end (`full` / "
            f"{g['over_full']:g}) and {b['over_full_b']:.3g} s (`{REFERENCE}` / {g['over_full_b']:g}).")
    if f is None:
        return text + f" No arm besides the references was shown no worse than `{AGAINST}`."
    s = f["seconds"]
    return text + (f" The fastest arm not shown worse than `{AGAINST}` (upper end of its interval >= 0), "
                   f"`{f['label']}`, took {s['end_to_end']:.3g} s ({f['over_full']:.2f}x / {f['over_full_b']:.2f}x): "
                   f"transformer {s['transformer']:.3g} s, head {s['head']:.3g} s; its transformer alone is "
                   f"{s['transformer'] / b['over_full']:.2f}x the first budget.")


def has_head_schedule(run: StrategyRun) -> bool:
    """Whether the arm's head steps follow a schedule (DiSA's: ``disa``, ``lazymar-disa``, ``compose`` with a
    ``head_schedule``), so that its paired images are new samples; asked of the strategy, not read from its name."""
    built = strategies.create(run.name, **dict(run.options))
    return isinstance(getattr(built, "schedule", None), tuple(HEAD_SCHEDULES.values()))


def combine(arms, roles: dict, speed: dict, fidelity: dict) -> dict:
    """One row per arm: its strategy and options, speed, fidelity and the goal verdict (on the paired protocol)."""
    table, entries = speed["table"], fidelity["results"]["strategies"]
    free = (fidelity.get("noise_free") or {}).get("rows", {})
    groups = {label: k for label, (_, k) in measured_arms(speed).items()}
    rows = {}
    for run in arms:
        sp, fi = table[run.label], fidelity_row(run.label, entries[run.label], free.get(run.label))
        rows[run.label] = {"strategy": run.name, "options": dict(run.options), "role": roles[run.label],
                           "head_schedule": has_head_schedule(run), "speed_group": groups[run.label],
                           "speed": sp, "fidelity": fi,
                           "goal": goal_verdict(sp["over_full"]["end_to_end"]["median"],
                                                sp["over_full_b"]["end_to_end"]["median"], fi["psnr_vs_lazymar"])}
    return rows


# ---- output ----------------------------------------------------------------------------------------------------
def _x(v, fmt="{:.2f}x") -> str:
    return "-" if v is None else fmt.format(v)


def _iv(d: dict | None, fmt: str = "{:.2f}") -> str:
    if d is None or d.get("mean") is None:
        return "-"
    star = "*" if d.get("clipped") else ""
    if d.get("lo") is None:
        return f"{fmt.format(d['mean'])} (n={d.get('n')})"
    return f"{fmt.format(d['mean'])} [{fmt.format(d['lo'])}, {fmt.format(d['hi'])}]{star}"


def _opts(row: dict) -> str:
    o = row["options"]
    return row["strategy"] + ("" if not o else " " + " ".join(f"{k}={v}" for k, v in o.items()))


def _load(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.2f}" for k in ("1min", "5min", "15min"))


def _separate_speed(payload: dict) -> str:
    """Where the speed part ran in another call (``--part speed``), which one, on what and under what load."""
    sp = payload["speed"]
    if sp.get("command") in (None, payload["command"]):
        return ""
    m, load = sp["machine"], sp["load"]
    return (f" The speed part ran on its own: `{sp['command']}` on {m['cpu']} ({m['cores']} cores, "
            f"{m['torch_threads']} torch threads), {m['date']}; load average before {_load(load['before'])}, "
            f"after {_load(load['after'])}; {sp['seconds']:.0f} s.")


def _added_speed(payload: dict) -> str:
    """The arms whose speed ran later in rounds of their own (``†`` in the table), and each group's run."""
    notes = []
    for group in payload["speed"].get("added", []):
        new = [a["label"] for a in group["arms"] if a["label"] not in ("full", REFERENCE)]
        m = group["machine"]
        notes.append(", ".join(f"`{k}`" for k in new) + f" (`{group['command']}`, {group['rounds_done']} "
                     f"round(s), {m['cpu']}, {m['torch_threads']} torch threads, {m['date']})")
    if not notes:
        return ""
    return (f" Arms marked † were added to the speed part later, in rounds of their own that interleave them with "
            f"`full` and `{REFERENCE}` (their ratios are over those rounds' `full` and `{REFERENCE}`): "
            + "; ".join(notes) + ".")


def _schedule_note(sched: list, rng: str, free: bool) -> str:
    """What the paired protocol means for arms with a head-step schedule under the fidelity part's rng mode."""
    arms = "Arms with a head-step schedule (" + ", ".join(f"`{k}`" for k in sched) + "): "
    if rng == "stepwise":
        return arms + ("the fidelity part samples with `rng=stepwise` (each step's head noise from generators of "
                       "its own), so every step starts from `full`'s initial noise and the paired protocol judges "
                       "their approximation.")
    return arms + ("the engine draws the head's noise from one stream, so their paired images are new samples and "
                   "the paired protocol judges them below lazymar by construction (docs/strategies.md, \"Ranking "
                   "the compositions\"; `--rng stepwise` pairs them)" +
                   ("; the noise-free column judges the approximation alone." if free else
                    "; `--noise-free` adds bench_compose's noise-free protocol."))


def speed_markdown(speed: dict) -> str:
    """The speed part alone (``--part speed``): end-to-end ratios over full and full-b per arm."""
    m, table = speed["machine"], speed["table"]
    lines = [f"Speed part on `{speed['model']}`, {speed['rounds_done']} round(s), {m['cpu']} "
             f"({m['torch_threads']} torch threads), {speed['seconds']:.0f} s "
             f"(end to end, median [min, max] over rounds):", "",
             "| arm | over `full` | over `full-b` | FLOPs over `full` |", "|---|---:|---:|---:|"]
    for label, row in table.items():
        a, b = row["over_full"]["end_to_end"], row["over_full_b"]["end_to_end"]
        lines.append(f"| `{label}` | {a['median']:.2f}x [{a['min']:.2f}, {a['max']:.2f}] | {b['median']:.2f}x "
                     f"[{b['min']:.2f}, {b['max']:.2f}] | {_x(row['flop_ratio_over_full']['end_to_end'])} |")
    return "\n".join(lines) + "\n"


def arm_table(rows: dict) -> str:
    """The zoo's main table: per arm the end-to-end time ratios over ``full`` and ``full-b`` (median [min, max] over
    rounds), FLOP ratios, the transformer's and head's time ratios, PSNR against ``full``, its difference to
    ``lazymar``, the Fréchet distance minus ``full``'s, and the goal (``docs/strategies.md`` shows the same)."""
    free = any(r["fidelity"].get("noise_free") for r in rows.values())
    lines = [
        "| arm | end to end over `full` | over `full-b` | FLOPs over `full` | over `full-b` | transformer | head "
        "| PSNR vs `full` dB | PSNR - `lazymar` dB | FD - `full` |" + (" noise-free PSNR - `lazymar` dB |" if free
                                                                    else "") + " goal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if free else "") + ":---:|"]
    for label, r in rows.items():
        sp, fi = r["speed"], r["fidelity"]
        e2e, e2eb = sp["over_full"]["end_to_end"], sp["over_full_b"]["end_to_end"]
        nf = f" {_iv((fi.get('noise_free') or {}).get('psnr_vs_lazymar'))} |" if free else ""
        lines.append(
            f"| `{label}`{' †' if r.get('speed_group') else ''} | {e2e['median']:.2f}x [{e2e['min']:.2f}, "
            f"{e2e['max']:.2f}] | "
            f"{e2eb['median']:.2f}x [{e2eb['min']:.2f}, {e2eb['max']:.2f}] | "
            f"{_x(sp['flop_ratio_over_full']['end_to_end'])} | {_x(sp['flop_ratio_over_full_b']['end_to_end'])} | "
            f"{sp['over_full']['transformer']['median']:.2f}x | {sp['over_full']['head']['median']:.2f}x | "
            f"{_iv(fi['psnr'], '{:.1f}')} | {_iv(fi['psnr_vs_lazymar'])} | {_iv(fi['frechet_vs_full'], '{:.1f}')} |"
            f"{nf} {'**yes**' if r['goal']['meets'] else 'no'} |")
    return "\n".join(lines)


def goal_text(rows: dict, speed_model: str) -> str:
    """The goal's verdict under the table: the arms that meet it, those fast enough but not shown at lazymar's
    fidelity, and, when none meets it, the gap in seconds (:func:`gap_note`)."""
    meets = [k for k, r in rows.items() if r["goal"]["meets"]]
    lines = [f"Goal (issue 17): end to end >= {GOAL['over_full']:g}x over `full` and >= {GOAL['over_full_b']:g}x "
             f"over `full-b` on `{speed_model}` (median over rounds), and the lower end of the "
             f"PSNR-difference interval against `{AGAINST}` >= 0. Arms that meet it: "
             + (", ".join(f"`{k}`" for k in meets) if meets else "none") + "."]
    near = [k for k, r in rows.items() if not r["goal"]["meets"] and r["goal"]["checks"]["over_full"]
            and r["goal"]["checks"]["over_full_b"]]
    if near:
        lines.append("Fast enough but not shown at lazymar's fidelity: " + ", ".join(f"`{k}`" for k in near) + ".")
    if not meets:
        lines.append(gap_note(goal_gap(rows)))
    return "\n".join(lines)


def markdown(payload: dict) -> str:
    s, m, rows = payload["settings"], payload["machine"], payload["arms"]
    lo, hi = payload["load"]["before"], payload["load"]["after"]
    fs = payload["fidelity"]["results"]["settings"]
    sha = payload["weights_sha256"]

    free = any(r["fidelity"].get("noise_free") for r in rows.values())
    lines = [
        f"# The zoo benchmark (issue 17, item 4){' — quick smoke run, not a result' if s['quick'] else ''}", "",
        f"Command: `{payload['command']}`", "",
        f"Machine: {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads, device {s['device']}), "
        f"{m['date']}; load average before {_load(lo)}, after {_load(hi)} (1/5/15 min); wall time "
        f"{payload['seconds']:.0f} s.", "",
        f"Speed: `{payload['speed']['model']}` (random weights{', perturbed' if s['quick'] else ''}, SHA-256 "
        f"`{sha['speed']}`), batch {s['batch']}, "
        f"{s['num_iter']} steps, CFG {s['cfg']}, {s['num_sampling_steps']} head steps, "
        f"{payload['speed']['rounds_done']} round(s), "
        f"arms interleaved (odd rounds reversed), {s['clock']} clock. Time ratios: the median over rounds of "
        f"`full`'s (or `full-b`'s) seconds in the same round over the arm's, [min, max] over rounds."
        + _separate_speed(payload) + _added_speed(payload), "",
        f"Fidelity: `{payload['fidelity']['results']['model']}` (SHA-256 `{sha['fidelity']}`), {fs['num_samples']} "
        f"images x seeds {fs['seeds']}, {fs['num_iter']} steps, CFG {fs['cfg']} ({fs['cfg_schedule']}), temperature "
        f"{fs['temperature']}, rng `{fs['rng']}`; PSNR against `full` image by image, its difference to "
        f"`lazymar`'s image by image, "
        f"Fréchet distance minus `full`'s seed by seed; 95% t-intervals (`*`: clipped to the metric's range).", "",
        arm_table(rows), "", goal_text(rows, payload["speed"]["model"])]
    if payload.get("floor") is not None:
        lines.append(floor_note(payload["floor"]))
    sched = [k for k, r in rows.items() if r.get("head_schedule")]
    if sched:
        lines.append(_schedule_note(sched, fs["rng"], free))
    lines += ["", "Per part (median time ratio over `full` / over `full-b`; FLOP ratio over `full`):", "",
              "| arm | " + " | ".join(PARTS) + " |", "|---|" + "---:|" * len(PARTS)]
    for label, r in rows.items():
        sp = r["speed"]
        lines.append(f"| `{label}` | " + " | ".join(
            f"{sp['over_full'][p]['median']:.2f}x / {sp['over_full_b'][p]['median']:.2f}x "
            f"({_x(sp['flop_ratio_over_full'][p])})" for p in PARTS) + " |")
    lines += ["", "Arms: " + "; ".join(f"`{k}` = {_opts(r)} ({r['role']})" for k, r in rows.items()) + "."]
    return "\n".join(lines) + "\n"


def place_labels(fig, texts) -> None:
    """Move labels (annotations in offset points) so that none overlaps another, deterministically: from the
    highest point down, each label keeps its place unless it overlaps one already placed, and then goes just below
    the lowest such one (or adjustText's ``adjust_text`` when it is installed)."""
    try:
        from adjustText import adjust_text
    except ImportError:
        adjust_text = None
    if adjust_text is not None and texts:
        adjust_text(texts, ax=texts[0].axes)
        return
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (-boxes[i].y1, boxes[i].x0, i))
    placed: list = []
    scale, gap = 72.0 / fig.dpi, 1.5                                    # pixels -> points; pixels between labels
    frame = texts[0].axes.bbox if texts else None

    def hits(box):
        return [b for b in placed if box.x0 < b.x1 + gap and b.x0 < box.x1 + gap
                and box.y0 < b.y1 + gap and b.y0 < box.y1 + gap]

    def stack(box, down: bool):
        while hit := hits(box):                                         # past the farthest label it meets
            box = box.translated(0, (min(b.y0 for b in hit) - gap - box.y1) if down
                                 else (max(b.y1 for b in hit) + gap - box.y0))
        return box

    for i in order:
        box = boxes[i]
        if box.y1 > frame.y1 - gap:                                     # inside the axes, top first
            box = box.translated(0, frame.y1 - gap - box.y1)
        if box.y0 < frame.y0 + gap:
            box = box.translated(0, frame.y0 + gap - box.y0)
        first = stack(box, down=True)
        box = first if first.y0 >= frame.y0 + gap else stack(box, down=False)
        if box.y0 != boxes[i].y0:
            dx, dy = texts[i].xyann
            texts[i].xyann = (dx, dy + (box.y0 - boxes[i].y0) * scale)
        placed.append(box)


def draw(payload: dict):
    """Speed-up over full (filled) and over full-b (hollow) against paired PSNR vs full; returns the Figure."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    rows = {k: r for k, r in payload["arms"].items() if k != "full"}
    colours = dict(zip(ROLES, ("tab:blue", "tab:gray", "tab:purple", "tab:red", "tab:green")))
    fig, ax = plt.subplots(figsize=(11, 6.5), layout="constrained")
    ys = {k: r["fidelity"]["psnr"] for k, r in rows.items() if r["fidelity"]["psnr"] is not None}
    finite = [v for d in ys.values() for v in (d["mean"], d["lo"], d["hi"]) if v is not None and v < PSNR_IDENTICAL]
    top = (max(finite) if finite else 40.0) + 3.0
    bottom = max(0.0, (min(finite) if finite else 0.0) - 3.0)
    lz = payload["arms"].get(AGAINST, {}).get("fidelity", {}).get("psnr")
    if lz and lz.get("lo") is not None:
        ax.axhspan(lz["lo"], lz["hi"], color="tab:orange", alpha=0.15, lw=0)
    floor = (payload.get("floor") or {}).get("floor_psnr")
    if floor is not None:
        ax.axhspan(floor["lo"], floor["hi"], color="0.5", alpha=0.25, lw=0)
        bottom = min(bottom, max(0.0, floor["lo"] - 3.0))
    ax.axvline(1.0, color="0.4", lw=0.8)
    ax.axvline(GOAL["over_full"], color="k", ls="--", lw=0.9)
    ax.axvline(GOAL["over_full_b"], color="k", ls=":", lw=0.9)
    texts, xmax = [], GOAL["over_full"]
    for label, r in rows.items():
        if label not in ys:
            continue
        d, sp = ys[label], r["speed"]
        capped = d["mean"] >= PSNR_IDENTICAL
        y = top - 1.0 if capped else d["mean"]
        yerr = None if capped or d["lo"] is None else [[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]]
        e, eb = sp["over_full"]["end_to_end"], sp["over_full_b"]["end_to_end"]
        c = colours[r["role"]]
        ax.plot([e["median"], eb["median"]], [y, y], color=c, lw=0.6, alpha=0.6)
        ax.errorbar([e["median"]], [y], yerr=yerr, xerr=[[e["median"] - e["min"]], [e["max"] - e["median"]]],
                    fmt="^" if capped else "o", color=c, ms=6, capsize=2, lw=1)
        ax.plot([eb["median"]], [y], marker="^" if capped else "o", mfc="white", mec=c, ls="none", ms=6)
        xmax = max(xmax, e["max"], eb["median"])
        texts.append((label + (" (= full)" if capped else ""), e["median"], y, c))
    right = xmax * 1.25 + 0.3
    ax.set_xlim(0, right)
    labels = []
    for text, x, y, c in texts:                                         # labels left of the points on the right
        left = x > 0.6 * right
        ann = ax.annotate(text, (x, y), xytext=(-6 if left else 6, 3), textcoords="offset points", fontsize=7.5,
                          color=c, ha="right" if left else "left", va="bottom",
                          bbox=dict(boxstyle="square,pad=0.05", fc="white", ec="none", alpha=0.75))
        ann.set_in_layout(False)
        labels.append(ann)
    ax.set_ylim(bottom, top)
    ax.set_xlabel(f"end-to-end speed-up on {payload['speed']['model']} (x, time ratio, median over rounds; "
                  f"bars: min-max over rounds)")
    ax.set_ylabel("paired PSNR against full (dB; bars: 95% interval)")
    s, fs, sp = payload["settings"], payload["fidelity"]["results"]["settings"], payload["speed"]
    ax.set_title(f"speed ({sp['model']}, {s['num_iter']} steps, {sp['rounds_done']} round(s)) vs fidelity "
                 f"({payload['fidelity']['results']['model']}, {fs['num_samples']} images x {len(fs['seeds'])} "
                 f"seeds)", fontsize="medium")
    handles = [Line2D([], [], marker="o", color="0.3", ls="none", label="over full"),
               Line2D([], [], marker="o", mfc="white", mec="0.3", ls="none", label="over full-b (same row)"),
               Line2D([], [], color="k", ls="--", lw=0.9, label=f"goal: {GOAL['over_full']:g}x over full"),
               Line2D([], [], color="k", ls=":", lw=0.9, label=f"goal: {GOAL['over_full_b']:g}x over full-b"),
               Line2D([], [], color="0.4", lw=0.8, label="full (1x; PSNR identical)"),
               Patch(color="tab:orange", alpha=0.3, label=f"{AGAINST}'s PSNR interval")]
    if floor is not None:
        handles.append(Patch(color="0.5", alpha=0.4, label="unrelated sample (full, next seed)"))
    handles += [Line2D([], [], marker="o", color=c, ls="none", label=f"{role} arm")
                for role, c in colours.items() if any(r["role"] == role for r in rows.values())]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small")
    fig.canvas.draw()
    start = [a.xyann for a in labels]
    place_labels(fig, labels)
    for a, (dx, dy) in zip(labels, start):                             # a thin line from a moved label to its point
        if a.xyann != (dx, dy):
            ax.annotate("", a.xy, xytext=(a.xyann[0], a.xyann[1] + (4 if a.xyann[1] < dy else 0)),
                        textcoords="offset points", arrowprops=dict(arrowstyle="-", lw=0.4, color="0.6",
                                                                    shrinkA=0, shrinkB=2)).set_in_layout(False)
    return fig


def lint(fig) -> list:
    """The figure lint's problems (``mar_probe.plot.lint``), or None when that module is absent."""
    try:
        from mar_probe.plot.lint import lint_figure
    except ImportError:
        return None
    return lint_figure(fig)


# ---- main ------------------------------------------------------------------------------------------------------
def _seeds(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser():
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, help="speed rounds over all arms (default 2; 1 with --quick)")
    p.add_argument("--clock", choices=sorted(BS.CLOCKS), default="wall")
    p.add_argument("--seed", type=int, default=0, help="seed of the speed runs")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="torch device of both parts: cpu, cuda or cuda:N")
    p.add_argument("--num-samples", type=int, default=70, help="fidelity images per seed (default 70)")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="fidelity seeds (default 0,1,2)")
    p.add_argument("--fidelity-iter", type=int, default=64, help="steps of the fidelity runs (default 64)")
    p.add_argument("--fidelity-batch", type=int, default=70, help="images per sampling batch (default 70)")
    p.add_argument("--rank", default=str(RANK_FILE),
                   help="bench_compose's result naming the compositions ('' for none; default compose_rank.json)")
    p.add_argument("--strategies", default="", help="extra arms, comma-separated LABEL=NAME")
    p.add_argument("--strategy-opt", action="append", default=[], metavar="LABEL.KEY=VALUE",
                   help="option of an extra arm, repeatable")
    p.add_argument("--part", choices=PART_CHOICES, default="all",
                   help="all (default): speed, then fidelity; speed: only the speed part, written to --speed-file "
                        "after every round; fidelity: only the fidelity part, with the speed part read from "
                        "--speed-file (the same arms), then the combined results")
    p.add_argument("--speed-file", help="the speed part's file (default: OUT/zoo_speed.json; zoo_quick_speed.json "
                                        "with --quick)")
    p.add_argument("--rng", choices=RNG_MODES, default="stepwise",
                   help="random-number layout of the fidelity part (default stepwise: each step's head noise from "
                        "its own generators, so that arms with a head-step schedule are paired with full's noise)")
    p.add_argument("--partial", help="folder keeping compare's finished (arm, seed) runs")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped run: the speed file's finished rounds (same arms and settings) and the "
                        "fidelity runs in --partial")
    p.add_argument("--noise-free", action="store_true",
                   help="also bench_compose's noise-free protocol (a second fidelity pass: as long again)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: perturbed mar_tiny for both parts, 4 steps, 5 head steps, 2 images x seeds 0,1, "
                        "1 round")
    p.add_argument("--out", help="output folder (default: benchmarks/results)")
    p.add_argument("--progress", action="store_true")
    return p


def checked_args(p, argv):
    """Parsed arguments with --quick's settings applied and every cross-argument rule checked (``p.error``)."""
    args = p.parse_args(argv)
    if args.quick:
        args.num_iter, args.num_sampling_steps, args.fidelity_iter = 4, "5", 4
        args.num_samples, args.seeds = 2, [0, 1]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds!r}")
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu needs --threads 1, got {args.threads!r}")
    if args.resume and not args.partial and args.part != "speed":
        p.error("--resume needs --partial FOLDER (the fidelity part's finished runs); with --part speed it "
                "continues the speed file's finished rounds")
    try:
        args.ranks = Ranks.from_env()
    except ValueError as exc:
        p.error(str(exc))
    # torchrun spreads the fidelity part's runs over processes; the speed part's ratios compare runs of one
    # process, and the noise-free protocol is not spread, so both are refused rather than run once per rank
    if args.ranks is not None and (args.part != "fidelity" or args.noise_free):
        p.error(f"under torchrun (WORLD_SIZE={args.ranks.world_size!r}) only --part fidelity without --noise-free "
                f"runs, got --part {args.part!r}{' --noise-free' if args.noise_free else ''}; run the speed part "
                f"as one process first")
    return args


def speed_part(p, arms, args, device, command: str, speed_file: Path) -> dict:
    """The speed part: read from ``speed_file`` (``--part fidelity``) or measured, the file rewritten after every
    round."""
    if args.part == "fidelity":
        try:
            return read_speed(speed_file, arms)
        except ValueError as exc:
            p.error(f"--part fidelity: {exc}")

    model = speed_model(args).to(device).eval()
    previous = resumed_speed(p, arms, args, speed_file, model) if args.resume else None
    first = arms if previous is None else _runs(previous["arms"])          # the first group keeps its own arms
    added = [] if previous is None else list(previous.get("added", []))
    if previous is None or previous["rounds_done"] < args.rounds:
        def save(result):
            write_speed(speed_file, first, args, command, result, added)
        measure_speed(model, first, args, on_round=save, previous=previous)
        previous = _load_speed(speed_file)
    while _unfinished_group(previous, args) or arm_differences(previous, arms)[1]:
        add_arms(model, arms, args, command, speed_file)
        previous = _load_speed(speed_file)
    return read_speed(speed_file, arms)


def _unfinished_group(data: dict, args) -> dict | None:
    """The last added group when it stopped before ``args.rounds`` rounds."""
    added = data.get("added", [])
    return added[-1] if added and added[-1]["rounds_done"] < args.rounds else None


def _runs(records) -> tuple[StrategyRun, ...]:
    return tuple(StrategyRun(label=a["label"], name=a["name"], options=tuple(a["options"].items())) for a in records)


def add_arms(model, arms, args, command: str, speed_file: Path) -> None:
    """Arms the speed file lacks (a strategy registered since, an extra), measured as a group of their own:
    ``args.rounds`` rounds interleaving them with ``full`` and ``full-b``, whose seconds in the same round give their
    ratios, as in the first group. A stopped group is continued; the first group's rounds are left as they were."""
    data = _load_speed(speed_file)
    added, previous = list(data.get("added", [])), _unfinished_group(data, args)
    if previous is not None:                                            # continued from its next round
        group = _runs(added.pop()["arms"])
    else:
        missing, by_label = set(arm_differences(data, arms)[1]), {r.label: r for r in arms}
        group = (by_label["full"], by_label[REFERENCE], *(r for r in arms if r.label in missing))
    print(f"adding {len(group) - 2} arm(s) to {str(speed_file)!r} beside full and {REFERENCE}: "
          + ", ".join(r.label for r in group[2:]), flush=True)

    def save(result):                                    # the first group and the earlier added ones as they were
        _write_json(speed_file, dict(data, added=added + [speed_group(group, args, command, result)]))
    measure_speed(model, group, args, on_round=save, previous=previous)


def resumed_speed(p, arms, args, speed_file: Path, model) -> dict | None:
    """The speed file to continue (``--resume``): None when there is none yet; ``p.error`` when it measured arms
    with other options or arms not asked for (arms it lacks are added: :func:`add_arms`), other settings (all of
    :data:`SPEED_SETTINGS` but ``rounds`` must agree, so that its rounds and the next ones are one measurement) or
    weights than ``model``'s."""
    if not speed_file.is_file():
        return None
    try:
        previous = _load_speed(speed_file)
        _check_rounds(speed_file, previous)
    except ValueError as exc:
        p.error(f"--resume: {exc}")
    changed, _, extra = arm_differences(previous, arms)
    if changed or extra:
        p.error(f"--resume: speed file {str(speed_file)!r} measured other arms: changed {changed!r}, not asked for "
                f"{extra!r}; rerun --part speed without --resume (only arms it lacks can be added)")
    differ = {k: (previous["settings"].get(k), getattr(args, k)) for k in SPEED_SETTINGS
              if k != "rounds" and previous["settings"].get(k) != getattr(args, k)}
    sha = weights_sha256(model)                                        # the same seeded random weights
    if previous["weights_sha256"] != sha:
        differ["weights_sha256"] = (previous["weights_sha256"], sha)
    if differ:
        p.error(f"--resume: the speed file {str(speed_file)!r} was measured with other settings: " + "; ".join(
            f"{k} {old!r} there, {new!r} now" for k, (old, new) in differ.items()))
    return previous


def zoo_payload(arms, roles, args, speed: dict, fidelity: dict, command: str, started: float, before: dict) -> dict:
    """Both parts, the rows of :func:`combine` and the arms that meet the goal, as zoo.json holds them."""
    settings = {k: getattr(args, k) for k in ("num_samples", "seeds", "fidelity_iter", "rng", "rank", "strategies",
                                              "strategy_opt", "noise_free", "quick")}
    payload = {"machine": machine(), "command": command, "settings": {**speed["settings"], **settings},
               "load": {"before": before, "after": BS.load_average()}, "seconds": time.time() - started,
               "goal": GOAL, "weights_sha256": {"speed": speed["weights_sha256"],
                                                "fidelity": fidelity["results"]["weights_sha256"]},
               "speed": dict({k: v for k, v in speed.items() if k not in ("table", "runs", "arms", "added")},
                             added=[{k: v for k, v in g.items() if k not in ("table", "runs")}
                                    for g in speed.get("added", [])]),
               "fidelity": fidelity, "arms": combine(arms, roles, speed, fidelity)}
    if args.quick:
        payload["settings"]["preset"] = speed["model"] + " (perturbed, quick)"
    payload["meets_goal"] = [k for k, r in payload["arms"].items() if r["goal"]["meets"]]
    payload["floor"] = floor_check(fidelity, payload["arms"])
    payload["gap"] = goal_gap(payload["arms"])
    return payload


def write_outputs(payload: dict, out: Path, stem: str) -> None:
    """zoo.json, zoo.md and zoo.png (the figure checked by the lint first)."""
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=_json_default))
    (out / f"{stem}.md").write_text(markdown(payload))
    fig = draw(payload)
    for problem in lint(fig) or ():
        warnings.warn(f"zoo figure: {problem}", stacklevel=1)
    fig.savefig(out / f"{stem}.png", dpi=100)
    plt.close(fig)


def main(argv=None):
    p = parser()
    args = checked_args(p, argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = args.ranks.device(args.device) if args.ranks is not None else resolve_device(args.device)
    except ValueError as exc:
        p.error(f"--device: {exc}")
    try:
        arms, roles = zoo_arms(args.rank or None, args.strategies, args.strategy_opt)
    except ValueError as exc:
        p.error(str(exc))
    Timer.clock = staticmethod(BS.CLOCKS[args.clock])
    launcher = (["python"] if args.ranks is None else
                ["torchrun", "--standalone", "--nproc_per_node", str(args.ranks.world_size)])
    command = " ".join(launcher + ["benchmarks/bench_zoo.py"] + argv)
    out = Path(args.out) if args.out else RESULTS
    stem = "zoo" + ("_quick" if args.quick else "")
    if args.ranks is None or args.ranks.rank == 0:
        print(f"{len(arms)} arms: " + ", ".join(r.label for r in arms), flush=True)
    started, before = time.time(), BS.load_average()
    speed = speed_part(p, arms, args, device, command, Path(args.speed_file or out / f"{stem}_speed.json"))
    if args.part == "speed":
        print(speed_markdown(speed))
        return speed
    with process_group(args.ranks, device):
        fidelity = measure_fidelity(arms, args, device, command, args.ranks)
    if args.ranks is not None and args.ranks.rank != 0:
        return None                                                     # rank 0 alone writes the gathered result
    if args.noise_free:
        fidelity["noise_free"] = measure_noise_free(arms, args, device)
    payload = zoo_payload(arms, roles, args, speed, fidelity, command, started, before)
    write_outputs(payload, out, stem)
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    main()
