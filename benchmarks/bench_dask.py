"""`mar-probe analyze` on a dask.distributed LocalCluster against the single process: wall time, peak memory, equality.

Synthesises a store of at least ``--gb`` GB of activations (logical, uncompressed) with the real schema of the
``mar_base`` architecture (``bench_analysis.synthesise``: ``dec_k``, ``dec_v``, ``z``, ``z_cfg_resid``,
``attn_gen`` in float16 through the store's own codecs; 2 samples, the steps it takes), then runs, each in a
fresh child process with the store's pages first evicted from the page cache (cold):

* ``single``: :func:`mar_probe.analysis.run_summary` over :func:`mar_probe.analysis.open_runs` on dask's default
  (threaded) scheduler -- what ``mar-probe analyze STORE`` runs; peak RSS of the process;
* ``cluster``: the same inside :func:`mar_probe.analysis.dask_cluster` with ``workers=N`` (1 thread each), the
  summary computed by the Client -- what ``mar-probe analyze STORE --workers N`` runs; peak RSS of the client
  process (which also hosts the scheduler) and of each worker process (``ru_maxrss`` read on the worker after
  the compute, and its RSS before the compute), the chunks each worker read, the tasks it ran, its CPU seconds
  and its task time by action (compute, incoming transfers from the other workers; from the task stream).

Both tables must be equal (``pandas.testing.assert_frame_equal``, exact); the script exits 1 otherwise. The graph's
pickled size and its largest embedded numpy array show that the client ships the store's path, not its data.

    nice python benchmarks/bench_dask.py --gb 1.074 --workers 2        # the acceptance run (>= 1 GiB logical)
    python benchmarks/bench_dask.py --gb 0.1 --keep                     # smoke run

Writes ``benchmarks/results/dask_analyze.json`` and ``.md`` (``dask_analyze_smoke_<gb>gb`` below 1 GB).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench_analysis import VARS, base_dims, evict, store_files, synthesise
from common import RESULTS, write_result

SAMPLES = 2


def plan(gb: float) -> tuple[int, int]:
    """(samples, steps): 2 samples, steps enough for at least ``gb`` GB of the activations."""
    from mar_probe.store.schema import estimate_size
    from mar_probe.store.spec import SelectionSpec
    per = sum(v for k, v in estimate_size(SelectionSpec(variables=VARS), base_dims(), 1, 1, cfg=2.0).items()
              if k in VARS)
    return SAMPLES, max(3, math.ceil(gb * 1e9 / per / SAMPLES))


def install_read_counter():
    """Count the store's chunk reads (and their bytes) in this process; return (reads, bytes) so far.

    Defined in the benchmark (pickled by value to the workers); the reads themselves are the store's own."""
    from mar_probe.store import reader
    cls = reader._CheckedChunks
    if "bench_reads" not in vars(cls):
        read, cls.bench_reads, lock = cls.__getitem__, [], threading.Lock()

        def counted(self, key):
            out = read(self, key)
            with lock:
                cls.bench_reads.append(int(getattr(out, "nbytes", 0)))
            return out
        cls.__getitem__ = counted
    return len(cls.bench_reads), sum(cls.bench_reads)


def process_cpu() -> float:
    """CPU seconds (user + system) of this process so far."""
    import psutil
    times = psutil.Process().cpu_times()
    return times.user + times.system


def process_memory() -> dict:
    """This process' peak RSS so far and its RSS now, in bytes.

    The peak is Linux's ``VmHWM``, of this process image alone: ``ru_maxrss`` survives ``exec``, so a child (and
    a worker, spawned from the client's nanny) would report its parent's peak at the fork."""
    import psutil
    status = Path("/proc/self/status")
    hwm = [ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")] if status.exists() else []
    peak = int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_bytes": peak, "rss_bytes": psutil.Process().memory_info().rss}


def graph_stats(ds) -> dict:
    """Tasks of the summary's graph, its pickled size and the numpy arrays embedded in it."""
    import cloudpickle
    import io
    from mar_probe.analysis import summary as S
    parts, _ = S._sections(ds, layer=1, lazymar_layer=None, k=64, threshold=0.95, variables=S.STABILITY_VARS,
                           var="dec_k")
    graph = {}
    for part in parts.values():
        graph.update(dict(part.data.__dask_graph__()))
    arrays = []

    class Pickler(cloudpickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, np.ndarray):
                arrays.append(obj.nbytes)
            return None
    buf = io.BytesIO()
    Pickler(buf, protocol=5).dump(graph)
    return {"tasks": len(graph), "pickled_bytes": buf.tell(), "embedded_arrays": len(arrays),
            "largest_embedded_array_bytes": max(arrays, default=0), "embedded_array_bytes": sum(arrays)}


def _evict_all(path: Path) -> None:
    evict(store_files(path, [p.name for p in path.iterdir() if p.is_dir()]))


def child_single(path: Path, table_out: Path) -> dict:
    import mar_probe.analysis as A
    install_read_counter()
    _evict_all(path)
    before = process_memory()
    t0, c0 = time.perf_counter(), time.process_time()
    ds = A.open_runs([path])
    opened = install_read_counter()  # dask's empty reads for each variable's meta
    table, skipped = A.run_summary(ds)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    reads, nbytes = np.subtract(install_read_counter(), opened).tolist()
    mem = process_memory()
    pickle.dump((table, skipped), table_out.open("wb"))
    return {"summary_s": seconds, "cpu_s": cpu, "rss_before_bytes": before["rss_bytes"],
            "peak_rss_bytes": mem["peak_rss_bytes"], "chunk_reads": reads, "chunk_read_bytes": nbytes,
            "rows": len(table), "skipped": skipped, "dask_chunks_dec_k": [list(c) for c in ds["dec_k"].chunks[:2]],
            "graph": graph_stats(ds)}


def _per_worker(client, before, counts0, cpu0, stream) -> dict:
    mem, counts, cpu = client.run(process_memory), client.run(install_read_counter), client.run(process_cpu)
    out = {}
    for w in mem:
        actions = {}
        for task in (t for t in stream if t.get("worker") == w):
            for ss in task["startstops"]:
                actions[ss["action"]] = actions.get(ss["action"], 0.0) + ss["stop"] - ss["start"]
        out[w] = {"rss_before_bytes": before[w]["rss_bytes"], "peak_rss_bytes": mem[w]["peak_rss_bytes"],
                  "chunk_reads": counts[w][0] - counts0[w][0], "chunk_read_bytes": counts[w][1] - counts0[w][1],
                  "cpu_s": cpu[w] - cpu0[w], "tasks": sum(1 for t in stream if t.get("worker") == w),
                  "task_seconds_by_action": actions}
    return out


def child_cluster(path: Path, table_out: Path, workers: int) -> dict:
    import mar_probe.analysis as A
    from distributed import get_task_stream
    install_read_counter()
    t0 = time.perf_counter()
    with A.dask_cluster(workers=workers) as client:
        startup = time.perf_counter() - t0
        counts0 = client.run(install_read_counter)  # imports mar_probe on the workers: not part of the timing
        before, cpu0 = client.run(process_memory), client.run(process_cpu)
        _evict_all(path)
        t1, c1 = time.perf_counter(), time.process_time()
        with get_task_stream(client=client) as stream:
            ds = A.open_runs([path])
            opened = install_read_counter()  # dask's empty reads for each variable's meta
            table, skipped = A.run_summary(ds, scheduler=client)
        seconds, cpu = time.perf_counter() - t1, time.process_time() - c1
        per_worker = _per_worker(client, before, counts0, cpu0, stream.data)
    reads, nbytes = np.subtract(install_read_counter(), opened).tolist()
    pickle.dump((table, skipped), table_out.open("wb"))
    return {"summary_s": seconds, "client_cpu_s": cpu, "cluster_startup_s": startup,
            "client_peak_rss_bytes": process_memory()["peak_rss_bytes"], "client_chunk_reads": reads,
            "client_chunk_read_bytes": nbytes, "workers": per_worker, "rows": len(table), "skipped": skipped}


def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"child {args!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(single_pkl: Path, cluster_pkl: Path) -> dict:
    import pandas as pd
    (a, sa), (b, sb) = (pickle.load(p.open("rb")) for p in (single_pkl, cluster_pkl))
    try:
        pd.testing.assert_frame_equal(b, a)
        equal, why = a.attrs == b.attrs and sa == sb, None
    except AssertionError as exc:
        equal, why = False, str(exc)[:2000]
    return {"summaries_equal": equal, "difference": why, "summary_rows": len(a), "sections": sorted(set(a["section"]))}


def _stats(single: dict, cluster: dict) -> dict:
    ws = cluster["workers"].values()
    return {"single_summary_s": single["summary_s"], "cluster_summary_s": cluster["summary_s"],
            "speedup_single_over_cluster": single["summary_s"] / cluster["summary_s"],
            "cluster_startup_s": cluster["cluster_startup_s"],
            "single_peak_rss_MB": single["peak_rss_bytes"] / 1e6,
            "client_peak_rss_MB": cluster["client_peak_rss_bytes"] / 1e6,
            "worker_peak_rss_MB": [w["peak_rss_bytes"] / 1e6 for w in ws],
            "worker_rss_before_MB": [w["rss_before_bytes"] / 1e6 for w in ws],
            "worker_chunk_reads": [w["chunk_reads"] for w in ws], "worker_tasks": [w["tasks"] for w in ws],
            "single_cpu_s": single["cpu_s"], "worker_cpu_s": [w["cpu_s"] for w in ws],
            "client_and_scheduler_cpu_s": cluster["client_cpu_s"],
            "worker_compute_s": [w["task_seconds_by_action"].get("compute", 0.0) for w in ws],
            "worker_transfer_s": [w["task_seconds_by_action"].get("transfer", 0.0) for w in ws],
            "client_chunk_reads_during_cluster_summary": cluster["client_chunk_reads"]}


def _join(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def markdown(result: dict) -> str:
    """The result file's numbers as a table (written from the JSON, never typed)."""
    s, m = result["stats"], result["machine"]
    mb = ", ".join(f"{v:.0f}" for v in s["worker_peak_rss_MB"])
    before = ", ".join(f"{v:.0f}" for v in s["worker_rss_before_MB"])
    g = result["single"]["graph"]
    rows = [("store (logical / on disk)", f"{result['logical_bytes'] / 1e9:.3f} GB / {result['disk_bytes'] / 1e9:.3f} "
             f"GB, {result['samples']} samples x {result['steps']} steps, mar_base schema, float16"),
            ("run_summary wall, single process (threads)", f"{s['single_summary_s']:.1f} s"),
            (f"run_summary wall, LocalCluster {result['workers']} workers x 1 thread", f"{s['cluster_summary_s']:.1f} s"
             f" (cluster start {s['cluster_startup_s']:.1f} s, not included)"),
            ("ratio single / cluster", f"{s['speedup_single_over_cluster']:.2f}x"),
            ("peak RSS, single process", f"{s['single_peak_rss_MB']:.0f} MB"),
            ("peak RSS, client (+ scheduler) process", f"{s['client_peak_rss_MB']:.0f} MB"),
            ("peak RSS per worker (RSS before the compute)", f"{mb} MB ({before} MB)"),
            ("chunks read per worker / by the client", f"{s['worker_chunk_reads']} / "
             f"{s['client_chunk_reads_during_cluster_summary']} (single process: {result['single']['chunk_reads']})"),
            ("tasks per worker", f"{s['worker_tasks']}"),
            ("CPU s: single process / each worker / client (+ scheduler)", f"{s['single_cpu_s']:.1f} / "
             f"{_join(s['worker_cpu_s'])} / {s['client_and_scheduler_cpu_s']:.1f}"),
            ("task s per worker: compute / incoming transfers", f"{_join(s['worker_compute_s'])} / "
             f"{_join(s['worker_transfer_s'])}"),
            ("graph: tasks, pickled size, largest embedded array", f"{g['tasks']}, {g['pickled_bytes'] / 1e6:.2f} MB, "
             f"{g['largest_embedded_array_bytes']} bytes"),
            ("summaries equal (assert_frame_equal, exact)", f"{result['comparison']['summaries_equal']}"),
            ("load average before / after", f"{result['load_average_before_after'][0][0]:.2f} / "
             f"{result['load_average_before_after'][1][0]:.2f}")]
    lines = ["# analyze on a dask LocalCluster vs one process", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {result['memory_GB']:.0f} GB RAM, {m['date']}; shared with "
             "a background job (see the load averages). Command:", "", f"    {result['command']}", "",
             "| measure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.074, help="activations to synthesise, in GB (default 1.074 = 1 GiB)")
    p.add_argument("--workers", type=int, default=2, help="local worker processes of the cluster run (default 2)")
    p.add_argument("--scratch", default="/tmp/mar_probe_bench_dask", help="folder for the store and the tables")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--reuse", action="store_true", help="analyse an existing store at --scratch (no synthesis)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, path, out = a.child
        res = (child_single(Path(path), Path(out)) if kind == "single"
               else child_cluster(Path(path), Path(out), a.workers))
        print(json.dumps(res, default=str))
        return 0
    scratch = Path(a.scratch)
    path = scratch / "bench.zarr"
    samples, steps = plan(a.gb)
    t_write = 0.0
    if not a.reuse:
        scratch.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        synthesise(path, samples, steps)
        t_write = time.perf_counter() - t0
    loads = [os.getloadavg()]
    result = run_both(path, scratch, a.workers)
    import zarr
    root = zarr.open_group(str(path), mode="r", use_consolidated=False)
    samples, steps = root["dec_k"].shape[:2]
    result = {"command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]), "samples": int(samples),
              "steps": int(steps), "variables": list(VARS),
              "logical_bytes": int(sum(np.prod(root[v].shape) * root[v].dtype.itemsize for v in VARS)),
              "disk_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()), "synthesise_s": t_write,
              "workers": a.workers, "threads_per_worker": 1, "memory_GB": _memory_gb(), **result}
    result["load_average_before_after"] = loads + [os.getloadavg()]
    name = "dask_analyze" if result["logical_bytes"] >= 1e9 else f"dask_analyze_smoke_{a.gb:g}gb"
    out = write_result(name, result)
    result = json.loads(out.read_text())
    (RESULTS / f"{name}.md").write_text(markdown(result))
    print(json.dumps(result["stats"], indent=2), result["comparison"], f"\n-> {out}")
    if not a.keep:
        shutil.rmtree(path)
    return 0 if result["comparison"]["summaries_equal"] else 1


def run_both(path: Path, scratch: Path, workers: int) -> dict:
    single_pkl, cluster_pkl = scratch / "single.pkl", scratch / "cluster.pkl"
    single = _child(["--child", "single", str(path), str(single_pkl)])
    cluster = _child(["--child", "cluster", str(path), str(cluster_pkl), "--workers", str(workers)])
    return {"single": single, "cluster": cluster, "comparison": compare(single_pkl, cluster_pkl),
            "stats": _stats(single, cluster)}


def _memory_gb() -> float:
    import psutil
    return psutil.virtual_memory().total / 2**30


if __name__ == "__main__":
    sys.exit(main())
