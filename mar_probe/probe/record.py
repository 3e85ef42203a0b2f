"""``record``: sample with the probe attached and write every selected step into a run store.

Every sample gets its own seed, derived from (seed, sample index), and samples are grouped into fixed units
of ``batch_size`` consecutive selected samples; a unit is sampled with the seed of its first sample. The
data of a sample therefore depend only on the run's settings (batch size included), never on which shard
or which resumed process computes it, so ``resume`` and ``shard`` give arrays identical to one
uninterrupted run.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..api import check_labels, decode_images
from ..engine.sampling import SamplingConfig, head_steps_applied, sampling_config
from ..engine.loop import SampleRNG, Sampler
from ..store.reader import read_attrs
from .._io import describe_os_error, file_sha256
from ..store.schema import SCHEMA_VERSION, RunLayout, resolve
from ..launch import Ranks, check_shard, gather, on_rank0
from ..store.location import StoreLocation
from ..store.writer import (CREATING_ATTR, StoreExistsError, StoreWriter, WriteError, check_writer_settings,
                            compressors, create_store, read_flags)
from .probe import Probe
from ..store.spec import SelectionSpec

IDENTITY_KEYS = ("schema_version", "model_config", "weights_sha256", "sampling", "selection", "strategy",
                 "num_samples", "labels_sha256", "seed")


@dataclass
class RecordResult:
    """What :func:`record` did: store location, samples written and skipped, logical bytes and timings."""
    path: StoreLocation
    samples_written: int
    samples_skipped: int
    bytes_logical: int
    seconds: float
    writer_wait_s: float


def sample_seeds(seed: int, num_samples: int) -> np.ndarray:
    """The seed of every sample: ``SeedSequence([seed, i]).generate_state(1)[0]`` (uint32 as int64)."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return np.array([np.random.SeedSequence([int(seed), i]).generate_state(1)[0] for i in range(num_samples)],
                    dtype=np.int64)


def parse_shard(shard) -> tuple[int, int] | None:
    """``"I/N"`` or (I, N) -> (I, N) with 0 <= I < N; None stays None."""
    if shard is None:
        return None
    if isinstance(shard, str):
        i, sep, n = shard.partition("/")
        if not sep or not i.strip().isdigit() or not n.strip().isdigit():
            raise ValueError(f"shard must look like 'I/N' (e.g. '0/4'), got {shard!r}")
        shard = (int(i), int(n))
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard index must satisfy 0 <= I < N, got I={i!r}, N={n!r}")
    return int(i), int(n)


def weights_sha256(model) -> str:
    """SHA-256 over the model's state dict (names and raw bytes, in state-dict order)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _versions() -> dict:
    import xarray
    import zarr
    from .._version import __version__
    return {"mar_probe": __version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "xarray": xarray.__version__, "numpy": np.__version__, "python": platform.python_version()}


def run_attrs(model, spec: SelectionSpec, labels: np.ndarray, seed: int, sampling: dict, strategy,
              checkpoint=None) -> dict:
    """The root attributes of a run store (identity keys in :data:`IDENTITY_KEYS`)."""
    config = getattr(model, "config", None)
    versions = _versions()
    return {"schema_version": SCHEMA_VERSION, "mar_probe_version": versions["mar_probe"],
            "versions": json.dumps(versions), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "seed": int(seed), "model_preset": getattr(config, "name", type(model).__name__),
            "model_config": json.dumps(config.to_dict() if config is not None else {}, sort_keys=True),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "checkpoint_sha256": file_sha256(checkpoint) if checkpoint else None,
            "weights_sha256": weights_sha256(model), "sampling": json.dumps(sampling, sort_keys=True),
            "selection": json.dumps(spec.to_dict(), sort_keys=True),
            "strategy": json.dumps(strategy.to_dict(), sort_keys=True), "num_samples": int(len(labels)),
            "labels_sha256": hashlib.sha256(np.asarray(labels, dtype=np.int64).tobytes()).hexdigest(),
            "seed_derivation": "numpy SeedSequence([seed, sample]).generate_state(1)[0] of each unit's first sample"}


def check_identity(path, attrs: dict) -> None:
    """Raise when the store at ``path`` was written by another model, config or selection."""
    have = read_attrs(path)
    diff = [k for k in IDENTITY_KEYS if _norm(have.get(k)) != _norm(attrs.get(k))]
    if diff:
        details = "; ".join(f"{k}: store {_short(have.get(k))} vs now {_short(attrs.get(k))}" for k in diff)
        raise ValueError(f"store {str(path)!r} was written by another model or configuration, so it cannot be "
                         f"resumed or shared: {details}. Use --overwrite to replace it or another --out")


def _norm(v):
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 160 else text[:157] + "..."


def image_shape(model, vae=None) -> tuple[int, int, int] | None:
    """(height, width, channels) of decoded images, or None when the tokens cannot be decoded."""
    c = getattr(model, "config", None)
    if c is None:
        return None
    if c.tokenizer == "pixel":
        size = c.crop_size or c.img_size
        return (size, size, c.image_channels)
    return (c.img_size, c.img_size, 3) if vae is not None else None


def _units(layout: RunLayout, batch_size: int, shard) -> list[list[int]]:
    """Store rows grouped into fixed units of ``batch_size``; a shard takes every N-th unit."""
    rows = list(range(len(layout.samples)))
    units = [rows[k:k + batch_size] for k in range(0, len(rows), batch_size)]
    return units if shard is None else units[shard[0]::shard[1]]


def _prepare_store(out: StoreLocation, layout, attrs, labels, seeds, *, resume, overwrite, shard,
                   compression: str) -> None:
    """Create the store, or check that an existing one was written with the same settings."""
    if resume and overwrite:
        raise ValueError("give --resume or --overwrite, not both")
    if shard is not None and overwrite:
        raise ValueError("--overwrite cannot be combined with --shard (shards would delete each other's data); "
                         "remove the store first, or create it with one unsharded call")
    out.check_reachable()  # an unreachable endpoint or missing credentials: named before any sampling
    exists = out.exists()
    if exists and not out.is_local and _being_created(out, wait=shard is not None):
        if shard is not None:
            raise ValueError(f"store {str(out)!r} has been under creation for over {CREATION_WAIT_S:g} s (its "
                             "creator was killed?): run one process with --resume to recreate it, then the shards")
        if not resume:
            raise StoreExistsError(f"store {str(out)!r} is an unfinished creation; pass --resume to recreate it")
        out.remove()  # a creation killed half-way holds no data: start it again
        exists = False
    if exists and (resume or shard is not None):
        check_identity(out, attrs)
        return
    if resume:  # a run killed before its store was committed left none: resuming it means starting it
        print(f"store {str(out)!r} does not exist yet: starting it", file=sys.stderr)
    if exists and not overwrite:
        raise StoreExistsError(f"store {str(out)!r} already exists; pass --resume to complete it or --overwrite "
                              "to replace it")
    if out.is_local:
        _create_local(out.local_path, layout, attrs, labels, seeds, overwrite=overwrite, compression=compression)
    else:  # object stores have no rename: built in place under the creation marker (store/location.py)
        _create_remote(out, layout, attrs, labels, seeds, overwrite=overwrite, shard=shard, compression=compression)


def _create_remote(out: StoreLocation, layout, attrs, labels, seeds, *, overwrite, shard, compression) -> None:
    """Create a remote store in place; a shard that finds another process creating it waits and checks it."""
    import zarr.errors
    try:
        create_store(out, layout, labels=labels, seeds=seeds, attrs=attrs, overwrite=overwrite,
                     compression=compression)
    except (FileExistsError, zarr.errors.ContainsGroupError, zarr.errors.ContainsArrayError):  # zarr raises each
        if shard is None:
            raise
        if _being_created(out, wait=True):  # another shard's creation under way: wait for it, as locally
            raise ValueError(f"store {str(out)!r} has been under creation for over {CREATION_WAIT_S:g} s (its "
                             "creator was killed?): run one process with --resume to recreate it") from None
        check_identity(out, attrs)


#: How long a shard waits for another process to finish creating a remote store.
CREATION_WAIT_S = 60.0


def _being_created(out: StoreLocation, *, wait: bool) -> bool:
    """Whether the root attributes still lack ``schema_version`` (a creation under way or killed); with ``wait``,
    give a creator that is still at work up to :data:`CREATION_WAIT_S` to finish."""
    deadline = time.monotonic() + (CREATION_WAIT_S if wait else 0)
    while True:
        text = out.read_text("zarr.json")
        attrs = json.loads(text).get("attributes", {}) if text else {}
        if "schema_version" in attrs or (text and CREATING_ATTR not in attrs and attrs):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(1.0)


def _create_local(out: Path, layout, attrs, labels, seeds, *, overwrite: bool, compression: str) -> None:
    """Create a local store atomically: build it in a temporary folder, then rename it into place."""
    remove_stale_temporaries(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        create_store(tmp, layout, labels=labels, seeds=seeds, attrs=attrs, overwrite=True, compression=compression)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(f"creating the store {str(out)!r} failed: {describe_os_error(exc)}; nothing was "
                         "written there") from exc
    if overwrite and out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:  # another shard created it first
        shutil.rmtree(tmp, ignore_errors=True)
        check_identity(out, attrs)


class RecordInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`record`, after the queued steps were written; the message says how many."""


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary folders (``.NAME.tmp-PID``) that killed processes left while creating ``out``.

    A folder whose process still runs (another shard creating the store right now) is kept."""
    removed = []
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _sample_arrays(model, tokens, orders, vae, dims) -> list[dict]:
    """Per-sample arrays of a unit: tokens on the full token axis, generation rank, images."""
    b, s = tokens.shape[0], dims.buffer
    full = torch.full((b, s + tokens.shape[1], tokens.shape[2]), float("nan"))
    full[:, s:] = tokens.float().cpu()                                      # [B, S+L, C]
    rank = torch.full((b, s + orders.shape[1]), -1, dtype=torch.int32)
    rank[:, s:].scatter_(1, orders.cpu(), torch.arange(orders.shape[1], dtype=torch.int32).expand(b, -1))
    images = decode_images(model, model.unpatchify(tokens).float(), vae) if hasattr(model, "unpatchify") else None
    out = []
    for i in range(b):
        arrays = {"tokens": full[i].numpy(), "order": rank[i].numpy()}
        if images is not None:
            arrays["images"] = images[i]
        out.append(arrays)
    return out


class _Progress:
    """Sampler observer advancing a step progress bar with the bytes written so far."""

    def __init__(self, bar, writer):
        self.bar, self.writer = bar, writer

    def step_end(self, state, sampled):
        self.bar.update(1)
        if self.bar.n % 8 == 0:
            from ..store.schema import format_bytes
            self.bar.set_postfix_str(f"{format_bytes(self.writer.bytes_logical)} written", refresh=False)


def record(model, labels, out, spec: SelectionSpec | None = None, *, sampling: SamplingConfig | None = None,
           seed: int = 0, num_iter: int | None = None, cfg: float | None = None, cfg_schedule: str | None = None,
           temperature: float | None = None, head_steps: str | None = None, rng: str | None = None, batch_size: int = 1,
           strategy=None, vae=None, checkpoint=None, resume: bool = False,
           overwrite: bool = False, repair: bool = False, shard=None, queue_size: int = 8, writer_threads: int = 4,
           compression: str = "lz4", steps_per_chunk: int | None = None, progress: bool = False,
           ranks: Ranks | None = None) -> RecordResult:
    """Sample ``labels`` with the probe attached and write the selected variables into a zarr run store.

    Parameters
    ----------
    model : MAR
        A model in eval mode.
    labels : array-like of int
        One class label per sample (the store's ``sample`` axis before ``spec.samples`` selection).
    out : str, Path or StoreLocation
        The store: a folder (``run.zarr``) or an fsspec URL (``s3://bucket/run.zarr``, ``memory://run.zarr``).
    spec : SelectionSpec, optional
        What to record (default: :data:`~mar_probe.store.spec.DEFAULT_VARIABLES` of every layer and step).
    seed : int
        Run seed; sample ``i`` uses ``SeedSequence([seed, i])`` (see :func:`sample_seeds`).
    sampling : SamplingConfig, optional
        Sampling settings as in :func:`mar_probe.sample` (None fields: the model's recommended setting, else the
        official default).
    num_iter, cfg, cfg_schedule, temperature, head_steps, rng
        Shortcuts for the same fields; a value given here (not None) overrides ``sampling``'s.
    batch_size : int
        Samples per sampler run; data depend on it (it is part of the run's identity).
    strategy : Strategy or str, optional
        How each step is computed (default: the full baseline).
    vae : optional
        KL-16 VAE to decode latent tokens into images.
    checkpoint : path, optional
        The checkpoint the model came from; its SHA-256 goes into the attrs.
    resume : bool
        Complete an existing store: samples flagged complete are skipped, the others redone.
    overwrite : bool
        Replace an existing store.
    repair : bool
        With ``resume``: first check every chunk of the finished steps (:func:`~mar_probe.store.integrity.verify`)
        and re-record the samples with missing or undecodable chunks, so the store equals an undamaged run.
    shard : str or (int, int), optional
        ``"I/N"``: write only the I-th of N disjoint parts; shards may run concurrently on one store.
    queue_size : int
        Step records buffered for the background writer.
    writer_threads : int
        Threads compressing and writing chunks.
    compression : {"lz4", "zstd", "none"}
        Codec of a new store's data variables (a resumed or shared store keeps its own).
    steps_per_chunk : int, optional
        Steps in one chunk of a new store's per-step variables (None: chunks of at most 4 MiB, see
        :func:`~mar_probe.store.schema.auto_steps_per_chunk`; a resumed or shared store keeps its own).
    progress : bool
        Show a progress bar (steps/s and bytes written).
    ranks : Ranks, optional
        This process's place in a torchrun launch (:meth:`mar_probe.launch.Ranks.from_env`; the process group
        joined, see :func:`mar_probe.launch.process_group`): every rank must call with the same settings (refused
        otherwise, before anything is written); rank 0 creates the store while the others wait; each rank writes
        ``shard`` ``RANK/WORLD_SIZE`` (a ``shard`` given beside it must be that one).

    Returns
    -------
    RecordResult
    """
    st = sampling_config(sampling, num_iter=num_iter, cfg=cfg, cfg_schedule=cfg_schedule, temperature=temperature,
                         head_steps=head_steps, rng=rng).resolve(model)
    compressors(compression)  # an unknown name fails before anything runs
    check_writer_settings(queue_size, writer_threads)
    if repair and not resume:
        raise ValueError("--repair re-records the damaged samples of an existing store: give it with --resume")
    shard = check_shard(ranks, parse_shard(shard))
    with head_steps_applied(model, st.head_steps):  # the plan's size estimate and the run see the same head
        plan = _plan(model, labels, out, spec, sampling=st, seed=seed, batch_size=batch_size, strategy=strategy,
                     vae=vae, checkpoint=checkpoint, shard=shard, steps_per_chunk=steps_per_chunk)
        if ranks is None or ranks.world_size == 1:
            _prepare(plan, resume=resume, overwrite=overwrite, repair=repair, compression=compression,
                     shard=plan.shard)
        else:
            _prepare_ranks(plan, ranks, resume=resume, overwrite=overwrite, repair=repair, compression=compression,
                           steps_per_chunk=steps_per_chunk)
        return _run(model, plan, vae=vae, queue_size=queue_size, threads=writer_threads, progress=progress)


def _prepare(plan: RecordPlan, *, resume, overwrite, repair, compression, shard) -> None:
    """Create or check the store as a process writing ``shard`` (None: all); then find damage (``--repair``) or
    warn about it (``--resume``)."""
    _prepare_store(plan.out, plan.layout, plan.attrs, plan.labels, plan.seeds, resume=resume, overwrite=overwrite,
                   shard=shard, compression=compression)
    if repair:
        _mark_damage(plan.out)
    elif resume:
        _warn_damage(plan.out)


def _prepare_ranks(plan: RecordPlan, ranks: Ranks, *, resume, overwrite, repair, compression,
                   steps_per_chunk) -> None:
    """torchrun: the ranks' settings must agree; rank 0 creates (or checks, or repairs) the store as one unsharded
    process would, while the others wait; then every rank checks the store it will write into."""
    mine = {**{k: _norm(plan.attrs.get(k)) for k in IDENTITY_KEYS}, "out": str(plan.out),
            "compression": compression, "steps_per_chunk": steps_per_chunk, "resume": resume, "overwrite": overwrite}
    settings = gather(mine)
    diff = sorted({k for other in settings for k in mine if other[k] != settings[0][k]})
    if diff:
        ranks_differ = [r for r, other in enumerate(settings) if any(other[k] != settings[0][k] for k in diff)]
        raise ValueError(f"the torchrun ranks were started with different settings ({', '.join(diff)} of ranks "
                         f"{ranks_differ!r} differ from rank 0's); nothing was written. Start every rank with the "
                         "same command")
    on_rank0(lambda: _prepare(plan, resume=resume, overwrite=overwrite, repair=repair, compression=compression,
                              shard=None), f"the store {str(plan.out)!r}")
    if ranks.rank != 0:
        check_identity(plan.out, plan.attrs)


@dataclass(frozen=True, kw_only=True)
class RecordPlan:
    """What one :func:`record` call writes: the store's layout and attributes, the samples and how they are drawn."""
    out: StoreLocation
    layout: RunLayout
    attrs: dict               # the store's root attributes (run_attrs)
    labels: np.ndarray        # [num_samples] class labels
    seeds: np.ndarray         # [num_samples] per-sample seeds (sample_seeds)
    strategy: object          # strategies.Strategy
    sampling: SamplingConfig  # resolved
    batch_size: int
    shard: tuple | None


def _plan(model, labels, out, spec, *, sampling: SamplingConfig, seed, batch_size, strategy, vae, checkpoint, shard,
          steps_per_chunk) -> RecordPlan:
    from ..strategies import FullStrategy, create
    labels = check_labels(model, labels, batch_size).numpy()
    spec = spec if spec is not None else SelectionSpec()
    if isinstance(strategy, str):
        strategy = create(strategy)
    strategy = strategy or FullStrategy()
    num_iter = sampling.num_iter
    num_steps = strategy.num_steps(num_iter) if hasattr(strategy, "num_steps") else num_iter
    layout = resolve(spec, model, num_samples=len(labels), num_iter=num_steps, cfg=sampling.cfg,
                     images=image_shape(model, vae), steps_per_chunk=steps_per_chunk)
    # the stored "sampling" attribute keeps its keys of schema 1 (an identity key: old stores must still resume)
    stored = dict(num_iter=num_iter, cfg=sampling.cfg, cfg_schedule=sampling.cfg_schedule,
                  temperature=sampling.temperature, rng=sampling.rng, batch_size=batch_size,
                  num_sampling_steps=sampling.head_steps)
    attrs = run_attrs(model, spec, labels, seed, stored, strategy, checkpoint)
    return RecordPlan(out=StoreLocation.of(out), layout=layout, attrs=attrs, labels=labels,
                      seeds=sample_seeds(seed, len(labels)), strategy=strategy, sampling=sampling,
                      batch_size=batch_size, shard=parse_shard(shard))


def _mark_damage(out: StoreLocation) -> None:
    """``--repair``: clear the flags of damaged samples so that this resumed run re-records them."""
    from ..store.integrity import mark_for_repair, verify
    report = verify(out)
    if not report.ok:
        rows = mark_for_repair(out, report)
        print(f"repair: {len(report.damages)} damaged chunks in {len(rows)} samples; re-recording them",
              file=sys.stderr)


def _warn_damage(out: StoreLocation) -> None:
    """A resumed run without --repair says so when finished steps lost chunks (it would not redo them)."""
    from ..store.integrity import missing_chunks
    report = missing_chunks(out)
    if not report.ok:
        print(f"warning: {len(report.damages)} chunks of finished steps are missing from {str(out)!r} "
              f"(samples {list(report.samples)[:8]!r}); this resume does not redo them: add --repair",
              file=sys.stderr)


def _run(model, plan: RecordPlan, *, vae, queue_size: int, threads: int, progress: bool) -> RecordResult:
    layout = plan.layout
    done, complete = read_flags(plan.out)
    units = _units(layout, plan.batch_size, plan.shard)
    # a unit is redone unless all its samples are complete with every step flagged done (a lost done chunk
    # reads as unfinished steps: issue 19)
    todo = [u for u in units if not (complete[u].all() and done[u].all())]
    t0 = time.perf_counter()
    writer = StoreWriter(plan.out, layout, queue_size=queue_size, threads=threads)
    bar = tqdm(total=len(todo) * plan.sampling.num_iter, disable=not progress, desc="record", unit="step")
    probe = Probe(model, layout, writer.put_step)
    device = next(model.parameters()).device
    sampler = Sampler(model, plan.strategy, [probe, _Progress(bar, writer)], device)
    try:
        with probe.attached():
            for unit in todo:
                _run_unit(model, sampler, probe, writer, plan, unit, vae, device)
    except BaseException as exc:
        bar.close()
        writer.close(raise_error=False)  # flush what is queued; the original error wins
        if isinstance(exc, KeyboardInterrupt):
            done, _ = read_flags(plan.out)
            raise RecordInterrupted(f"interrupted; {int(done.sum())} of {done.size} steps saved in "
                                    f"{str(plan.out)!r}: rerun with --resume to complete it") from None
        raise
    bar.close()
    writer.close()
    skipped = sum(len(u) for u in units) - sum(len(u) for u in todo)
    return RecordResult(plan.out, sum(len(u) for u in todo), skipped, writer.bytes_logical,
                        time.perf_counter() - t0, writer.wait_s)


def _run_unit(model, sampler, probe, writer, plan, unit, vae, device) -> None:
    s = plan.sampling
    ids = [plan.layout.samples[r] for r in unit]
    gen = SampleRNG.create(int(plan.seeds[ids[0]]), s.rng, device)
    probe.begin_batch(unit)
    labels = torch.as_tensor(plan.labels[ids], dtype=torch.long, device=device)
    tokens, orders = sampler.run(labels, gen, num_iter=s.num_iter, cfg=s.cfg, cfg_schedule=s.cfg_schedule,
                                 temperature=s.temperature)
    for row, arrays in zip(unit, _sample_arrays(model, tokens, orders, vae, plan.layout.dims)):
        writer.put_sample(row, arrays)
