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
    assert len(manifest["parts"]) >= 2 and all((stage / f"part-{i}").stat().st_size <= 7000
                                                for i in range(len(manifest["parts"])))
    # call 1 carries part 0 only; call 2 the rest (the repository copy keeps no part between calls here)
    held = {i: (stage / f"part-{i}").read_bytes() for i in range(len(manifest["parts"]))}
    for i in range(1, len(held)):
        (stage / f"part-{i}").unlink()
    assert DT.stage_parts(stage, machine) == [0]
    (stage / "part-0").unlink()
    for i in range(1, len(held)):
        (stage / f"part-{i}").write_bytes(held[i])
    assert DT.main(["train", "--stage", str(stage), "--machine-stage", str(machine), "--out", str(out), "--",
                    *_flags(tmp_path)]) == 0
    back = DT.write_parts(tmp_path / "run" / "e.pth", tmp_path / "small", limit=2**20)  # forced into parts
    assert back["parts"] >= 2
    joined = DT.unpack(tmp_path / "small", tmp_path / "joined.pth")
    assert joined.read_bytes() == (tmp_path / "run" / "e.pth").read_bytes()
    assert DT.unpack(out, tmp_path / "j2.pth").read_bytes() == joined.read_bytes()
    assert (out / "loss_history.json").is_file()


def test_a_missing_or_damaged_part_says_what_to_do(tmp_path):
    stage, machine = tmp_path / "stage", tmp_path / "machine"
    DT.pack(_fake_split(tmp_path / "data"), stage, budget=7000)
    (stage / "part-0").unlink()
    DT.stage_parts(stage, machine)
    with pytest.raises(DT.StageError, match=r"parts \[0\] of \d+ are not on this machine.*`stage` call again"):
        DT.join_data(stage, machine)
    (stage / "part-1").write_bytes(b"damaged")
    with pytest.raises(DT.StageError, match="part-1' does not match the manifest"):
        DT.stage_parts(stage, machine)
    with pytest.raises(DT.StageError, match="need --export PATH"):
        DT.run_training(["--out", "x"], tmp_path, tmp_path)
    DT.write_parts(Path(DT.__file__), tmp_path / "ret", limit=4000)
    (tmp_path / "ret" / "device_train.py.part-1").unlink()
    with pytest.raises(DT.StageError, match="parts not returned"):
        DT.unpack(tmp_path / "ret", tmp_path / "x.pth")


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
