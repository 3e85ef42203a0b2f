"""The run store: schema, open_run, round trip, crash safety, resume, shards and bad inputs (mar_tiny)."""
import errno
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

import mar_probe
from mar_probe.cli import main
from mar_probe.probe import SelectionSpec, record
from mar_probe.models.checkpoints import DEFAULT_CHECKPOINT
from mar_probe.probe.record import file_sha256, image_shape
from mar_probe.store import IncompleteRunWarning, SchemaError, estimate_size, format_bytes, open_run

VARS = "enc_v,dec_k,z_cfg_resid,attn_gen"
CLI = ["--model", "mar_tiny", "--num-samples", "8", "--num-iter", "8", "--cfg", "2.0", "--seed", "5",
       "--vars", VARS, "--layers", "1"]
DIMS = ("sample", "step", "branch", "layer", "token", "head", "d_head")


def _model(seed=5):
    torch.manual_seed(seed)  # as `mar-probe record --model mar_tiny --seed 5` builds its random weights
    return mar_probe.create_model("mar_tiny").eval()


def _record_ref(path, **kw):
    spec = SelectionSpec(variables=VARS, layers=(1,))
    return record(_model(), np.arange(8), path, spec, seed=5, num_iter=8, cfg=2.0, strategy="full", **kw)


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _record_ref(path)
    return path


def _assert_same_store(a, b):
    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    names = sorted(n for n, _ in ga.arrays())
    assert names == sorted(n for n, _ in gb.arrays())
    for n in names:
        x, y = ga[n][...], gb[n][...]
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), n
    skip = {"created"}
    assert {k: v for k, v in ga.attrs.items() if k not in skip} == {k: v for k, v in gb.attrs.items() if k not in skip}


def _cli(out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(f"{out}.{len(extra)}.{time.monotonic_ns()}.log", "w+b")  # a file, so a full pipe never blocks
    proc = subprocess.Popen([sys.executable, "-m", "mar_probe.cli", "record", *CLI, "--out", str(out), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log
    return proc


def _err(proc) -> str:
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")[-3000:]


def _done_count(path) -> int:
    """(sample, step) pairs flagged done so far (0 before the store exists)."""
    try:
        return int(zarr.open_array(str(path / "done"), mode="r")[...].sum())
    except (FileNotFoundError, zarr.errors.NodeNotFoundError, ValueError):
        return 0


def test_open_run_dims_coords_attrs(ref_store):
    for ds in (xr.open_zarr(str(ref_store)), open_run(ref_store)):
        assert ds["dec_k"].dims == DIMS
        assert ds["enc_v"].dims == DIMS
        assert ds["attn_gen"].dims == ("sample", "step", "branch", "layer", "token")
        assert ds["z_cfg_resid"].dims == ("sample", "step", "token", "d_model")
        assert list(ds["branch"].values) == ["cond", "uncond"] and list(ds["layer"].values) == [1]
        assert ds["row"].values[:4].tolist() == [-1] * 4 and ds["col"].values[4 + 9] == 1
    ds = open_run(ref_store)
    assert ds["dec_k"].chunks is not None  # dask-backed
    assert ds.attrs["schema_version"] == 2 and ds.attrs["model_preset"] == "mar_tiny"
    assert set(ds.attrs["versions"]) >= {"mar_probe", "torch", "zarr"} and ds.attrs["seed"] == 5
    assert ds.attrs["incomplete"] == [] and bool(ds["complete"].all()) and bool(ds["done"].all())
    assert ds["images"].shape == (8,) + image_shape(_model()) and ds["tokens"].dtype == np.float32
    assert list(ds.data_vars)[:4] == VARS.split(",")


def _assert_dec_k_is_a_plain_forward(m, ds, labels, sample, step, layer):
    """dec_k recorded at (sample, step, layer) equals K computed by a plain forward of the step's input."""
    s, attn = m.buffer_size, m.decoder_blocks[layer].attn
    tok = torch.from_numpy(ds["tokens"].values[sample, s:])                               # [L, C]
    mask = torch.from_numpy(ds["mask"].values[sample, step, s:])                          # [L]
    x = torch.where(mask[:, None], 0.0, tok)[None]                                        # [1, L, C]
    for b, emb in enumerate((m.class_emb(torch.tensor([labels[sample]])), m.fake_latent)):
        with torch.no_grad():
            h = m.decoder_input(m.forward_mae_encoder(x, mask[None], emb), mask[None])    # [1, S+L, D]
            for blk in m.decoder_blocks[:layer]:
                h = blk(h)
            qkv = attn.qkv(m.decoder_blocks[layer].norm1(h))                              # [1, N, 3D]
        k = qkv.reshape(1, h.shape[1], 3, attn.num_heads, -1)[0, :, 1]                    # [N, H, Dh]
        got = ds["dec_k"].sel(layer=layer).values[sample, step, b]
        assert np.allclose(got, k.numpy(), atol=1e-5)


def test_dec_k_equals_plain_forward_and_bf16_roundtrip(tmp_path):
    m = _model()
    labels = np.array([3, 7])
    spec = SelectionSpec(variables="dec_k", layers=(0, 1), dtype="float32")
    record(m, labels, tmp_path / "f32.zarr", spec, seed=1, num_iter=4, cfg=2.0)
    record(m, labels, tmp_path / "bf16.zarr", spec.replace(dtype="bfloat16"), seed=1, num_iter=4, cfg=2.0)
    ds = open_run(tmp_path / "f32.zarr")
    _assert_dec_k_is_a_plain_forward(m, ds, labels, sample=1, step=2, layer=1)
    bf = open_run(tmp_path / "bf16.zarr")["dec_k"].values
    want = torch.from_numpy(ds["dec_k"].values).to(torch.bfloat16).float().numpy()
    assert bf.dtype == np.float32 and np.array_equal(bf, want)
    bits = zarr.open_group(str(tmp_path / "bf16.zarr"), mode="r")["dec_k"]
    assert bits.dtype == np.uint16 and bits.attrs["mar_probe_dtype"] == "bfloat16"


def test_record_on_the_embedded_default_opens_with_xarray(tmp_path, capsys):
    out = tmp_path / "run.zarr"
    assert main(["record", "--out", str(out), "--labels", "3", "--num-samples", "1", "--num-iter", "3",
                 "--num-sampling-steps", "5", "--vars", "dec_k,enc_v,attn_gen", "--layers", "1",
                 "--dtype", "float32"]) == 0, capsys.readouterr().err
    for ds in (xr.open_zarr(str(out)), open_run(out)):
        assert ds["dec_k"].dims == ds["enc_v"].dims == DIMS
        assert ds["dec_k"].shape == (1, 3, 2, 1, 64 + 256, 2, 64)  # 2 branches: the file recommends CFG 5
        assert ds["attn_gen"].dims == ("sample", "step", "branch", "layer", "token")
    ds = open_run(out)
    assert ds.attrs["model_preset"] == "fashion_b128" and ds.attrs["incomplete"] == []
    assert ds.attrs["checkpoint_sha256"] == file_sha256(DEFAULT_CHECKPOINT)
    model = mar_probe.load_model(num_sampling_steps="5")
    _assert_dec_k_is_a_plain_forward(model, ds, np.array([3]), sample=0, step=2, layer=1)


def test_partial_row_strategy_store_has_computed_masks(tmp_path):
    spec = SelectionSpec(variables="enc_k,dec_v,z", dtype="bfloat16")
    lazy = mar_probe.strategies.create("lazymar", warmup_steps=1, refresh_interval=8)
    with pytest.raises(ValueError, match=r"unknown compression 'gzip'; expected one of \('lz4', 'zstd', 'none'\)"):
        record(_model(), np.array([2, 4]), tmp_path / "x.zarr", spec, num_iter=4, cfg=2.0, compression="gzip")
    record(_model(), np.array([2, 4]), tmp_path / "lazy.zarr", spec, seed=1, num_iter=4, cfg=2.0, strategy=lazy,
           compression="zstd")
    codec = zarr.open_group(str(tmp_path / "lazy.zarr"), mode="r")["enc_k"].metadata.codecs[-2]  # then crc32c
    assert codec.cname.value == "zstd" and not (tmp_path / "x.zarr").exists()
    ds = open_run(tmp_path / "lazy.zarr")
    assert ds["enc_computed"].dims == ds["dec_computed"].dims == ("sample", "step", "branch", "layer", "token")
    assert ds["derived"].dims == ("sample", "step", "branch") and ds.attrs["strategy"]["name"] == "lazymar"
    assert ds["derived"].values[:, :, 1].tolist() == [[False, False, True, True]] * 2   # condition cache
    assert not ds["dec_computed"].values[:, 2:, 1].any() and np.isnan(ds["dec_v"].values[:, 2:, 1]).all()
    assert ds["dec_computed"].values[:, :2].all() and not np.isnan(ds["dec_v"].values[:, :2]).any()  # full steps
    assert np.array_equal(np.isnan(ds["enc_k"].values[..., 0, 0]), ~ds["enc_computed"].values)
    assert (ds["enc_computed"].values[:, 2:, 0, 0].sum(-1) < (~ds["mask"].values[:, 2:]).sum(-1)).all()  # token cache
    assert not np.isnan(ds["z"].values[:, :, :, 4:]).any()               # uncond z: the derived value the head used


def _assert_flagged_data_match(path, ref_store):
    """Every (sample, step) flagged done and every sample flagged complete holds exactly the reference data."""
    got, ref = zarr.open_group(str(path), mode="r"), zarr.open_group(str(ref_store), mode="r")
    done, complete = got["done"][...], got["complete"][...]
    for name, arr in ref.arrays():
        dims = arr.metadata.dimension_names or ()
        if dims[:2] == ("sample", "step"):
            flagged, x, y = done, got[name][...][done], arr[...][done]
        elif dims[:1] == ("sample",) and name != "sample":
            flagged, x, y = complete, got[name][...][complete], arr[...][complete]
        else:
            continue
        assert flagged.shape == arr.shape[:flagged.ndim]
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name


def test_kill_and_resume_gives_identical_arrays(tmp_path, ref_store):
    """SIGKILL three times at random moments (after 1-12 more steps were flagged done, plus 0-50 ms), then resume.

    Chunks of 3 steps (blocks 0-2, 3-5 and a short 6-7) against a reference stored with the automatic chunking."""
    out, rng, kills = tmp_path / "run.zarr", np.random.default_rng(0), 0
    for attempt in range(4):
        proc = _cli(out, "--steps-per-chunk", "3", *(["--resume"] if attempt else []))
        if attempt < 3:
            target, delay = _done_count(out) + int(rng.integers(1, 13)), float(rng.uniform(0, 0.05))
            while proc.poll() is None and _done_count(out) < target:
                time.sleep(0.002)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            with pytest.warns(IncompleteRunWarning):
                ds = open_run(out)                                      # opens, incomplete steps reported
            assert ds.attrs["incomplete"] and np.isnan(ds["dec_k"].values[~ds["done"].values]).all()
            _assert_flagged_data_match(out, ref_store)
    assert proc.returncode == 0, _err(proc)
    assert kills >= 2
    _assert_same_store(out, ref_store)


def test_four_shards_write_one_store_concurrently(tmp_path, ref_store):
    out = tmp_path / "sharded.zarr"
    procs = [_cli(out, "--shard", f"{i}/4") for i in range(4)]
    for p in procs:
        assert p.wait() == 0, _err(p)
    _assert_same_store(out, ref_store)


def test_full_disk_reports_clearly_and_leaves_a_consistent_store(tmp_path, ref_store, monkeypatch, capsys):
    """ENOSPC from zarr's chunk write (after 40 chunk files): clear error, store consistent, resume completes."""
    out, calls, real = tmp_path / "full.zarr", [0], zarr.storage._local._put

    def put(path, value, *args, **kwargs):
        if "/c." in str(path).replace(os.sep, "/"):  # a chunk (flat keys: c.0.1...), not metadata
            calls[0] += 1
            if calls[0] > 40:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, value, *args, **kwargs)

    monkeypatch.setattr(zarr.storage._local, "_put", put)
    import gc
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["record", *CLI, "--out", str(out)]) == 2
        gc.collect()
    # issue 19: the flag writes of a failed batch were coroutines created and dropped unawaited
    assert not [w for w in caught if "never awaited" in str(w.message)]
    err = capsys.readouterr().err
    assert "No space left on device" in err and "the disk is full" in err and "--resume" in err
    with pytest.warns(IncompleteRunWarning, match="incomplete"):
        ds = open_run(out)
    first_bad = ds.attrs["incomplete"][0]
    assert np.isnan(ds["dec_k"].sel(sample=first_bad[0], step=first_bad[1]).values).all()
    assert not ds["complete"].values.all()
    _assert_flagged_data_match(out, ref_store)
    monkeypatch.setattr(zarr.storage._local, "_put", real)
    assert main(["record", *CLI, "--out", str(out)]) == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert main(["record", *CLI, "--out", str(out), "--resume"]) == 0
    _assert_same_store(out, ref_store)


def test_schema_version_and_non_store_errors(tmp_path, ref_store):
    with pytest.raises(SchemaError, match="not a zarr v3 group|no 'schema_version'"):
        open_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        open_run(tmp_path / "missing.zarr")
    copy = tmp_path / "copy.zarr"
    subprocess.run(["cp", "-r", str(ref_store), str(copy)], check=True)
    zarr.open_group(str(copy), mode="r+").attrs["schema_version"] = 99
    with pytest.raises(SchemaError, match=r"schema version 99, this mar_probe reads versions \(1, 2\)"):
        open_run(copy)


@pytest.mark.parametrize("extra, message", [
    (["--vars", "dec_x"], "unknown variable(s) ['dec_x']; expected some of"),
    (["--layers", "0,5"], "layer(s) [5] out of range: expected indices in 0..1"),
    (["--steps", "8"], "step(s) [8] out of range"),
    (["--shard", "4/4"], "0 <= I < N"),
    (["--branches", "neither"], "subset of ('cond', 'uncond')"),
])
def test_cli_bad_inputs(tmp_path, capsys, extra, message):
    assert main(["record", *CLI, "--out", str(tmp_path / "x.zarr"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.zarr").exists()


def test_cli_dry_run_existing_store_and_mismatched_resume(tmp_path, ref_store, capsys):
    assert main(["record", *CLI, "--out", str(tmp_path / "d.zarr"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dec_k" in out and "total" in out and not (tmp_path / "d.zarr").exists()
    sizes = estimate_size(SelectionSpec(variables=VARS, layers=(1,)), _model(), 8, 8, cfg=2.0,
                          images=image_shape(_model()))
    lines = {ln.split()[0]: ln.split(None, 1)[1].strip() for ln in out.splitlines() if ln.strip()}
    assert all(lines[name] == format_bytes(n) for name, n in sizes.items())
    assert lines["enc_v"] == format_bytes(8 * 8 * 2 * 1 * (4 + 64) * 2 * 16 * 2)   # float16 [S, T, nb, 1, N, H, Dh]
    assert lines["chunks:"].startswith("8 step(s) of one sample per chunk, the largest 68.0 KiB")  # 8 x enc_v step
    assert main(["record", *CLI, "--out", str(tmp_path / "d.zarr"), "--dry-run", "--strategy", "fewer-steps",
                 "--strategy-opt", "num_iter=4"]) == 0
    assert "8 samples x 4 steps" in capsys.readouterr().out
    assert main(["record", *CLI, "--out", str(ref_store)]) == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert main(["record", *CLI, "--cfg", "3.0", "--out", str(ref_store), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written by another model or configuration" in err and "sampling" in err
    assert main(["record", *CLI, "--out", str(tmp_path / "none.zarr"), "--resume"]) == 0  # issue 19: starts it
    assert "does not exist yet: starting it" in capsys.readouterr().err
    _assert_same_store(tmp_path / "none.zarr", ref_store)
    other = [a if a != "mar_tiny" else "mar_tiny_latent" for a in CLI]       # another model, same settings
    assert main(["record", *other, "--out", str(ref_store), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written by another model or configuration" in err and "model_config" in err and "weights_sha256" in err
    assert main(["record", *CLI, "--out", str(ref_store), "--resume", "--shard", "1/2"]) == 0  # all complete
    assert "0 samples (4 already complete)" in capsys.readouterr().out


def test_steps_per_chunk_sets_chunks_and_keeps_values(tmp_path, ref_store):
    """Chunks of 3 steps (the last one short) hold the same values as the automatic chunking (one block of 8)."""
    _record_ref(tmp_path / "three.zarr", steps_per_chunk=3)
    got, ref = zarr.open_group(str(tmp_path / "three.zarr"), mode="r"), zarr.open_group(str(ref_store), mode="r")
    assert got["dec_k"].chunks[:2] == got["done"].chunks == got["mask"].chunks[:2] == (1, 3)
    assert ref["dec_k"].chunks[:2] == (1, 8) and ref["tokens"].chunks[0] == 1
    assert sorted(os.listdir(tmp_path / "three.zarr" / "done"))[:3] == ["c.0.0", "c.0.1", "c.0.2"]  # flat keys
    _assert_same_store(tmp_path / "three.zarr", ref_store)
    with pytest.raises(ValueError, match=r"steps_per_chunk must be an integer >= 1 \(or None for automatic\), got 0"):
        _record_ref(tmp_path / "zero.zarr", steps_per_chunk=0)


def test_auto_steps_per_chunk_keeps_chunks_within_the_target():
    from mar_probe.store.spec import ACTIVATIONS
    from mar_probe.store.schema import CHUNK_TARGET_BYTES, ModelDims, auto_steps_per_chunk, resolve
    m = _model()
    small = resolve(SelectionSpec(variables="dec_k", layers=(1,)), m, num_samples=2, num_iter=64, cfg=2.0)
    step = 2 * 1 * (4 + 64) * 2 * 16 * 2                                 # float16 [branch, layer, N, H, Dh]
    assert small.steps_per_chunk == 64 and small.variables["dec_k"].chunks[:2] == (1, 64)   # 64 x 17 KiB < 4 MiB
    dims = ModelDims.from_model(mar_probe.create_model())  # the embedded default's shapes (fashion_b128)
    full = resolve(SelectionSpec(variables=ACTIVATIONS), dims, num_samples=2, num_iter=64, cfg=3.0)
    light = resolve(SelectionSpec(variables="dec_k,dec_v,z_cfg_resid,attn_gen", layers=(1, 2)), dims, num_samples=2,
                    num_iter=64, cfg=3.0)
    # the largest per-step variable: 1.875 MiB of all of them (a float16 [2, 12, 320, 128] hidden state) and 0.3125
    # MiB of the light selection ([2, 2, 320, 2, 64] dec_k): 2 and 8 steps stay within 4 MiB, 4 and 16 would not
    assert (full.steps_per_chunk, light.steps_per_chunk) == (2, 8)
    for lay in (full, light):
        assert max(v.step_nbytes for v in lay.variables.values() if v.per_step) * lay.steps_per_chunk \
            <= CHUNK_TARGET_BYTES
    assert auto_steps_per_chunk(small.variables, 64, target=5 * step) == 4      # largest power of two that fits
    assert auto_steps_per_chunk(small.variables, 64, target=step - 1) == 1      # one step already exceeds it
    assert auto_steps_per_chunk(small.variables, 3, target=10 * step) == 2      # at most the steps of the run


def test_writer_closed_mid_block_keeps_the_steps_it_has(tmp_path):
    """An interrupted run (writer closed with an open block): steps 0-5 written and flagged, 6-7 fill and not done."""
    from mar_probe.probe import Probe
    from mar_probe.probe.record import sample_seeds
    from mar_probe.store.schema import resolve
    from mar_probe.store.writer import StoreWriter, create_store
    m, spec = _model(), SelectionSpec(variables="dec_k,z", layers=(1,))
    probe = Probe.for_run(m, spec, num_samples=1, num_iter=8, cfg=2.0)
    probe.begin_batch([0])
    with probe.attached():
        mar_probe.sample(m, [3], num_iter=8, cfg=2.0, seed=0, observers=[probe])
    layout = resolve(spec, m, num_samples=1, num_iter=8, cfg=2.0, steps_per_chunk=4)
    create_store(tmp_path / "w.zarr", layout, labels=np.array([3]), seeds=sample_seeds(0, 1), attrs={})
    writer = StoreWriter(tmp_path / "w.zarr", layout)
    for rec in probe.records[:6]:
        writer.put_step(rec)
    writer.close()
    g = zarr.open_group(str(tmp_path / "w.zarr"), mode="r")
    assert g["done"][0].tolist() == [True] * 6 + [False] * 2 and not g["complete"][0]
    for t, rec in enumerate(probe.records[:6]):
        assert np.array_equal(g["dec_k"][0, t], rec.arrays["dec_k"][0], equal_nan=True)
    assert np.isnan(g["dec_k"][0, 6:]).all() and not g["mask"][0, 6:].any()
    assert writer.bytes_logical == sum(a.nbytes for r in probe.records[:6] for a in r.arrays.values())
