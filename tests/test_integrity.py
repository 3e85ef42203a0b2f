"""Damage to a finished store is found (verify, open_run) and repaired to identical arrays (issue 19)."""
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mar_probe.store import DamagedRunWarning, open_run, verify
from mar_probe.store.writer import StoreDamagedError
from test_store import _assert_same_store, _record_ref


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _record_ref(path)
    return path


def _chunk(store, variable: str, index: int):
    return store / variable / sorted(f for f in os.listdir(store / variable) if f != "zarr.json")[index]


def _delete(store, variable, index):
    _chunk(store, variable, index).unlink()


def _garbage(store, variable, index):
    _chunk(store, variable, index).write_bytes(b"not a chunk" * 7)


# (what is done to which variable's chunk, how verify reports it); the reference store has 8 samples, 8 steps
DAMAGE = [(_delete, "dec_k", 3, "missing"), (_garbage, "z_cfg_resid", 2, "corrupt"),
          (_garbage, "done", 5, "corrupt"), (_delete, "images", 1, "missing"), (_garbage, "tokens", 6, "corrupt"),
          (_delete, "mask", 0, "missing"), (_garbage, "attn_gen", 7, "corrupt")]


def test_a_fresh_store_verifies_ok_and_carries_checksums(ref_store):
    import zarr
    report = verify(ref_store)
    assert report.ok and report.chunks_checked > 8 * 8 and report.format().endswith("listed and decoded)")
    codecs = [c.to_dict()["name"] for c in zarr.open_array(str(ref_store / "dec_k")).metadata.codecs]
    assert codecs[-1] == "crc32c"


@pytest.mark.parametrize("damage, variable, index, kind", DAMAGE, ids=[f"{d[0].__name__}-{d[1]}" for d in DAMAGE])
def test_damage_is_found_reported_and_repaired(tmp_path, ref_store, damage, variable, index, kind):
    store = tmp_path / "run.zarr"
    shutil.copytree(ref_store, store)
    damage(store, variable, index)
    report = verify(store)
    assert [(d.variable, d.row, d.kind) for d in report.damages] == [(variable, index, kind)]
    assert report.samples == (index,) and not report.ok
    _assert_open_run_reports(store, kind, variable)
    _record_ref(store, resume=True, repair=True)
    _assert_same_store(store, ref_store)
    assert verify(store).ok


def _assert_open_run_reports(store, kind, variable):
    if kind == "missing":
        with pytest.warns(DamagedRunWarning, match="chunks of finished steps or samples are missing"):
            ds = open_run(store)
        assert ds.attrs["damaged"]
        return
    with pytest.raises(StoreDamagedError, match=r"is damaged: .*--resume --repair"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _ = open_run(store)[variable].values  # decoding raises


def test_resume_without_repair_on_damaged_flags_says_what_to_do(tmp_path, ref_store):
    store = tmp_path / "run.zarr"
    shutil.copytree(ref_store, store)
    _garbage(store, "complete", 0)
    with pytest.raises(StoreDamagedError, match=r"mar-probe verify .*--resume --repair"):
        _record_ref(store, resume=True)


def test_repair_needs_resume_and_writes_nothing_without_it(tmp_path):
    with pytest.raises(ValueError, match="--repair re-records the damaged samples of an existing store: give it "
                                         "with --resume"):
        _record_ref(tmp_path / "new.zarr", repair=True)
    assert not any(tmp_path.iterdir())


def test_verify_cli_exit_codes(tmp_path, ref_store):
    store = tmp_path / "run.zarr"
    shutil.copytree(ref_store, store)
    cmd = [sys.executable, "-m", "mar_probe.cli", "verify", str(store)]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0 and ": ok (" in ok.stdout
    _delete(store, "dec_k", 0)
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1 and "DAMAGED: 1 of" in bad.stdout
    assert "missing  dec_k (row 0, step block 0)" in bad.stdout
    assert "Traceback" not in bad.stderr


def test_resume_starts_a_missing_store_and_clears_dead_temporaries(tmp_path, ref_store, capsys):
    store = tmp_path / "run.zarr"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".run.zarr.tmp-{int(dead.stdout)}"  # left by a process killed while creating the store
    (stale / "dec_k").mkdir(parents=True)
    live = tmp_path / f".run.zarr.tmp-{os.getpid()}-other"  # not a pid suffix: never touched
    live.mkdir()
    _record_ref(store, resume=True)
    assert "does not exist yet: starting it" in capsys.readouterr().err
    assert not stale.exists() and live.exists()
    _assert_same_store(store, ref_store)
    assert np.asarray(open_run(store)["done"]).all()


def test_resume_without_repair_warns_about_missing_chunks(tmp_path, ref_store, capsys):
    store = tmp_path / "run.zarr"
    shutil.copytree(ref_store, store)
    _delete(store, "dec_k", 4)
    _record_ref(store, resume=True)
    err = capsys.readouterr().err
    assert "warning: 1 chunks of finished steps are missing" in err and "(samples [4])" in err and "--repair" in err


def test_a_lost_done_chunk_reads_as_unfinished_and_resume_redoes_it(tmp_path, ref_store):
    store = tmp_path / "run.zarr"
    shutil.copytree(ref_store, store)
    _delete(store, "done", 2)
    assert verify(store).ok  # no data lost: the steps only count as unfinished
    _record_ref(store, resume=True)
    _assert_same_store(store, ref_store)
