"""Streaming analysis of a large store: peak resident memory and throughput against the raw read speed.

Synthesises a store with the real schema of the ``mar_base`` architecture (buffer 64 + 256 tokens, 12 decoder
layers, 12 heads x 64, both CFG branches; ``dec_k``, ``dec_v``, ``z``, ``z_cfg_resid``, ``attn_gen`` in
float16, through the store's own ``create_store`` and codecs) of ``--gb`` GB, with activations that drift
slowly between steps and masks that follow MAR's cosine schedule. Then, each in a fresh child process:

* ``read``: the store's files read as bytes, cold (every file first evicted from the page cache with
  ``posix_fadvise(DONTNEED)``, which needs no root) and warm (read again at once); then every chunk of the
  analysed variables read and decompressed with zarr, nothing computed (warm);
* ``analyse`` (cold, peak RSS measured in this process alone): :func:`mar_probe.analysis.run_summary` over
  :func:`mar_probe.analysis.open_runs` -- cosine stability of K and V per layer and token category, CFG
  residual MSE, attention and LazyMAR V-cosine selection against K drift at every later layer, top-K overlap.

    python benchmarks/bench_analysis.py --gb 5.6 --scratch /big/disk    # the acceptance run (>= 5 GB on disk)
    python benchmarks/bench_analysis.py --gb 0.05                        # smoke run (~50 MB)

The machine may be shared: the load average before and after and the CPU seconds of each phase are reported
beside the wall times.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import write_result

VARS = ("dec_k", "dec_v", "z", "z_cfg_resid", "attn_gen")
POOL = 4  # noise blocks per variable, reused with random signs (drawing fresh normals dominated synthesis)


def base_dims():
    from mar_probe.store.schema import ModelDims, StackDims
    st = StackDims(depth=12, heads=12, d_head=64, d_model=768)
    return ModelDims(buffer=64, seq_len=256, grid=16, channels=16, enc=st, dec=st)


def plan(gb: float) -> tuple[int, int]:
    """(samples, steps): 64 steps per sample, samples enough for about ``gb`` GB of activations."""
    from mar_probe.store.spec import SelectionSpec
    from mar_probe.store.schema import estimate_size
    per = sum(v for k, v in estimate_size(SelectionSpec(variables=VARS), base_dims(), 1, 1, cfg=2.0).items()
              if k in VARS)
    pairs = max(3, math.ceil(gb * 1e9 / per))
    steps = min(64, pairs)
    return math.ceil(pairs / steps), steps


def _masks(rng, steps: int, dims):
    from mar_probe.engine.loop import mask_length
    L, S = dims.seq_len, dims.buffer
    rank = rng.permutation(L)
    mask, pred = np.zeros((steps, S + L), bool), np.zeros((steps, S + L), bool)
    before = L
    for s in range(steps):
        after = 0 if s == steps - 1 else mask_length(s, steps, L, before)
        mask[s, S:], pred[s, S:] = rank < before, (rank < before) & (rank >= after)
        before = after
    return mask, pred, np.concatenate([-np.ones(S, np.int32), rank.astype(np.int32)])


def _create(path: Path, samples: int, steps: int):
    from mar_probe.store.spec import SelectionSpec
    from mar_probe.store.schema import SCHEMA_VERSION, resolve
    from mar_probe.store.writer import create_store
    layout = resolve(SelectionSpec(variables=VARS), base_dims(), num_samples=samples, num_iter=steps, cfg=2.0)
    attrs = {"schema_version": SCHEMA_VERSION, "mar_probe_version": "bench", "model_preset": "mar_base (synthetic)",
             "seed": 0, "selection": json.dumps(layout.spec.to_dict()),
             "sampling": json.dumps({"num_iter": steps, "cfg": 2.0})}
    create_store(path, layout, labels=np.zeros(samples, int), seeds=np.arange(samples), attrs=attrs, overwrite=True)
    return layout


def synthesise(path: Path, samples: int, steps: int, seed: int = 0) -> None:
    """Write the store chunk by chunk (one (sample, step) at a time, so memory stays small)."""
    import zarr
    from tqdm import tqdm
    layout = _create(path, samples, steps)
    root = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    rng = np.random.default_rng(seed)
    shapes = {v: layout.variables[v].shape[2:] for v in VARS}
    pool = {v: [0.05 * rng.standard_normal(shapes[v], dtype=np.float32) for _ in range(POOL)] for v in VARS}
    flags = [n for n, lay in layout.variables.items() if n.endswith("_computed")]
    with tqdm(total=samples * steps, desc="synthesise", unit="step") as bar:
        for i in range(samples):
            mask, pred, order = _masks(rng, steps, layout.dims)
            root["order"][i] = order
            state = {v: rng.standard_normal(shapes[v], dtype=np.float32) for v in VARS}
            for s in range(steps):
                for v in VARS:
                    state[v] += rng.choice([-1, 1]) * pool[v][rng.integers(POOL)]
                    root[v][i, s] = np.abs(state[v]) if v == "attn_gen" else state[v]
                for name in flags:
                    root[name][i, s] = True
                root["mask"][i, s], root["pred"][i, s], root["done"][i, s] = mask[s], pred[s], True
                bar.update()
            root["complete"][i] = True


def store_files(path: Path, names=VARS) -> list[Path]:
    """The chunk files of variables ``names`` (what the analysis reads besides small bookkeeping)."""
    return sorted(f for v in names for f in (path / v).rglob("*") if f.is_file())


def evict(files) -> None:
    """Drop the files' pages from the page cache (clean pages; no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes(files) -> tuple[int, float]:
    """Read every file in 4 MiB blocks; (bytes, seconds)."""
    t0, n = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while block := fh.read(1 << 22):
                n += len(block)
    return n, time.perf_counter() - t0


def zarr_decode(path: Path) -> tuple[int, float, float]:
    """Read and decompress every chunk of the analysed variables; (logical bytes, seconds, CPU seconds)."""
    import zarr
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for v in VARS:
        arr = root[v]
        for i in range(arr.shape[0]):
            for s in range(arr.shape[1]):
                n += arr[i, s].nbytes
    return n, time.perf_counter() - t0, time.process_time() - c0


def child_read(path: Path) -> dict:
    files = store_files(path)
    evict(files)
    n, cold = read_bytes(files)
    _, warm = read_bytes(files)
    logical, dec_s, dec_cpu = zarr_decode(path)
    return {"file_bytes": n, "file_read_cold_s": cold, "file_read_warm_s": warm, "logical_bytes": logical,
            "zarr_decode_warm_s": dec_s, "zarr_decode_warm_cpu_s": dec_cpu}


def child_analyse(path: Path, workers: int, max_chunk_mb: float) -> dict:
    """The streaming analysis, cold; its summary numbers, timings and this process' peak RSS."""
    import dask
    import mar_probe.analysis as A
    evict(store_files(path, [p.name for p in path.iterdir() if p.is_dir()]))
    t0, c0 = time.perf_counter(), time.process_time()
    ds = A.open_runs([path], max_bytes=max_chunk_mb * 1e6)
    with dask.config.set(num_workers=workers):
        table, skipped = A.run_summary(ds, layer=1, k=64)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    def pick(**m):
        return float(table[np.logical_and.reduce([table[c] == v for c, v in m.items()])]["mean"].iloc[0])
    return {"analysis_s": seconds, "analysis_cpu_s": cpu, "peak_rss_bytes": rss, "rows": len(table),
            "skipped": skipped, "chunks_steps": int(ds["dec_k"].chunks[1][0]),
            "checks": {"ratio_cond/residual": pick(quantity="ratio_cond/residual"),
                       "precision_k64_layer11_attention": pick(quantity="precision_topk_drift", layer=11,
                                                               selector="attention@layer1"),
                       "random_k64_layer11": pick(quantity="precision_topk_drift", layer=11, selector="random")}}


def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"child {args!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _result(samples, steps, disk, t_write, rd, an, workers, loads) -> dict:
    def mb(n, s):
        return n / s / 1e6
    logical = rd["logical_bytes"]
    return {"samples": samples, "steps": steps, "variables": list(VARS), "logical_bytes": logical,
            "disk_bytes": disk, "analysed_file_bytes": rd["file_bytes"], "synthesise_s": t_write,
            "raw_file_read_cold_MBps": mb(rd["file_bytes"], rd["file_read_cold_s"]),
            "raw_file_read_warm_MBps": mb(rd["file_bytes"], rd["file_read_warm_s"]),
            "zarr_decode_warm_MBps_logical": mb(logical, rd["zarr_decode_warm_s"]),
            "zarr_decode_warm_cpu_s": rd["zarr_decode_warm_cpu_s"],
            "analysis_s": an["analysis_s"], "analysis_cpu_s": an["analysis_cpu_s"],
            "analysis_MBps_file_bytes": mb(rd["file_bytes"], an["analysis_s"]),
            "analysis_MBps_logical": mb(logical, an["analysis_s"]),
            "analysis_vs_raw_cold_read": rd["file_read_cold_s"] / an["analysis_s"],
            "analysis_vs_zarr_decode": rd["zarr_decode_warm_s"] / an["analysis_s"],
            "peak_rss_MB": an["peak_rss_bytes"] / 1e6, "peak_rss_under_2GB": an["peak_rss_bytes"] < 2e9,
            "workers": workers, "dask_chunk_steps": an["chunks_steps"], "summary_rows": an["rows"],
            "skipped_sections": an["skipped"], "checks": an["checks"], "load_average_before_after": loads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=5.6, help="activations to synthesise, in GB (default 5.6)")
    p.add_argument("--scratch", default="/tmp/mar_probe_bench_analysis", help="folder for the store")
    p.add_argument("--workers", type=int, default=2, help="dask threads (default 2)")
    p.add_argument("--max-chunk-mb", type=float, default=32.0, help="largest dask chunk (default 32 MB)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--reuse", action="store_true", help="analyse an existing store at --scratch (no synthesis)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, path = a.child
        out = child_read(Path(path)) if kind == "read" else child_analyse(Path(path), a.workers, a.max_chunk_mb)
        return print(json.dumps(out, default=str))
    path = Path(a.scratch) / "bench.zarr"
    loads = [os.getloadavg()]
    samples, steps = plan(a.gb)
    t_write = 0.0
    if not a.reuse:
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        synthesise(path, samples, steps)
        t_write = time.perf_counter() - t0
    else:
        import zarr
        samples, steps = zarr.open_group(str(path), mode="r", use_consolidated=False)["dec_k"].shape[:2]
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    rd = _child(["--child", "read", str(path)])
    an = _child(["--child", "analyse", str(path), "--workers", str(a.workers), "--max-chunk-mb", str(a.max_chunk_mb)])
    loads.append(os.getloadavg())
    result = _result(samples, steps, disk, t_write, rd, an, a.workers, loads)
    name = "analysis" if disk >= 5e9 else f"analysis_smoke_{a.gb:g}gb"
    print(json.dumps(result, indent=2), f"\n-> {write_result(name, result)}")
    if not a.keep:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
