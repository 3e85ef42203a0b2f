"""Train issue 14's model on the accelerator machine of the ``device`` tool, whose calls carry at most 64 MiB.

Issue 14: "Where a session has the accelerator machine, train there instead (minutes there are worth hours here)".
That machine reaches nothing outside it and has torch but not zarr. A call sends the working tree (tracked files,
two models among them) plus carried ignored paths, 64 MiB in all, and brings back at most 8 files of 16 MiB. So the
Fashion-MNIST training split travels in parts sized to what a call has room for (``pack`` measures it), staged on the
machine between calls (it goes back 30 s after a call: make the next call at once; one ``stage`` call per part but
the last), and the export, larger than 16 MiB, comes back in parts:

    python benchmarks/device_train.py pack        # here: .stage/part-0, part-1, manifest.json (git-ignored)
    # device call 1, carry [".stage/part-0", ".stage/manifest.json"]:
    python3 benchmarks/device_train.py stage
    # device call 2, at once, carry [".stage/part-1", ".stage/manifest.json"], timeout_s 600:
    python3 benchmarks/device_train.py train -- --preset fashion_b128 --init data/training/fashion_b128.pth \\
        --out runs/fb128_gpu --device cuda --max-minutes 6 ... --export runs/fb128_gpu/fashion_b128.pth
    # here, from the folder the tool put the returned files in (files_at):
    python benchmarks/device_train.py unpack FILES_AT runs/fb128_gpu/fashion_b128.pth

``train`` stages what its call carried, joins and checks the parts (SHA-256), runs ``mar-probe train`` on them
(the flags after ``--``, ``--data`` set to the joined split; :func:`mar_probe.cli.train_main`, which needs no zarr)
and writes the export in parts with a manifest, the loss history and the loss curve into ``$OUT``. ``unpack`` joins
the parts, checks them against the manifest and that the file loads as a checkpoint. Every step runs on the CPU
too (``--device cpu``), which is how the tests run it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20  # what one call of the device tool carries: the working tree and the carried paths
RETURN_LIMIT = 16 * 2**20  # the largest file a call brings back
MARGIN = 2**20  # for files that appear between packing and the call (a log, a result)
MACHINE_STAGE = Path("/tmp/mar_probe_stage")  # outside the repository copy: kept while the machine stays warm


class StageError(RuntimeError):
    """A part is missing or damaged, or the data does not fit in the calls."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def split_bytes(data: bytes, parts: int) -> list[bytes]:
    size = math.ceil(len(data) / parts)
    return [data[i * size:(i + 1) * size] for i in range(parts)]


def pack(data_dir: Path, stage: Path, budget: int) -> dict:
    """Tar the training split's files and write it to ``stage`` in parts of at most ``budget`` bytes, with a
    manifest of each part's and the whole's SHA-256."""
    from mar_probe.data import DatasetError, fashion_files
    try:
        files = fashion_files("train", data_dir)
    except DatasetError as exc:
        raise StageError(str(exc)) from exc
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # the IDX files are gzip-compressed already
        for path in files:
            tar.add(path, arcname=path.name)
    data = buf.getvalue()
    if budget <= 0:
        raise StageError(f"a call has no room for data: the working tree alone is within {MARGIN} bytes of "
                         f"{CALL_LIMIT} (64 MiB); ignore or carry less")
    parts = split_bytes(data, math.ceil(len(data) / budget))
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for i, part in enumerate(parts):
        (stage / f"part-{i}").write_bytes(part)
    manifest = {"sha256": sha256(data), "bytes": len(data), "parts": [sha256(p) for p in parts],
                "files": [path.name for path in files]}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stage_parts(stage: Path, machine: Path) -> list[int]:
    """Copy the parts this call carried to the machine's stage folder, each checked; return the indices staged."""
    manifest = json.loads((stage / "manifest.json").read_text())
    machine.mkdir(parents=True, exist_ok=True)
    staged = []
    for i, want in enumerate(manifest["parts"]):
        path = stage / f"part-{i}"
        if path.is_file():
            if sha256(path.read_bytes()) != want:
                raise StageError(f"{str(path)!r} does not match the manifest (SHA-256 {want[:12]!r}...): pack again")
            shutil.copyfile(path, machine / f"part-{i}")
            staged.append(i)
    return staged


def join_data(stage: Path, machine: Path) -> Path:
    """Join the staged parts, check them and unpack the split into ``machine/fashion``; return that folder."""
    manifest = json.loads((stage / "manifest.json").read_text())
    missing = [i for i in range(len(manifest["parts"])) if not (machine / f"part-{i}").is_file()]
    if missing:
        raise StageError(f"parts {missing!r} of {len(manifest['parts'])} are not on this machine ({str(machine)!r}): "
                         "it was given back between the calls (30 s after each); make the `stage` call again and "
                         "this one at once after it")
    data = b"".join((machine / f"part-{i}").read_bytes() for i in range(len(manifest["parts"])))
    if sha256(data) != manifest["sha256"]:
        raise StageError(f"the joined parts ({len(data)} bytes) do not match the manifest's SHA-256 "
                         f"({manifest['bytes']} bytes): pack again and stage both parts")
    folder = machine / "fashion"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def write_parts(path: Path, out: Path, limit: int = RETURN_LIMIT) -> dict:
    """Write ``path`` into ``out`` in parts of at most ``limit`` bytes, with a manifest."""
    data = path.read_bytes()
    parts = split_bytes(data, max(1, math.ceil(len(data) / limit)))
    out.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(parts):
        (out / f"{path.name}.part-{i}").write_bytes(part)
    manifest = {"name": path.name, "sha256": sha256(data), "bytes": len(data), "parts": len(parts)}
    (out / "export_manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(folder: Path, dest: Path) -> Path:
    """Join the export's parts from ``folder`` into ``dest``, checked against the manifest and loaded once."""
    manifest = json.loads((folder / "export_manifest.json").read_text())
    names = [folder / f"{manifest['name']}.part-{i}" for i in range(manifest["parts"])]
    missing = [str(n) for n in names if not n.is_file()]
    if missing:
        raise StageError(f"parts not returned: {missing!r}; fetch the call's files again")
    data = b"".join(n.read_bytes() for n in names)
    if sha256(data) != manifest["sha256"]:
        raise StageError(f"the joined export ({len(data)} bytes) does not match its manifest "
                         f"({manifest['bytes']} bytes)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    from mar_probe.models.checkpoints import read_checkpoint
    if "model_ema" not in read_checkpoint(dest):
        raise StageError(f"{str(dest)!r} holds no 'model_ema': not an export of `mar-probe train --export`")
    return dest


def run_training(flags: list[str], data: Path, out: Path) -> Path:
    """``mar-probe train FLAGS --data DATA``; then the export in parts and the loss history/curve into ``out``."""
    from mar_probe.cli import train_main
    export = _flag(flags, "--export")
    run_dir = Path(_flag(flags, "--out"))
    code = train_main([*flags, "--data", str(data)])
    if code:
        raise StageError(f"mar-probe train exited with {code}")
    write_parts(Path(export), out)
    for name in ("loss_history.json", "loss_curve.png"):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    return Path(export)


def _flag(flags: list[str], name: str) -> str:
    if name not in flags or flags.index(name) + 1 >= len(flags):
        raise StageError(f"the training flags need {name} PATH (got {flags!r}): --export names the file that comes "
                         "back, --out the run folder whose loss history comes with it")
    return flags[flags.index(name) + 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["pack", "stage", "train", "unpack"])
    p.add_argument("paths", nargs="*", help="unpack: FOLDER DEST")
    p.add_argument("--data", type=Path, default=Path("/usr/share/datasets/fashion-mnist"),
                   help="pack: the folder of the training split's IDX files")
    p.add_argument("--stage", type=Path, default=ROOT / ".stage", help="the carried folder (default: .stage)")
    p.add_argument("--machine-stage", type=Path, default=MACHINE_STAGE, help="where the machine keeps the parts")
    p.add_argument("--budget", type=int, help="pack: bytes per part (default: what a call has room for)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/device_out")),
                   help="train: where the returned files go (default: $OUT)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": the flags of `mar-probe train`
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    if flags and args.step != "train":
        p.error(f"only `train` takes flags after '--', got {flags!r} for {args.step!r}")
    if args.step == "pack":
        budget = args.budget or CALL_LIMIT - tree_bytes() - MARGIN
        m = pack(args.data, args.stage, budget)
        print(f"packed {m['files']} ({m['bytes']} bytes) into {len(m['parts'])} parts in {args.stage}")
    elif args.step == "stage":
        print(f"staged parts {stage_parts(args.stage, args.machine_stage)} in {args.machine_stage}")
    elif args.step == "train":
        stage_parts(args.stage, args.machine_stage)
        export = run_training(flags, join_data(args.stage, args.machine_stage), args.out)
        print(f"trained; {export} is in {args.out} in parts (export_manifest.json)")
    else:
        if len(args.paths) != 2:
            p.error(f"unpack needs FOLDER DEST, got {args.paths!r}")
        print(f"joined and checked {unpack(Path(args.paths[0]), Path(args.paths[1]))}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the device machine runs it from the repository copy, mar_probe not installed
    sys.exit(main())
