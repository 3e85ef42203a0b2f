"""Recording throughput and overhead of ``mar_probe.record``.

Measures, on one disk and in one run:

* the raw sequential write speed of the disk holding ``--scratch`` (``--raw-mib`` MiB in 16 MiB blocks, fsync);
* a full capture (every activation variable, every layer and step): logical throughput = uncompressed bytes
  recorded per second (the store is synced before the clock stops), as a fraction of the raw speed (goal >= 50%);
* the overhead of a light selection (K/V of two decoder layers, the CFG residual and the selection scores):
  time(record) / time(sampling without recording) over the same samples and batches (goal <= 1.1x);
* bytes per sample per variable, uncompressed and on disk, and the compression ratio;
* the same for the ``mar_base`` architecture with random weights and one sample (``--base-samples``).

    python benchmarks/bench_record.py                       # embedded default + mar_base, results/record_*.json
    python benchmarks/bench_record.py --tiny                # smoke run: mar_tiny, a few steps (seconds)
    python benchmarks/bench_record.py --device cuda --batch-size 16 --num-samples 64
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from common import write_result
from mar_probe import create_model, load_model, sample
from mar_probe.models.checkpoints import DEFAULT_CHECKPOINT
from mar_probe.probe import ACTIVATIONS, SelectionSpec, record
from mar_probe.probe.record import sample_seeds


def raw_write_speed(folder: Path, mib: int) -> float:
    """Sequential write speed of the disk under ``folder`` in bytes/s (written with fsync)."""
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
    """Bytes on disk of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def timed_record(model, labels, out: Path, spec, args) -> tuple[float, object]:
    """Record into ``out`` (replacing it) and return (seconds including a final sync, RecordResult)."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = record(model, labels, out, spec, seed=0, num_iter=args.num_iter, cfg=args.cfg, batch_size=args.batch_size)
    os.sync()
    return time.perf_counter() - t0, res


def timed_plain(model, labels, args) -> float:
    """Sampling without recording, in the same units of ``batch_size`` samples with the same seeds."""
    seeds = sample_seeds(0, len(labels))
    t0 = time.perf_counter()
    for k in range(0, len(labels), args.batch_size):
        sample(model, labels[k:k + args.batch_size], num_iter=args.num_iter, cfg=args.cfg, seed=int(seeds[k]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def per_variable(out: Path, res, num_samples: int) -> dict:
    """Bytes per sample per variable: uncompressed, on disk, and their ratio."""
    import zarr
    root = zarr.open_group(str(out), mode="r")
    table = {}
    for name, arr in root.arrays():
        if "sample" not in (arr.metadata.dimension_names or ()):
            continue
        raw = int(np.prod(arr.shape)) * arr.dtype.itemsize / num_samples
        disk = du(out / name) / num_samples
        table[name] = {"bytes_per_sample": raw, "disk_bytes_per_sample": disk, "ratio": raw / max(disk, 1)}
    return table


def measure(model, name: str, num_samples: int, args, scratch: Path, raw_bps: float) -> dict:
    """All measurements of one model."""
    labels = np.arange(num_samples) % model.num_classes
    full = SelectionSpec(variables=ACTIVATIONS)
    last = len(model.decoder_blocks) - 1
    light = SelectionSpec(variables=("dec_k", "dec_v", "z_cfg_resid", "attn_gen"), layers=tuple(sorted({min(1, last), min(2, last)})))
    timed_plain(model, labels[:1], args)                                   # warm-up
    t_full, res_full = timed_record(model, labels, scratch / f"{name}_full.zarr", full, args)
    t_plain = timed_plain(model, labels, args)
    t_light, _ = timed_record(model, labels, scratch / f"{name}_light.zarr", light, args)
    table = per_variable(scratch / f"{name}_full.zarr", res_full, num_samples)
    logical = res_full.bytes_logical / t_full
    out = {"model": name, "num_samples": num_samples, "num_iter": args.num_iter, "cfg": args.cfg,
           "batch_size": args.batch_size, "full_seconds": t_full, "full_bytes_logical": res_full.bytes_logical,
           "full_logical_bytes_per_s": logical, "full_vs_raw_disk": logical / raw_bps,
           "writer_wait_s": res_full.writer_wait_s, "plain_seconds": t_plain, "light_seconds": t_light,
           "light_overhead": t_light / t_plain,
           "full_disk_bytes": du(scratch / f"{name}_full.zarr"), "per_variable": table}
    out["compression_ratio"] = res_full.bytes_logical / max(out["full_disk_bytes"], 1)
    print(f"{name}: full {logical / 2**20:.1f} MiB/s logical = {out['full_vs_raw_disk']:.0%} of raw disk; "
          f"light overhead {out['light_overhead']:.2f}x; compression {out['compression_ratio']:.2f}x")
    return out


def build(preset: str | None, args):
    torch.manual_seed(0)
    if preset is None:
        if DEFAULT_CHECKPOINT.is_file():
            return load_model(device=args.device)
        print(f"note: {DEFAULT_CHECKPOINT} not found; timing the fashion_small architecture with random weights")
        preset = "fashion_small"
    over = {"num_sampling_steps": args.num_sampling_steps} if args.num_sampling_steps else {}
    return create_model(preset, **over).to(args.device).eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scratch", default="benchmarks/scratch", help="folder on the disk under test (emptied)")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--base-samples", type=int, default=1, help="mar_base samples (0: skip mar_base)")
    p.add_argument("--num-iter", type=int, default=64)
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-sampling-steps", default=None)
    p.add_argument("--raw-mib", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="smoke run: mar_tiny, 2 samples, 4 steps, 64 MiB raw")
    a = p.parse_args(argv)
    if a.tiny:
        a.num_samples, a.base_samples, a.num_iter, a.raw_mib = 2, 1, 4, 64
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    raw = raw_write_speed(scratch, a.raw_mib)
    print(f"raw sequential write: {raw / 2**20:.1f} MiB/s")
    results = {"raw_write_bytes_per_s": raw, "settings": vars(a), "models": []}
    models = [("mar_tiny", "mar_tiny", a.num_samples)] if a.tiny else [("default", None, a.num_samples)]
    if a.base_samples:
        models.append(("mar_base" if not a.tiny else "mar_tiny_latent",) * 2 + (a.base_samples,))
    for name, preset, n in models:
        results["models"].append(measure(build(preset, a), name, n, a, scratch, raw))
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {write_result('record_tiny' if a.tiny else 'record', results)}")


if __name__ == "__main__":
    main()
