"""Streaming analysis of a large store: peak resident memory and throughput against the raw read speed.

Synthesises a store with the real schema of the ``mar_base`` architecture (buffer 64 + 256 tokens, 12 decoder
layers, 12 heads x 64, both CFG branches; ``dec_k``, ``dec_v``, ``z``, ``z_cfg_resid``, ``attn_gen`` in
float16) of ``--gb`` GB, with activations that drift slowly between steps and masks that follow MAR's cosine
schedule. Then, in a fresh child process (so its peak RSS is the analysis' alone):

* raw read: every chunk of the analysed variables read and decompressed with zarr, nothing computed;
* analysis: cosine stability of K and V per layer and token category, CFG residual MSE, and attention
  (layer 1) vs K-drift selection overlap at K = 16, 64, computed with dask chunk by chunk.

    python benchmarks/bench_analysis.py --gb 5 --scratch /big/disk    # the acceptance run (>= 5 GB)
    python benchmarks/bench_analysis.py --gb 0.05                      # smoke run (~50 MB)
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import write_result

VARS = ("dec_k", "dec_v", "z", "z_cfg_resid", "attn_gen")


def base_dims():
    from mar_probe.store.schema import ModelDims, StackDims
    st = StackDims(depth=12, heads=12, d_head=64, d_model=768)
    return ModelDims(buffer=64, seq_len=256, grid=16, channels=16, enc=st, dec=st)


def plan(gb: float) -> tuple[int, int]:
    """(samples, steps) giving about ``gb`` GB of activations (steps capped at MAR's 64)."""
    from mar_probe.probe.spec import SelectionSpec
    from mar_probe.store.schema import estimate_size
    per = sum(v for k, v in estimate_size(SelectionSpec(variables=VARS), base_dims(), 1, 1, cfg=2.0).items()
              if k in VARS)
    pairs = max(3, math.ceil(gb * 1e9 / per))
    steps = min(64, pairs)
    return math.ceil(pairs / steps), steps


def _masks(rng, steps: int, dims):
    from mar_probe.sampler import mask_length
    L, S = dims.seq_len, dims.buffer
    rank = rng.permutation(L)
    mask, pred = np.zeros((steps, S + L), bool), np.zeros((steps, S + L), bool)
    before = L
    for s in range(steps):
        after = 0 if s == steps - 1 else mask_length(s, steps, L, before)
        mask[s, S:], pred[s, S:] = rank < before, (rank < before) & (rank >= after)
        before = after
    return mask, pred, np.concatenate([-np.ones(S, np.int32), rank.astype(np.int32)])


def synthesise(path: Path, samples: int, steps: int, seed: int = 0) -> None:
    """Write the store chunk by chunk (one (sample, step) at a time, so memory stays small)."""
    import zarr
    from mar_probe.probe.spec import SelectionSpec
    from mar_probe.store.schema import resolve
    from mar_probe.store.writer import create_store
    dims = base_dims()
    layout = resolve(SelectionSpec(variables=VARS), dims, num_samples=samples, num_iter=steps, cfg=2.0)
    attrs = {"schema_version": 1, "mar_probe_version": "bench", "model_preset": "mar_base (synthetic)",
             "selection": json.dumps(layout.spec.to_dict()), "sampling": json.dumps({"num_iter": steps, "cfg": 2.0})}
    create_store(path, layout, labels=np.zeros(samples, int), seeds=np.arange(samples), attrs=attrs, overwrite=True)
    root = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    rng = np.random.default_rng(seed)
    for i in range(samples):
        mask, pred, order = _masks(rng, steps, dims)
        root["order"][i] = order
        state = {v: rng.standard_normal(layout.variables[v].shape[2:], dtype=np.float32) for v in VARS}
        for s in range(steps):
            for v in VARS:
                state[v] += 0.05 * rng.standard_normal(state[v].shape, dtype=np.float32)
                root[v][i, s] = np.abs(state[v]) if v == "attn_gen" else state[v]
            root["mask"][i, s], root["pred"][i, s], root["done"][i, s] = mask[s], pred[s], True
        root["complete"][i] = True


def raw_read(path: Path) -> tuple[int, float]:
    """Read and decompress every chunk of the analysed variables; (logical bytes, seconds)."""
    import zarr
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    t0, n = time.perf_counter(), 0
    for v in VARS:
        arr = root[v]
        for i in range(arr.shape[0]):
            for s in range(arr.shape[1]):
                n += arr[i, s].nbytes
    return n, time.perf_counter() - t0


def analyse(path: Path, workers: int) -> dict:
    """The streaming analysis; returns its sizes, timings and peak RSS."""
    import dask
    import mar_probe.analysis as A
    from mar_probe.store import open_run
    ds = open_run(path)
    cats = A.token_categories(ds)
    out = {f"{v}_share95": A.summarize_stability(A.cosine_stability(ds[v].sel(branch="cond", drop=True)), cats,
                                                 thresholds=(0.95,))["share"].mean("sample") for v in ("dec_k", "dec_v")}
    out["cfg"] = A.cfg_residual_mse(ds)["ratio_cond"].mean()
    actual = A.drift(ds["dec_k"].sel(branch="cond", drop=True))
    out["sel"] = A.selection_vs_drift(A.attention_selector(ds, 1), actual.sel(layer=actual.layer > 1), cats,
                                      k=(16, 64))["precision"].mean(["sample", "step"])
    t0 = time.perf_counter()
    with dask.config.set(scheduler="threads", num_workers=workers):
        res = dask.compute(out)[0]
    return {"seconds": time.perf_counter() - t0, "residual_ratio": float(res["cfg"]),
            "precision_k64_layer11": float(res["sel"].sel(k=64, layer=11))}


def child(path: Path, workers: int) -> None:
    n, t_raw = raw_read(path)
    ana = analyse(path, workers)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"bytes": n, "raw_read_s": t_raw, **ana, "peak_rss_bytes": rss}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=5.0, help="activations to synthesise, in GB (default 5)")
    p.add_argument("--scratch", default="/tmp/mar_probe_bench_analysis", help="folder for the store")
    p.add_argument("--workers", type=int, default=2, help="dask threads (default 2)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(Path(a.child), a.workers)
    samples, steps = plan(a.gb)
    path = Path(a.scratch) / "bench.zarr"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    synthesise(path, samples, steps)
    t_write = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    proc = subprocess.run([sys.executable, __file__, "--child", str(path), "--workers", str(a.workers)],
                          capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {"samples": samples, "steps": steps, "variables": list(VARS), "logical_bytes": r["bytes"],
              "disk_bytes": disk, "synthesise_s": t_write, "raw_read_MBps": r["bytes"] / r["raw_read_s"] / 1e6,
              "analysis_MBps": r["bytes"] / r["seconds"] / 1e6, "analysis_s": r["seconds"],
              "analysis_vs_raw": r["raw_read_s"] / r["seconds"], "peak_rss_MB": r["peak_rss_bytes"] / 1e6,
              "peak_rss_under_2GB": r["peak_rss_bytes"] < 2e9, "workers": a.workers,
              "checks": {"residual_ratio": r["residual_ratio"], "precision_k64_layer11": r["precision_k64_layer11"]}}
    name = "analysis" if a.gb >= 5 else f"analysis_smoke_{a.gb:g}gb"
    print(json.dumps(result, indent=2), f"\n-> {write_result(name, result)}")
    if not a.keep:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
