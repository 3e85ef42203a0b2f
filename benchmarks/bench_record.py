"""Recording throughput and overhead of ``mar_probe.record``, each measured side by side in one run.

Per model (the embedded default, and the ``mar_base`` architecture with random weights):

* **raw disk**: the sequential write speed of the disk holding ``--scratch`` (``--raw-mib`` MiB in 16 MiB blocks,
  fsync), measured right before and right after the full capture;
* **full capture** (every activation variable of ``ACTIVATIONS``, every layer and step, float16): logical
  throughput = uncompressed bytes recorded per second, the store synced to disk before the clock stops, as a fraction
  of the raw speed (goal >= 50%). Beside it, to say what bounds it, the same samples with the probe capturing into
  nothing (``capture_only``: sampling + hooks + assembling the arrays, no writer) and the CPU seconds of both;
* **light overhead**: time(record) / time(sampling without recording) for K/V of two decoder layers, the CFG residual
  and the selection scores (goal <= 1.1x). Plain and recorded runs alternate in ``--rounds`` rounds (ABBA order,
  so a drifting machine load hits both alike); each round gives a ratio, reported with their median and spread;
* **bytes per sample per variable**, uncompressed and on disk, and the compression ratio of the full capture;
* **codecs**: the writer alone on the same in-memory records (everything, one sample, ``--codec-steps`` steps) with
  each codec (lz4, zstd, none): logical MiB per wall second and per CPU second, and the compression ratio.

The load average before and after each model is stored beside the numbers: on a shared machine, wall-clock ratios
are only as good as the neighbours' load is steady.

    python benchmarks/bench_record.py                                  # both models -> results/record.json
    python benchmarks/bench_record.py --models default                 # the embedded default only
    python benchmarks/bench_record.py --models mar_base --base-sampling-steps 10
    python benchmarks/bench_record.py --tiny                           # smoke run: mar_tiny, a few steps
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from common import write_result
from mar_probe import create_model, load_model, sample
from mar_probe.models import DEFAULT_PRESET
from mar_probe.models.checkpoints import DEFAULT_CHECKPOINT, resolve_device
from mar_probe.probe import ACTIVATIONS, Probe, SelectionSpec, record
from mar_probe.probe.record import sample_seeds


def raw_write_speed(folder: Path, mib: int) -> float:
    """Sequential write speed of the disk under ``folder`` in bytes/s (16 MiB blocks, then fsync)."""
    path, block = folder / "raw_write.bin", os.urandom(16 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, mib // 16)):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return size / seconds


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def clocked(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of the process, result) of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def run_record(model, labels, out: Path, spec, args):
    """Record into ``out`` (replacing it) and sync the disk; the RecordResult."""
    shutil.rmtree(out, ignore_errors=True)
    res = record(model, labels, out, spec, seed=0, num_iter=args.num_iter, cfg=args.cfg, batch_size=args.batch_size,
                 writer_threads=args.writer_threads, compression=args.compression)
    os.sync()
    return res


def run_plain(model, labels, args, observers=()):
    """Sampling without recording, in the units of ``batch_size`` samples and with the seeds ``record`` uses."""
    seeds = sample_seeds(0, len(labels))
    for k in range(0, len(labels), args.batch_size):
        sample(model, labels[k:k + args.batch_size], num_iter=args.num_iter, cfg=args.cfg, seed=int(seeds[k]),
               observers=observers)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_capture_only(model, labels, spec, args):
    """Sampling with the probe attached, its records dropped (sampling + hooks + array assembly, no writer)."""
    probe = Probe.for_run(model, spec, num_samples=len(labels), num_iter=args.num_iter, cfg=args.cfg,
                          sink=lambda rec: None)
    seeds = sample_seeds(0, len(labels))
    with probe.attached():
        for k in range(0, len(labels), args.batch_size):
            probe.begin_batch(range(k, min(k + args.batch_size, len(labels))))
            sample(model, labels[k:k + args.batch_size], num_iter=args.num_iter, cfg=args.cfg, seed=int(seeds[k]),
                   observers=[probe])


def steps_per_chunk(out: Path) -> int:
    """Steps in one chunk of the store's per-step variables."""
    import zarr
    return int(zarr.open_array(str(out / "done"), mode="r").chunks[1])


def per_variable(out: Path, num_samples: int) -> dict:
    """Bytes per sample per variable: uncompressed, on disk, and their ratio."""
    import zarr
    root = zarr.open_group(str(out), mode="r")
    table = {}
    for name, arr in root.arrays():
        if "sample" not in (arr.metadata.dimension_names or ()) or name == "sample":
            continue
        raw = int(np.prod(arr.shape)) * arr.dtype.itemsize / num_samples
        disk = du(out / name) / num_samples
        table[name] = {"bytes_per_sample": raw, "disk_bytes_per_sample": disk, "ratio": raw / max(disk, 1)}
    return table


def full_capture(model, name, labels, args, scratch: Path) -> dict:
    """Full capture vs raw disk speed (before and after), plus capture-only time and the per-variable table."""
    spec = SelectionSpec(variables=ACTIVATIONS)
    out = scratch / f"{name}_full.zarr"
    raw_before = raw_write_speed(scratch, args.raw_mib)
    wall, cpu, res = clocked(lambda: run_record(model, labels, out, spec, args))
    raw_after = raw_write_speed(scratch, args.raw_mib)
    cap_wall, cap_cpu, _ = clocked(lambda: run_capture_only(model, labels, spec, args))
    disk = du(out)
    table = per_variable(out, len(labels))
    block = steps_per_chunk(out)
    shutil.rmtree(out, ignore_errors=True)
    raw = (raw_before + raw_after) / 2
    logical = res.bytes_logical / wall
    return {"samples": len(labels), "seconds": wall, "cpu_seconds": cpu, "bytes_logical": res.bytes_logical,
            "bytes_on_disk": disk, "compression_ratio": res.bytes_logical / max(disk, 1),
            "logical_bytes_per_s": logical, "raw_write_bytes_per_s": {"before": raw_before, "after": raw_after},
            "fraction_of_raw_disk": logical / raw, "goal_fraction_of_raw_disk": 0.5,
            "disk_bytes_per_s": disk / wall, "writer_wait_s": res.writer_wait_s,
            "capture_only_seconds": cap_wall, "capture_only_cpu_seconds": cap_cpu,
            "capture_only_logical_bytes_per_s": res.bytes_logical / cap_wall,
            "record_vs_capture_only": wall / cap_wall, "steps_per_chunk": block, "per_variable": table}


def light_overhead(model, name, labels, args, scratch: Path) -> dict:
    """time(record, light selection) / time(plain sampling), alternating ABBA over ``args.rounds`` rounds."""
    last = len(model.decoder_blocks) - 1
    spec = SelectionSpec(variables=("dec_k", "dec_v", "z_cfg_resid", "attn_gen"),
                         layers=tuple(sorted({min(1, last), min(2, last)})))
    out = scratch / f"{name}_light.zarr"
    runs = {"plain": lambda: run_plain(model, labels, args), "record": lambda: run_record(model, labels, out, spec,
                                                                                         args)}
    times = {k: {"wall": [], "cpu": []} for k in runs}
    for r in range(args.rounds):
        for kind in (("plain", "record") if r % 2 == 0 else ("record", "plain")):
            wall, cpu, _ = clocked(runs[kind])
            times[kind]["wall"].append(wall)
            times[kind]["cpu"].append(cpu)
    disk, block = du(out), steps_per_chunk(out)
    shutil.rmtree(out, ignore_errors=True)
    ratios = [r / p for r, p in zip(times["record"]["wall"], times["plain"]["wall"])]
    cpu_ratios = [r / p for r, p in zip(times["record"]["cpu"], times["plain"]["cpu"])]
    return {"selection": spec.to_dict(), "samples": len(labels), "rounds": args.rounds, "seconds": times,
            "overhead_per_round": ratios, "overhead_median": statistics.median(ratios),
            "overhead_min": min(ratios), "overhead_max": max(ratios),
            "overhead_pooled": sum(times["record"]["wall"]) / sum(times["plain"]["wall"]),
            "cpu_overhead_per_round": cpu_ratios, "cpu_overhead_median": statistics.median(cpu_ratios),
            "goal_overhead": 1.1, "bytes_on_disk_per_sample": disk / len(labels), "steps_per_chunk": block}


def measure(model, name: str, args, scratch: Path) -> dict:
    """All measurements of one model, with the load average around them."""
    labels = np.arange(max(args.full_samples, args.num_samples)) % model.num_classes
    run_plain(model, labels[:1], args)                                        # warm-up
    load_before = os.getloadavg()
    out = {"model": name, "preset": getattr(model.config, "name", None), "num_iter": args.num_iter, "cfg": args.cfg,
           "batch_size": args.batch_size, "num_sampling_steps": model.diffloss.num_sampling_steps,
           "writer_threads": args.writer_threads, "compression": args.compression, "load_average_before": load_before}
    out["full"] = full_capture(model, name, labels[:args.full_samples], args, scratch)
    out["light"] = light_overhead(model, name, labels[:args.num_samples], args, scratch)
    out["load_average_after"] = os.getloadavg()
    if args.codec_steps:
        out["codecs"] = codec_comparison(model, name, args, scratch)
    f, lt = out["full"], out["light"]
    raw = np.mean(list(f["raw_write_bytes_per_s"].values())) / 2**20
    rounds = ", ".join(f"{r:.2f}" for r in lt["overhead_per_round"])
    print(f"{name}: full capture {f['logical_bytes_per_s'] / 2**20:.1f} MiB/s logical = {f['fraction_of_raw_disk']:.1%}"
          f" of raw disk ({raw:.0f} MiB/s); record / capture-only {f['record_vs_capture_only']:.2f}x; compression "
          f"{f['compression_ratio']:.2f}x; light overhead median {lt['overhead_median']:.2f}x (rounds {rounds}); "
          f"load {load_before[0]:.1f} -> {out['load_average_after'][0]:.1f}")
    return out


def codec_comparison(model, name, args, scratch: Path) -> dict:
    """The writer alone on the same in-memory records (one sample, ``codec_steps`` steps, everything), per codec:
    logical MiB per wall second and per CPU second of the process, and the compression ratio (two repeats each)."""
    from mar_probe.store.writer import COMPRESSIONS, StoreWriter, create_store
    spec = SelectionSpec(variables=ACTIVATIONS)
    probe = Probe.for_run(model, spec, num_samples=1, num_iter=args.codec_steps, cfg=args.cfg)
    probe.begin_batch([0])
    with probe.attached():
        sample(model, [0], num_iter=args.codec_steps, cfg=args.cfg, seed=0, observers=[probe])
    nbytes = sum(a.nbytes for r in probe.records for a in r.arrays.values())
    out = {"steps": args.codec_steps, "bytes_logical": nbytes}
    for codec in COMPRESSIONS * 2:
        path = scratch / f"{name}_codec.zarr"
        shutil.rmtree(path, ignore_errors=True)
        create_store(path, probe.layout, labels=np.array([0]), seeds=sample_seeds(0, 1), attrs={},
                     compression=codec)

        def write(path=path):
            writer = StoreWriter(path, probe.layout, queue_size=8, threads=args.writer_threads)
            for rec in probe.records:
                writer.put_step(rec)
            writer.close()
            os.sync()
        wall, cpu, _ = clocked(write)
        disk = du(path)
        shutil.rmtree(path, ignore_errors=True)
        got = out.setdefault(codec, {"wall_bytes_per_s": [], "cpu_bytes_per_s": [], "ratio": nbytes / disk})
        got["wall_bytes_per_s"].append(nbytes / wall)
        got["cpu_bytes_per_s"].append(nbytes / cpu)
    return out


def build(preset: str | None, args):
    """The embedded default (or its architecture with random weights when the file is missing), or a preset."""
    torch.manual_seed(0)
    if preset is None:
        steps = {"num_sampling_steps": args.num_sampling_steps} if args.num_sampling_steps else {}
        if DEFAULT_CHECKPOINT.is_file():
            return load_model(device=args.device, **steps)
        print(f"note: {DEFAULT_CHECKPOINT} not found; timing its architecture, {DEFAULT_PRESET}, with random weights")
        return create_model(DEFAULT_PRESET, **steps).to(args.device).eval()
    over = {"num_sampling_steps": args.base_sampling_steps} if args.base_sampling_steps else {}
    return create_model(preset, **over).to(args.device).eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,mar_base", help="comma-separated: default, mar_base")
    p.add_argument("--scratch", default="benchmarks/scratch", help="folder on the disk under test (removed after)")
    p.add_argument("--full-samples", type=int, default=2, help="samples of the full capture (default model)")
    p.add_argument("--num-samples", type=int, default=4, help="samples per run of the light-overhead rounds")
    p.add_argument("--base-samples", type=int, default=1, help="samples of every mar_base measurement")
    p.add_argument("--rounds", type=int, default=4, help="plain/record rounds of the light overhead (ABBA)")
    p.add_argument("--base-rounds", type=int, default=2, help="rounds for mar_base")
    p.add_argument("--num-iter", type=int, default=64)
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-sampling-steps", default=None, help="head steps of the default model (default: its own)")
    p.add_argument("--base-sampling-steps", default="10",
                   help="head steps of mar_base (default 10 instead of 100: only the recording overhead matters, "
                        "and the head is not recorded; the ratio is then against a faster plain run, a stricter test)")
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--compression", default="lz4", choices=["lz4", "zstd", "none"])
    p.add_argument("--codec-steps", type=int, default=16,
                   help="steps of the in-memory records written once per codec (0: skip; mar_base: at most 2)")
    p.add_argument("--raw-mib", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="torch device of the models: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--out", default="record", help="result name: results/<out>.json")
    p.add_argument("--tiny", action="store_true", help="smoke run: mar_tiny, 4 steps, 64 MiB raw")
    a = p.parse_args(argv)
    try:
        a.device = str(resolve_device(a.device))                    # a clear error, before any model is built
    except ValueError as exc:
        p.error(f"--device: {exc}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if a.tiny:
        a.full_samples, a.num_samples, a.base_samples, a.num_iter, a.raw_mib, a.rounds, a.base_rounds = \
            2, 2, 1, 4, 64, 2, 2
        a.codec_steps = min(a.codec_steps, 4)
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    results = {"settings": vars(a), "models": []}
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        preset = {"default": "mar_tiny" if a.tiny else None, "mar_base": "mar_tiny_latent" if a.tiny else "mar_base"}
        if name not in preset:
            raise SystemExit(f"unknown model {name!r}; expected some of {sorted(preset)!r}")
        model = build(preset[name], a)
        if name == "mar_base":
            a_base = argparse.Namespace(**{**vars(a), "full_samples": a.base_samples, "num_samples": a.base_samples,
                                           "rounds": a.base_rounds, "codec_steps": min(a.codec_steps, 2)})
            results["models"].append(measure(model, name, a_base, scratch))
        else:
            results["models"].append(measure(model, name, a, scratch))
        del model
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {write_result(a.out + ('_tiny' if a.tiny else ''), results)}")


if __name__ == "__main__":
    main()
