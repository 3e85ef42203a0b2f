"""Recording under torchrun (issue 16, item 1): real torchrun launches of CPU processes with the gloo backend."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_store import CLI, _assert_same_store, _done_count, _record_ref

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _record_ref(path)
    return path


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _torchrun(n: int, out, *extra) -> list[str]:
    return [*TORCHRUN, "--nproc_per_node", str(n), "-m", "mar_probe", "record", *CLI, "--out", str(out), *extra]


def test_four_ranks_write_the_single_process_store(ref_store, tmp_path):
    out = tmp_path / "four.zarr"
    res = subprocess.run(_torchrun(4, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # the ranks' lines arrive interleaved through torchrun's pipe: find them anywhere in the output
    reports = sorted(re.findall(r"rank (\d) of 4 wrote (\d+) samples", res.stdout))
    assert [r for r, _ in reports] == ["0", "1", "2", "3"], res.stdout
    assert sum(int(n) for _, n in reports) == 8
    _assert_same_store(out, ref_store)


def _workers(parent: int) -> list[int]:
    """The worker processes torchrun started (children of its agent)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_a_rank_killed_mid_run_is_completed_by_resume(ref_store, tmp_path):
    out = tmp_path / "killed.zarr"
    log = open(tmp_path / "killed.log", "w+b")
    proc = subprocess.Popen(_torchrun(4, out), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _done_count(out) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = _workers(proc.pid)
    assert len(workers) == 4, f"expected 4 torchrun workers, found {workers!r}"
    os.kill(workers[2], signal.SIGKILL)  # rank 2 (workers start in rank order)
    assert proc.wait(timeout=120) != 0  # torchrun reports the failed worker and stops the others
    done = _done_count(out)
    assert 0 < done < 64, f"the kill should fall mid-run: {done} of 64 steps done"
    res = subprocess.run(_torchrun(2, out, "--resume"), env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_same_store(out, ref_store)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_with_different_settings_are_refused_before_anything_is_written(tmp_path):
    """Two ranks started by hand (as torchrun would, through the environment), one with another --cfg."""
    out, port = tmp_path / "differ.zarr", _free_port()
    procs = []
    for rank, cfg in ((0, "2.0"), (1, "3.0")):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        argv = [a if a != "2.0" else cfg for a in CLI]
        procs.append(subprocess.Popen([sys.executable, "-m", "mar_probe", "record", *argv, "--out", str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert "torchrun ranks were started with different settings (sampling of ranks [1]" in err, err
    assert not out.exists() and not list(tmp_path.glob(".differ.zarr.tmp-*"))


def test_a_shard_that_disagrees_with_world_size_is_refused(tmp_path):
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    res = subprocess.run([sys.executable, "-m", "mar_probe", "record", *CLI, "--out", str(tmp_path / "x.zarr"),
                          "--shard", "0/4"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "--shard 0/4 disagrees with torchrun's RANK=0 WORLD_SIZE=2" in res.stderr, res.stderr
    assert not (tmp_path / "x.zarr").exists()


def test_bad_torchrun_environment_is_named():
    from mar_probe.launch import Ranks
    assert Ranks.from_env({}) is None
    assert Ranks.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}).shard == (3, 4)
    with pytest.raises(ValueError, match=r"RANK='x' is not a non-negative integer"):
        Ranks.from_env({"WORLD_SIZE": "2", "RANK": "x"})
    with pytest.raises(ValueError, match=r"RANK=2 and WORLD_SIZE=2 are inconsistent"):
        Ranks.from_env({"WORLD_SIZE": "2", "RANK": "2"})
    assert Ranks(rank=1, world_size=2, local_rank=1).device("cpu") == "cpu"
    assert Ranks(rank=1, world_size=2, local_rank=1).device("cuda") == "cuda:1"


def test_compare_spreads_seeds_over_ranks_and_gathers_one_results_file(tmp_path):
    """Two ranks, three seeds: one results.json (rank 0's) equal to the single process's, timings aside."""
    import json
    args = ["compare", "--model", "mar_tiny", "--num-samples", "2", "--num-iter", "3", "--num-sampling-steps", "2",
            "--cfg", "2.0", "--strategies", "full,m=marche", "--strategy-opt", "m.budget=20", "--seeds", "0,1,2"]
    one = subprocess.run([sys.executable, "-m", "mar_probe", *args, "--out", str(tmp_path / "one")], env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", "-m", "mar_probe", *args, "--out", str(tmp_path / "two")],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 alone writes
    ra, rb = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert ra["ranks"] is None and rb["ranks"] == {"world_size": 2, "spread": "seeds"}
    a, b = ra["strategies"], rb["strategies"]
    for label in ("full", "m"):
        assert a[label]["fidelity"] == b[label]["fidelity"] and a[label]["quality"] == b[label]["quality"]
        assert a[label]["gflops"] == b[label]["gflops"] and a[label]["speedup"]["flops"] == b[label]["speedup"]["flops"]
        assert [s["seed"] for s in b[label]["per_seed"]] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "two" / "partial").glob("*.npz")) == \
        sorted(p.name for p in (tmp_path / "one" / "partial").glob("*.npz"))
