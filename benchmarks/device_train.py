"""Train issue 14's model on the accelerator machine of the ``device`` tool, whose calls carry at most 64 MiB.

Issue 14: "Where a session has the accelerator machine, train there instead (minutes there are worth hours here)".
That machine reaches nothing outside it and has torch but not zarr. A call sends the working tree (tracked files,
two models among them) plus carried ignored paths, 64 MiB in all, and brings back at most 8 files of 16 MiB. So the
Fashion-MNIST training split travels in parts sized to what a call has room for (``pack`` measures it), staged on the
machine between calls (it goes back 30 s after a call: make the next call at once; one ``stage`` call per part but
the last), and the export, larger than 16 MiB, comes back in parts:

    python benchmarks/device_train.py pack        # here: .stage/split.part-0, split.part-1, split.manifest.json
    # device call 1, carry [".stage/split.part-0", ".stage/split.manifest.json"]:
    python3 benchmarks/device_train.py stage
    # device call 2, at once, carry [".stage/split.part-1", ".stage/split.manifest.json"], timeout_s 600:
    python3 benchmarks/device_train.py train -- --preset fashion_b128 --init data/fashion_b128.pth \\
        --out runs/fb128_gpu --device cuda --max-minutes 6 ... --export runs/fb128_gpu/fashion_b128.pth
    # here, from the folder the tool put the returned files in (files_at):
    python benchmarks/device_train.py unpack FILES_AT runs/fb128_gpu/fashion_b128.pth

Both directions use one format (:class:`Manifest`: each part's and the whole's SHA-256). ``train`` stages what
its call carried, joins and checks the parts, runs ``mar-probe train`` on them
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
import statistics
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20  # what one call of the device tool carries: the working tree and the carried paths
RETURN_LIMIT = 16 * 2**20  # the largest file a call brings back
MARGIN = 2**20  # for files that appear between packing and the call (a log, a result)
MACHINE_STAGE = Path("/tmp/mar_probe_stage")  # outside the repository copy: kept while the machine stays warm
# iterations of the run that measures this machine's speed before a fitted phase. On the H200 (2026-12-04) a
# 24-iteration pilot, the call's first use of CUDA, read 0.205 s per iteration where the phase after it took
# 0.096 s on average: its second half was still warming up. From iteration 40 on, every 40-iteration median of
# the three phases run there was within 0.05-0.105 s (runs/gpu_p17-19 loss histories; the card's phases 17-19)
PILOT = 64
SPLIT = "split"  # the packed training split: .stage/split.part-0, ..., .stage/split.manifest.json


class StageError(RuntimeError):
    """A part is missing or damaged, or the data does not fit in the calls."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A file split into parts, going out (the training split) or coming back (the export): part ``i`` is
    ``{name}.part-{i}``, the manifest ``{name}.manifest.json``, both in the same folder."""
    name: str
    bytes: int
    sha256: str
    parts: tuple[str, ...]  # each part's SHA-256: a damaged part is named before the parts are joined
    files: tuple[str, ...] = ()  # the training split's files inside the tar

    def part(self, folder: Path, i: int) -> Path:
        return folder / f"{self.name}.part-{i}"

    @staticmethod
    def path(folder: Path, name: str) -> Path:
        return folder / f"{name}.manifest.json"

    @classmethod
    def read(cls, path: Path) -> Manifest:
        if not path.is_file():
            raise StageError(f"no manifest {str(path)!r}: pack (or train) again, and carry or fetch it with the parts")
        fields = json.loads(path.read_text())
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def write_split(data: bytes, folder: Path, *, name: str, part_bytes: int, files: tuple[str, ...] = ()) -> Manifest:
    """Write ``data`` into ``folder`` in parts of at most ``part_bytes`` bytes, with their manifest."""
    count = max(1, math.ceil(len(data) / part_bytes))
    size = math.ceil(len(data) / count)
    parts = [data[i * size:(i + 1) * size] for i in range(count)]
    manifest = Manifest(name=name, bytes=len(data), sha256=sha256(data), parts=tuple(map(sha256, parts)), files=files)
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(parts):
        manifest.part(folder, i).write_bytes(part)
    Manifest.path(folder, name).write_text(json.dumps(asdict(manifest), indent=1))
    return manifest


def read_part(manifest: Manifest, folder: Path, i: int) -> bytes:
    """Part ``i`` from ``folder``, checked against its SHA-256."""
    data = manifest.part(folder, i).read_bytes()
    if sha256(data) != manifest.parts[i]:
        raise StageError(f"{str(manifest.part(folder, i))!r} does not match its manifest (SHA-256 "
                         f"{manifest.parts[i][:12]!r}...; got {len(data)} bytes {sha256(data)[:12]!r}...)")
    return data


def join_split(manifest: Manifest, folder: Path, *, when_missing: str) -> bytes:
    """Every part from ``folder``, each checked, joined and checked whole; ``when_missing`` says what to do when
    parts are absent."""
    missing = [i for i in range(len(manifest.parts)) if not manifest.part(folder, i).is_file()]
    if missing:
        raise StageError(f"parts {missing!r} of {len(manifest.parts)} of {manifest.name!r} are not in "
                         f"{str(folder)!r}: {when_missing}")
    data = b"".join(read_part(manifest, folder, i) for i in range(len(manifest.parts)))
    if sha256(data) != manifest.sha256:  # each part checked: the manifest disagrees with itself (edited, mixed up)
        raise StageError(f"the joined parts of {manifest.name!r} ({len(data)} bytes) do not match the manifest's "
                         f"whole file ({manifest.bytes} bytes, SHA-256 {manifest.sha256[:12]!r}...): pack again")
    return data


def pack(data_dir: Path, stage: Path, budget: int) -> Manifest:
    """Tar the training split's files and write it to ``stage`` in parts of at most ``budget`` bytes."""
    from mar_probe.data import DatasetError, fashion_files
    try:
        files = fashion_files("train", data_dir)
    except DatasetError as exc:
        raise StageError(str(exc)) from exc
    if budget <= 0:
        raise StageError(f"a call has no room for data: the working tree alone is within {MARGIN} bytes of "
                         f"{CALL_LIMIT} (64 MiB); ignore or carry less")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # the IDX files are gzip-compressed already
        for path in files:
            tar.add(path, arcname=path.name)
    shutil.rmtree(stage, ignore_errors=True)
    return write_split(buf.getvalue(), stage, name=SPLIT, part_bytes=budget, files=tuple(p.name for p in files))


def stage_parts(stage: Path, machine: Path) -> list[int]:
    """Copy the parts this call carried to the machine's stage folder, each checked; return the indices staged."""
    manifest = Manifest.read(Manifest.path(stage, SPLIT))
    machine.mkdir(parents=True, exist_ok=True)
    held = [i for i in range(len(manifest.parts)) if manifest.part(stage, i).is_file()]
    for i in held:
        manifest.part(machine, i).write_bytes(read_part(manifest, stage, i))
    return held


def join_data(stage: Path, machine: Path) -> Path:
    """Join the staged parts, check them and unpack the split into ``machine/fashion``; return that folder."""
    manifest = Manifest.read(Manifest.path(stage, SPLIT))
    data = join_split(manifest, machine, when_missing="this machine was given back between the calls (30 s after "
                      "each); make the `stage` call again and this one at once after it")
    folder = machine / "fashion"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def write_parts(path: Path, out: Path, limit: int = RETURN_LIMIT) -> Manifest:
    """Write the export ``path`` into ``out`` in parts of at most ``limit`` bytes, with a manifest, and its loss
    history (the file beside it, small) whole."""
    from mar_probe.models.checkpoints import history_file
    side = history_file(path)
    if not side.is_file():
        raise StageError(f"the export {str(path)!r} has no loss history beside it ({str(side)!r}); "
                         "expected an export of `mar-probe train --export`, which writes both")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(side, out / side.name)
    return write_split(path.read_bytes(), out, name=path.name, part_bytes=limit)


def unpack(folder: Path, dest: Path) -> Path:
    """Join the export's parts from ``folder`` into ``dest``, checked against the manifest and loaded once."""
    found = sorted(m for m in folder.glob("*.manifest.json") if m.name != Manifest.path(folder, SPLIT).name)
    if len(found) != 1:
        raise StageError(f"expected one export manifest (*.manifest.json) in {str(folder)!r}, found "
                         f"{[m.name for m in found]!r}")
    from mar_probe.models.checkpoints import history_file, read_checkpoint, read_history
    manifest = Manifest.read(found[0])
    data = join_split(manifest, folder, when_missing="fetch the call's files again")
    side = history_file(folder / manifest.name)
    if not side.is_file():
        raise StageError(f"the export's loss history {str(side)!r} is missing (run_training copies it beside the "
                         "parts); fetch the call's files again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    shutil.copyfile(side, history_file(dest))
    state = read_checkpoint(dest)
    if "model_ema" not in state:
        raise StageError(f"{str(dest)!r} holds no 'model_ema': not an export of `mar-probe train --export`")
    read_history(dest, state)  # its rows must match the export's iterations
    return dest


@dataclass(frozen=True, kw_only=True)
class Fit:
    """How many iterations fit the phase's minutes, from a pilot run's seconds per iteration on this machine.

    Why: the cosine schedule decays over ``--iters``; a phase stopped by ``--max-minutes`` never reaches its low
    rate, and a GPU's speed is not known before its first call."""
    minutes: float
    pilot_iterations: int
    seconds_per_iteration: float  # median over the pilot's second half (the first iterations warm the kernels up)
    iters: int


def fit_iterations(flags: list[str], data: Path, minutes: float, *, pilot: int = PILOT) -> Fit:
    """Train ``pilot`` iterations into a scratch folder (same flags, no export) and size ``--iters`` to ``minutes``."""
    from mar_probe.cli import train_main
    if not (minutes > 0 and math.isfinite(minutes)) or pilot < 4:
        raise StageError(f"--fit-minutes must be a finite number > 0 and the pilot >= 4 iterations, got "
                         f"{minutes!r} and {pilot!r}")
    scratch = Path(_flag(flags, "--out")).with_name("fit_pilot")
    shutil.rmtree(scratch, ignore_errors=True)
    trial = _set_flag(_set_flag(_drop_flag(flags, "--export"), "--out", str(scratch)), "--iters", str(pilot))
    if train_main([*_drop_flag(trial, "--max-minutes"), "--data", str(data)]):
        raise StageError("the pilot run of mar-probe train failed; see its error above")
    times = [t for _, _, t in json.loads((scratch / "loss_history.json").read_text())]
    spi = statistics.median(b - a for a, b in zip(times[pilot // 2 - 1:], times[pilot // 2:]))
    return Fit(minutes=minutes, pilot_iterations=pilot, seconds_per_iteration=spi,
               iters=max(1, int(60 * minutes / spi)))


def run_training(flags: list[str], data: Path, out: Path, *, fit_minutes: float = 0.0, pilot: int = PILOT) -> Path:
    """``mar-probe train FLAGS --data DATA``; then the export in parts and the loss history/curve into ``out``.
    With ``fit_minutes``, ``--iters`` is first sized by :func:`fit_iterations` (a ``pilot``-iteration run, recorded
    in ``out/fit.json``)."""
    from mar_probe.cli import train_main
    export = _flag(flags, "--export")
    run_dir = Path(_flag(flags, "--out"))
    out.mkdir(parents=True, exist_ok=True)
    if fit_minutes:
        fit = fit_iterations(flags, data, fit_minutes, pilot=pilot)
        (out / "fit.json").write_text(json.dumps(asdict(fit), indent=1))
        print(f"pilot: {fit.seconds_per_iteration:.4f} s per iteration; --iters {fit.iters} fits {fit_minutes:g} min")
        flags = _set_flag(flags, "--iters", str(fit.iters))
    code = train_main([*flags, "--data", str(data)])
    if code:
        raise StageError(f"mar-probe train exited with {code}")
    write_parts(Path(export), out)
    for name in ("loss_history.json", "loss_curve.png"):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    return Path(export)


def _set_flag(flags: list[str], name: str, value: str) -> list[str]:
    """``flags`` with ``name``'s value replaced, or ``name value`` appended."""
    if name not in flags:
        return [*flags, name, value]
    i = flags.index(name)
    return [*flags[:i + 1], value, *flags[i + 2:]]


def _drop_flag(flags: list[str], name: str) -> list[str]:
    """``flags`` without ``name`` and its value."""
    if name not in flags:
        return list(flags)
    i = flags.index(name)
    return [*flags[:i], *flags[i + 2:]]


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
    p.add_argument("--fit-minutes", type=float, default=0.0,
                   help=f"train: first time a {PILOT}-iteration pilot and set --iters to fit this many minutes")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": the flags of `mar-probe train`
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    if flags and args.step != "train":
        p.error(f"only `train` takes flags after '--', got {flags!r} for {args.step!r}")
    if args.step == "pack":
        budget = args.budget or CALL_LIMIT - tree_bytes() - MARGIN
        m = pack(args.data, args.stage, budget)
        print(f"packed {list(m.files)} ({m.bytes} bytes) into {len(m.parts)} parts in {args.stage}")
    elif args.step == "stage":
        print(f"staged parts {stage_parts(args.stage, args.machine_stage)} in {args.machine_stage}")
    elif args.step == "train":
        stage_parts(args.stage, args.machine_stage)
        export = run_training(flags, join_data(args.stage, args.machine_stage), args.out,
                              fit_minutes=args.fit_minutes)
        print(f"trained; {export} is in {args.out} in parts ({Manifest.path(args.out, export.name).name})")
    else:
        if len(args.paths) != 2:
            p.error(f"unpack needs FOLDER DEST, got {args.paths!r}")
        print(f"joined and checked {unpack(Path(args.paths[0]), Path(args.paths[1]))}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the device machine runs it from the repository copy, mar_probe not installed
    sys.exit(main())
