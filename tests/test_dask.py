"""Analysis on a dask.distributed cluster (issue 16): a real LocalCluster of 2 worker processes computes the same
summary and figures as the single process, its workers read the store's chunks themselves, and bad cluster
flags fail fast with one line naming what was given."""
import json
import socket
import time

import numpy as np
import pandas as pd
import pytest

from mar_probe.analysis import SchedulerError, dask_cluster, run_summary
from mar_probe.cli import main
from mar_probe.store import open_run


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real recorded store: mar_tiny (3+3 blocks), 2 samples x 4 steps, every variable the summary reads."""
    from conftest import perturbed_tiny
    from mar_probe.probe.record import record
    from mar_probe.store.spec import SelectionSpec
    path = tmp_path_factory.mktemp("dask") / "run.zarr"
    spec = SelectionSpec(variables=("dec_k", "dec_v", "dec_resid_post", "z", "z_cfg_resid", "attn_gen"))
    record(perturbed_tiny(encoder_depth=3, decoder_depth=3), np.arange(2), path, spec, seed=0, num_iter=4, cfg=2.0)
    return path


@pytest.fixture(scope="module")
def client():
    with dask_cluster(workers=2) as c:
        assert len(c.scheduler_info()["workers"]) == 2
        yield c


def _count_reads():
    """Wrap the store's chunk reads in this process so that they are counted; return the count so far.

    Defined at call time (``client.run`` ships it by value to the worker processes, which cannot import tests)."""
    def install():
        from mar_probe.store import reader
        cls = reader._CheckedChunks
        if "reads" not in vars(cls):
            read, cls.reads = cls.__getitem__, []

            def counted(self, key):
                cls.reads.append(self.name)
                return read(self, key)
            cls.__getitem__ = counted
        return len(cls.reads)
    return install


@pytest.fixture
def local_reads(monkeypatch):
    """Chunk reads of this (the client) process, counted while the test runs."""
    from mar_probe.store import reader
    reads = []
    read = reader._CheckedChunks.__getitem__

    def counted(self, key):
        reads.append(self.name)
        return read(self, key)
    monkeypatch.setattr(reader._CheckedChunks, "__getitem__", counted)
    return reads


def _worker_reads(client) -> dict:
    return client.run(_count_reads())


def test_summary_on_the_cluster_equals_the_single_process_and_workers_read_the_chunks(store, client, local_reads):
    ds = open_run(store)
    opened = len(local_reads)
    single, skipped = run_summary(ds, k=8, scheduler="threads")
    reads_single = len(local_reads) - opened
    before = _worker_reads(client)
    with dask_cluster(scheduler=client.scheduler.address) as connected:  # the --scheduler ADDRESS path
        on_cluster, skipped_cluster = run_summary(ds, k=8, scheduler=connected)
    after = _worker_reads(client)
    # the same graph on another scheduler: the same float operations in the same order, so bit for bit equal
    pd.testing.assert_frame_equal(on_cluster, single)
    assert on_cluster.attrs == single.attrs and skipped_cluster == skipped == {}
    assert set(single["section"]) == {"stability", "cfg", "selection", "overlap"}
    per_worker = {w: after[w] - before[w] for w in after}
    assert len(per_worker) == 2 and all(n > 0 for n in per_worker.values()), per_worker
    assert sum(per_worker.values()) == reads_single > 0       # every chunk read once, by one of the workers
    assert len(local_reads) - opened == reads_single          # ... and none by this process


def test_figures_on_the_cluster_equal_the_single_process(store, client, tmp_path, local_reads):
    from mar_probe.plot.report import write_figures
    ds = open_run(store)
    only = ["lazymar_fig2", "marche_fig12", "selection_vs_drift"]
    written, _ = write_figures(ds, tmp_path / "one", only, scheduler=None)
    local = len(local_reads)
    before = _worker_reads(client)
    written_cluster, _ = write_figures(ds, tmp_path / "cluster", only, scheduler=client)
    after = _worker_reads(client)
    assert list(written_cluster) == list(written) == only
    for name in only:
        assert (tmp_path / "cluster" / f"{name}.csv").read_bytes() == (tmp_path / "one" / f"{name}.csv").read_bytes()
    assert all(after[w] > before[w] for w in after) and len(local_reads) == local


def test_analyze_workers_2_prints_the_same_json_as_one_process(store, capsys):
    assert main(["analyze", str(store), "--k", "8", "--json"]) == 0
    plain = capsys.readouterr().out
    assert main(["analyze", str(store), "--k", "8", "--json", "--workers", "2"]) == 0
    cluster, one = json.loads(capsys.readouterr().out), json.loads(plain)
    # the measurements are identical; only the source's command line and clock differ (issue 15's provenance)
    assert cluster.pop("source")["command"].endswith("--workers 2") and one.pop("source")["command"].endswith("--json")
    assert cluster == one
    assert {r["section"] for r in one["rows"]} == {"stability", "cfg", "selection", "overlap"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_scheduler_fails_within_the_timeout_naming_it(store, capsys):
    address = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    assert main(["analyze", str(store), "--scheduler", address, "--timeout", "1.5"]) == 2
    assert time.monotonic() - start < 1.5 + 3  # the timeout, plus opening the store
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mar-probe analyze: error: --scheduler ")
    assert f"{address!r} cannot be reached within 1.5 s" in err and "dask scheduler" in err
    start = time.monotonic()
    with pytest.raises(SchedulerError, match="cannot be reached within 1 s") as info:
        with dask_cluster(scheduler=address, timeout=1):
            pass
    assert time.monotonic() - start < 1 + 1.5 and isinstance(info.value, ValueError)
    assert main(["figures", str(store), "--scheduler", "tcp://127.0.0.1", "--out", "unused"]) == 2
    assert "'tcp://127.0.0.1' cannot be reached" in capsys.readouterr().err  # no port: refused at once


def test_a_scheduler_without_workers_is_named():
    from distributed import LocalCluster
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as empty:
        with pytest.raises(SchedulerError, match=f"scheduler '{empty.scheduler_address}' has no worker after 1 s"):
            with dask_cluster(scheduler=empty.scheduler_address, timeout=1):
                pass


def test_bad_cluster_flags_are_refused_naming_the_value(store, capsys):
    assert main(["analyze", str(store), "--workers", "0"]) == 2
    assert "--workers must be a positive integer (local worker processes), got 0" in capsys.readouterr().err
    assert main(["figures", str(store), "--workers", "-1", "--out", "unused"]) == 2
    assert "--workers must be a positive integer (local worker processes), got -1" in capsys.readouterr().err
    assert main(["analyze", str(store), "--scheduler", "tcp://127.0.0.1:1", "--timeout", "0"]) == 2
    assert "--timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(store), "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"])
    assert exc.value.code == 2
    assert "argument --scheduler: not allowed with argument --workers" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--scheduler .* or --workers .*got scheduler='tcp://h:1' and workers=2"):
        with dask_cluster(scheduler="tcp://h:1", workers=2):
            pass
    with pytest.raises(ValueError, match="workers must be a positive integer .*got True"):
        with dask_cluster(workers=True):
            pass
    with dask_cluster() as none:
        assert none is None
