"""Training on the accelerator machine (issue 14): the device option of training and benchmarks/device_train.py,
which moves the training split over two calls of at most 64 MiB and brings the export back in parts of 16 MiB.
Run here on the CPU (``--device cpu``): the same steps a GPU session runs, with a fake split and small parts."""
import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mar_probe.cli import main
from mar_probe.train import TrainConfig, training_device

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_train as DT  # noqa: E402


def _fake_split(folder: Path, n: int = 16) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir()
    for stem, array in (("train-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28))),
                        ("train-labels-idx1-ubyte", rng.integers(0, 10, n))):
        header = bytes([0, 0, 8, array.ndim]) + b"".join(int(k).to_bytes(4, "big") for k in array.shape)
        with gzip.open(folder / f"{stem}.gz", "wb") as f:
            f.write(header + array.astype(np.uint8).tobytes())
    return folder


def _flags(tmp_path: Path) -> list[str]:
    return ["--preset", "fashion_small", "--out", str(tmp_path / "run"), "--iters", "2", "--batch-size", "4",
            "--warmup-iters", "1", "--threads", "1", "--device", "cpu", "--export", str(tmp_path / "run" / "e.pth")]


def test_two_calls_train_and_the_export_comes_back_byte_for_byte(tmp_path):
    stage, machine, out = tmp_path / "stage", tmp_path / "machine", tmp_path / "out"
    manifest = DT.pack(_fake_split(tmp_path / "data"), stage, budget=7000)
    parts = [stage / f"split.part-{i}" for i in range(len(manifest.parts))]
    assert len(parts) >= 2 and all(p.stat().st_size <= 7000 for p in parts)
    assert sorted(p.name for p in stage.iterdir()) == sorted([p.name for p in parts] + ["split.manifest.json"])
    # call 1 carries part 0 only; call 2 the rest (the repository copy keeps no part between calls here)
    held = {p: p.read_bytes() for p in parts}
    for p in parts[1:]:
        p.unlink()
    assert DT.stage_parts(stage, machine) == [0]
    parts[0].unlink()
    for p in parts[1:]:
        p.write_bytes(held[p])
    assert DT.main(["train", "--stage", str(stage), "--machine-stage", str(machine), "--out", str(out), "--",
                    *_flags(tmp_path)]) == 0
    back = DT.write_parts(tmp_path / "run" / "e.pth", tmp_path / "small", limit=2**20)  # forced into parts
    assert len(back.parts) >= 2 and (tmp_path / "small" / "e.pth.manifest.json").is_file()
    joined = DT.unpack(tmp_path / "small", tmp_path / "joined.pth")
    assert joined.read_bytes() == (tmp_path / "run" / "e.pth").read_bytes()
    assert DT.unpack(out, tmp_path / "j2.pth").read_bytes() == joined.read_bytes()
    assert (out / "loss_history.json").is_file()
    assert (tmp_path / "j2.history.pth").read_bytes() == (tmp_path / "run" / "e.history.pth").read_bytes()


def test_a_missing_or_damaged_part_says_what_to_do(tmp_path):
    stage, machine = tmp_path / "stage", tmp_path / "machine"
    DT.pack(_fake_split(tmp_path / "data"), stage, budget=7000)
    (stage / "split.part-0").unlink()
    DT.stage_parts(stage, machine)
    with pytest.raises(DT.StageError, match=r"parts \[0\] of \d+ of 'split' are not in .*given back.*`stage` call"):
        DT.join_data(stage, machine)
    (stage / "split.part-1").write_bytes(b"damaged")
    with pytest.raises(DT.StageError, match=r"split.part-1' does not match its manifest.*got 7 bytes"):
        DT.stage_parts(stage, machine)
    with pytest.raises(DT.StageError, match="need --export PATH"):
        DT.run_training(["--out", "x"], tmp_path, tmp_path)
    export = tmp_path / "e.pth"
    export.write_bytes(Path(DT.__file__).read_bytes())  # bytes enough for several parts
    with pytest.raises(DT.StageError, match=r"'.*e.pth' has no loss history beside it \('.*e.history.pth'\)"):
        DT.write_parts(export, tmp_path / "ret", limit=4000)
    (tmp_path / "e.history.pth").write_bytes(b"h")
    DT.write_parts(export, tmp_path / "ret", limit=4000)
    (tmp_path / "ret" / "e.history.pth").unlink()
    with pytest.raises(DT.StageError, match=r"loss history '.*ret/e.history.pth' is missing .*fetch the call's"):
        DT.unpack(tmp_path / "ret", tmp_path / "x.pth")
    (tmp_path / "ret" / "e.pth.part-1").unlink()
    with pytest.raises(DT.StageError, match=r"parts \[1\] of \d+ of 'e.pth'.*fetch the call's files"):
        DT.unpack(tmp_path / "ret", tmp_path / "x.pth")
    (tmp_path / "ret" / "e.pth.manifest.json").unlink()
    with pytest.raises(DT.StageError, match=r"expected one export manifest .* found \[\]"):
        DT.unpack(tmp_path / "ret", tmp_path / "x.pth")


def test_a_manifest_whose_whole_disagrees_with_its_parts_is_refused(tmp_path):
    """Each part matches its SHA-256, but the whole-file SHA-256 is another file's (a manifest edited or mixed up):
    the joined bytes are refused, not written."""
    made = DT.write_split(b"a" * 10 + b"b" * 10, tmp_path, name="x", part_bytes=10)
    assert len(made.parts) == 2 and DT.join_split(made, tmp_path, when_missing="-") == b"a" * 10 + b"b" * 10
    mixed = DT.Manifest(name="x", bytes=20, sha256=DT.sha256(b"a" * 10 + b"c" * 10), parts=made.parts)
    with pytest.raises(DT.StageError, match=r"joined parts of 'x' \(20 bytes\) do not match the manifest"):
        DT.join_split(mixed, tmp_path, when_missing="-")


def test_pack_refuses_a_call_without_room_and_a_folder_without_the_split(tmp_path):
    with pytest.raises(DT.StageError, match="no room for data"):
        DT.pack(_fake_split(tmp_path / "data"), tmp_path / "s", budget=0)
    with pytest.raises(DT.StageError, match="'train-images-idx3-ubyte'.*not found"):
        DT.pack(tmp_path, tmp_path / "s", budget=10**6)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "cpu:0", "tpu"])
def test_bad_device_names_are_refused_with_the_valid_ones(bad):
    with pytest.raises(ValueError, match=rf"'cpu', 'cuda' or 'cuda:N'.*got {bad!r}"):
        TrainConfig(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA: the refusal")
def test_cuda_on_a_machine_without_one_is_refused_before_any_folder(tmp_path, capsys):
    with pytest.raises(RuntimeError, match=r"device='cuda' but this machine has 0 CUDA device"):
        training_device(TrainConfig(device="cuda"))
    assert training_device(TrainConfig(device="cpu")) == torch.device("cpu")


def test_the_train_command_trains_without_importing_zarr(tmp_path, capsys):
    """The accelerator machine has torch but not zarr: `train_main` trains without loading the store."""
    code = ("import sys; from mar_probe.cli import train_main; "
            f"train_main(['--preset', 'mar_tiny', '--dataset', 'digits', '--out', {str(tmp_path / 'r')!r}, "
            "'--iters', '1', '--batch-size', '4', '--threads', '1', '--device', 'cpu']); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('zarr', 'xarray', 'dask')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    assert (tmp_path / "r" / "checkpoint-last.pth").is_file()
    assert main(["train", "--device", "gpu", "--out", str(tmp_path / "bad")]) == 2  # the full CLI refuses it too
    assert "--device must be 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_the_train_command_words_a_failed_write_where_zarr_is_missing(tmp_path):
    """On the accelerator machine (no zarr), a failed write of `mar-probe train` is one line naming the error, as
    under the full CLI, not an ImportError from wording it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = ("import sys; sys.modules['zarr'] = None; from mar_probe.cli import train_main; "
            f"sys.exit(train_main(['--preset', 'mar_tiny', '--dataset', 'digits', '--out', {str(blocker / 'r')!r}, "
            "'--iters', '1', '--batch-size', '4', '--threads', '1', '--device', 'cpu']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("mar-probe train: error: NotADirectoryError: ") and str(blocker) in done.stderr
    assert "Traceback" not in done.stderr


def test_a_fitted_phase_sizes_its_iterations_from_a_pilot_and_records_it(tmp_path):
    """`--fit-minutes`: a pilot in a scratch folder measures seconds per iteration, and the phase's --iters (the
    cosine schedule's length) is what fits; the pilot leaves the phase's own folder and export untouched."""
    data, out = _fake_split(tmp_path / "data"), tmp_path / "out"
    flags = _flags(tmp_path)
    fit = DT.fit_iterations(flags, data, 0.05, pilot=4)
    # Two-sided but loose: beside a training run on the other core a pilot iteration measured 4.8 s (idle: < 1 s).
    assert fit.pilot_iterations == 4 and 0 < fit.seconds_per_iteration < 30
    assert fit.iters == max(1, int(3 / fit.seconds_per_iteration))
    assert (tmp_path / "fit_pilot" / "checkpoint-last.pth").is_file() and not (tmp_path / "run").exists()
    # pilot=4: the default 64-iteration pilot took 355 s of the suite under load (ship_rehearsal_b128_p26.json)
    DT.run_training(DT._set_flag(flags, "--max-minutes", "0.02"), data, out, fit_minutes=0.01, pilot=4)
    recorded = DT.json.loads((out / "fit.json").read_text())
    assert recorded["minutes"] == 0.01 and recorded["iters"] >= 1 and recorded["pilot_iterations"] == 4
    history = DT.json.loads((out / "loss_history.json").read_text())
    assert history and history[-1][0] + 1 <= recorded["iters"]
    with pytest.raises(DT.StageError, match=r"--fit-minutes must be a finite number > 0.*got -1.0 and 64"):
        DT.fit_iterations(flags, data, -1.0)


def test_flags_are_set_and_dropped_by_name():
    assert DT._set_flag(["--a", "1", "--b", "2"], "--a", "9") == ["--a", "9", "--b", "2"]
    assert DT._set_flag(["--b", "2"], "--a", "9") == ["--b", "2", "--a", "9"]
    assert DT._drop_flag(["--a", "1", "--b", "2"], "--a") == ["--b", "2"]
    assert DT._drop_flag(["--b", "2"], "--a") == ["--b", "2"]
