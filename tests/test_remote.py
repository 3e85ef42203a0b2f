"""Run stores on object storage (issue 16, item 2): a real S3-compatible server on 127.0.0.1 (moto's server mode,
random port, stopped at the end) reached through s3fs, no mock of the client; and fsspec's memory filesystem."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from mar_probe import open_run
from mar_probe.store.location import StoreLocation, StoreUnreachableError
from test_store import CLI, _assert_same_store, _record_ref

BUCKET = "mar-probe-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """The server's environment (endpoint and test credentials), set in this process for the module's tests."""
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(BUCKET)
    yield env
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _record_ref(path)
    return path


def _done_remote(url: str) -> int:
    try:
        return int(zarr.open_array(f"{url}/done", mode="r")[...].sum())
    except (FileNotFoundError, zarr.errors.NodeNotFoundError, ValueError, KeyError):
        return 0


def _record_cli(url, *extra, env=None):
    cmd = [sys.executable, "-m", "mar_probe.cli", "record", *CLI, "--out", url, *extra]
    return cmd, dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))


def test_record_into_s3_killed_and_resumed_equals_the_local_store(s3, ref_store, tmp_path):
    url = f"s3://{BUCKET}/killed.zarr"
    cmd, env = _record_cli(url)
    log = open(tmp_path / "killed.log", "w+b")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while _done_remote(url) < 8 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # kill once some steps are on the server, before the run is through
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _done_remote(url)
    assert 0 < done < 64, f"the kill should fall mid-run, {done} of 64 steps were done"
    rerun = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "already complete" in rerun.stdout
    _assert_same_store(url, ref_store)
    ds = open_run(url)
    assert ds.attrs["incomplete"] == [] and ds.sizes["sample"] == 8
    np.testing.assert_array_equal(ds["dec_k"].values, open_run(ref_store)["dec_k"].values)


def test_analyze_and_verify_read_an_s3_store(s3, ref_store):
    url = f"s3://{BUCKET}/analyzed.zarr"
    cmd, env = _record_cli(url)
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=300).returncode == 0
    got = {}
    for name, store in (("remote", url), ("local", str(ref_store))):
        res = subprocess.run([sys.executable, "-m", "mar_probe.cli", "analyze", store, "--json", "-"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        got[name] = json.loads(res.stdout)
    src = {name: g.pop("source") for name, g in got.items()}          # where it came from differs, nothing else
    assert url in src["remote"]["command"] and str(ref_store) in src["local"]["command"]
    assert src["remote"]["weights_sha256"] == src["local"]["weights_sha256"]
    assert got["remote"] == got["local"] and got["remote"]["rows"]
    res = subprocess.run([sys.executable, "-m", "mar_probe.cli", "verify", url], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok (" in res.stdout, res.stdout + res.stderr


def test_a_killed_creation_on_s3_is_recreated_by_resume_and_refused_without(s3, ref_store):
    """Object stores have no rename: a creation killed half-way leaves the marker, which --resume replaces."""
    url = f"s3://{BUCKET}/half.zarr"
    zarr.open_group(url, mode="w-", zarr_format=3, attributes={"mar_probe_creating": True})
    with pytest.raises(ValueError, match="still being created, or its creation was killed"):
        open_run(url)
    cmd, env = _record_cli(url)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "unfinished creation; pass --resume" in res.stderr
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    _assert_same_store(url, ref_store)


def test_memory_store_round_trip_equals_the_local_store(ref_store):
    from test_store import _model
    from mar_probe import record
    from mar_probe.store.spec import SelectionSpec
    from test_store import VARS
    url = "memory://mar-probe-tests/run.zarr"
    StoreLocation.of(url).remove()
    res = record(_model(), np.arange(8), url, SelectionSpec(variables=VARS, layers=(1,)), seed=5, num_iter=8,
                 cfg=2.0, strategy="full")
    assert res.path == StoreLocation.of(url) and res.samples_written == 8
    _assert_same_store(url, ref_store)
    again = record(_model(), np.arange(8), url, SelectionSpec(variables=VARS, layers=(1,)), seed=5, num_iter=8,
                   cfg=2.0, strategy="full", resume=True)
    assert again.samples_written == 0 and again.samples_skipped == 8


def _run_cli_env(argv, env):
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mar_probe.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    return res, time.monotonic() - t0


def test_unreachable_endpoint_is_named_within_the_timeout(tmp_path):
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_ENDPOINT_URL=endpoint,
               AWS_EC2_METADATA_DISABLED="true", OMP_NUM_THREADS="1")
    for argv in (["record", *CLI, "--out", "s3://nowhere/run.zarr"], ["analyze", "s3://nowhere/run.zarr"]):
        res, seconds = _run_cli_env(argv, env)
        assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert "s3://nowhere/run.zarr" in res.stderr and endpoint in res.stderr, res.stderr
        assert seconds < 60, f"{argv[0]} took {seconds:.0f} s to give up"


def test_missing_credentials_are_named(s3):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3["AWS_ENDPOINT_URL"], AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", OMP_NUM_THREADS="1")
    res, _ = _run_cli_env(["record", *CLI, "--out", f"s3://{BUCKET}/nocreds.zarr"], env)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "credentials" in res.stderr.lower() and "AWS_ACCESS_KEY_ID not set" in res.stderr, res.stderr


def test_location_names_bad_values():
    with pytest.raises(TypeError, match="path or an fsspec URL, got int 3"):
        StoreLocation.of(3)
    with pytest.raises(ValueError, match="is a remote store"):
        _ = StoreLocation.of("s3://b/x").local_path
    with pytest.raises(StoreUnreachableError, match="protocol 'nosuchproto'"):
        StoreLocation.of("nosuchproto://x/y").check_reachable()


def test_concurrent_shards_into_s3_equal_the_local_store(s3, ref_store, tmp_path):
    """Two hand-run shards started together: one creates the store in place, the other waits for it."""
    url = f"s3://{BUCKET}/shards.zarr"
    procs = []
    for i in range(2):
        cmd, env = _record_cli(url, "--shard", f"{i}/2")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    _assert_same_store(url, ref_store)


def test_study_into_s3_writes_stores_figures_and_summary_there(s3):
    from mar_probe.cli import main
    url = f"s3://{BUCKET}/study"
    argv = ["study", "--model", "mar_tiny", "--num-iter", "4", "--samples-per-seed", "2", "--seeds", "0,3",
            "--out", url]
    assert main(argv) == 0
    import s3fs
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    for name in ("grid.png", "summary.txt", "summary.json", "study.json", "figures/index.html",
                 "figures/lazymar_fig1.png", "seed0.zarr/zarr.json", "seed3.zarr/zarr.json"):
        assert fs.size(f"{BUCKET}/study/{name}") > 0, name
    summary = json.loads(fs.cat_file(f"{BUCKET}/study/summary.json"))
    assert summary["settings"]["samples"] == 4
    assert open_run(f"{url}/seed3.zarr").attrs["seed"] == 3
    assert main(argv) == 0  # complete stores are reused on the object store too


def test_figures_and_analyze_json_write_to_s3(s3, ref_store):
    from mar_probe.cli import main
    import s3fs
    assert main(["figures", str(ref_store), "--out", f"s3://{BUCKET}/figs"]) == 0
    assert main(["analyze", str(ref_store), "--json", f"s3://{BUCKET}/summary.json"]) == 0
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/figs")}
    assert {"marche_fig12.png", "marche_fig12.csv", "index.html"} <= names, names
    assert json.loads(fs.cat_file(f"{BUCKET}/summary.json"))["rows"]
