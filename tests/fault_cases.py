"""The bad-input matrix of issue 19: every command fed values a hostile or careless user would give.

Each case is a command line with placeholders for prepared files (``{payload}``, ``{random}``, ``{empty}``,
``{ints}``, ``{dir}``, ``{missing}``, ``{bad_yaml}``, ``{list_yaml}``, ``{store}``, ``{undone}``, ``{broken}``)
and the output folder ``{out}``. :func:`run_case` runs one in-process and says what went wrong, if anything:
a traceback, exit 0, more than two lines on stderr, something written under ``{out}``, or the payload's marker
file created. ``tests/test_faults.py`` runs them all; ``benchmarks/fault_injection.py`` runs them as
subprocesses and commits the table.
"""
from __future__ import annotations

import contextlib
import io
import shutil
from dataclasses import dataclass
from pathlib import Path

TINY = ["--model", "mar_tiny", "--num-iter", "2", "--cfg", "2.0"]


def _sampling_cases(cmd: str, extra: list[str]) -> list[tuple[str, list[str]]]:
    """Bad sampling settings, model sources and strategies, shared by every command that samples."""
    base = [cmd, *TINY, *extra]
    flags = {"--num-samples": ["0", "-1", "abc"], "--num-iter": ["0", "-2", "1000", "nan"],
             "--cfg": ["nan", "inf", "0.5", "abc"], "--temperature": ["0", "-1", "nan", "inf"],
             "--batch-size": ["0", "-1"], "--labels": ["a,b", "10", "-1", ","], "--samples-per-class": ["0"],
             "--num-sampling-steps": ["0", "abc"], "--cfg-schedule": ["bogus"], "--rng": ["bogus"],
             "--device": ["bogus", "cuda:99"], "--strategy": ["nosuch"], "--threads": ["0", "-1"]}
    cases = [(f"{cmd} {flag} {v}", base + [flag, v]) for flag, values in flags.items() for v in values
             if not (cmd == "compare" and flag == "--strategy")]
    for src in ("payload", "random", "empty", "ints", "dir", "missing"):
        cases.append((f"{cmd} --checkpoint {src}", [cmd, "--checkpoint", f"{{{src}}}", "--num-iter", "2", *extra]))
    cases += [(f"{cmd} --model nosuch", [cmd, "--model", "nosuch", *extra]),
              (f"{cmd} --vae payload", base + ["--vae", "{payload}"]),
              (f"{cmd} --vae random", base + ["--vae", "{random}"])]
    return cases


def cases() -> list[tuple[str, list[str]]]:
    """(id, argv) of every case."""
    out = ["--out", "{out}"]
    c = _sampling_cases("generate", out)
    c += [("generate --strategy-opt budget=abc", ["generate", *TINY, "--strategy", "marche", "--strategy-opt",
                                                 "budget=abc", *out]),
          ("generate --strategy-opt nosuch=1", ["generate", *TINY, "--strategy", "marche", "--strategy-opt",
                                               "nosuch=1", *out]),
          ("generate --strategy-opt noequals", ["generate", *TINY, "--strategy-opt", "noequals", *out])]
    c += _sampling_cases("record", out)
    rec = ["record", *TINY, *out]
    c += [(f"record {flag} {v}", rec + [flag, v]) for flag, v in (
        ("--vars", "bogus"), ("--layers", "99"), ("--layers", "x"), ("--steps", "999"), ("--samples", "abc"),
        ("--branches", "bogus"), ("--dtype", "int8"), ("--queue-size", "0"), ("--steps-per-chunk", "0"),
        ("--shard", "3/2"), ("--shard", "abc"), ("--spec", "{missing}"), ("--spec", "{bad_yaml}"),
        ("--spec", "{list_yaml}"), ("--compression", "gzip"))]
    c += [("record --repair without --resume", rec + ["--repair"]),
          ("record --resume --overwrite", rec + ["--resume", "--overwrite"]),
          ("record --resume another run's store", ["record", *TINY, "--cfg", "3.0", "--out", "{store}", "--resume"])]
    cmp_ = ["compare", *TINY, "--num-samples", "2", *out]
    c += [(f"compare {flag} {v}", cmp_ + [flag, v]) for flag, v in (
        ("--seeds", "a"), ("--seeds", "0,0"), ("--strategies", "nosuch"), ("--strategies", "marche,marche"),
        ("--strategy-opt", "marche.budget=abc"), ("--strategy-opt", "nolabel.x=1"), ("--paired-against", "nosuch"),
        ("--grid-images", "-1"), ("--inception-weights", "{payload}"))]
    c += [("compare --num-samples 1 (Fashion-MNIST)", ["compare", "--num-samples", "1", "--num-iter", "2", *out])]
    sw = ["sweep", "marche", *TINY, "--num-samples", "2", *out]
    c += [(f"sweep {v}", sw + ["--param", v]) for v in ("bogus", "budget=", "nosuch=1,2", "budget=a,b")]
    c += [("sweep nosuch strategy", ["sweep", "nosuch", *TINY, "--param", "x=1,2", *out])]
    tn = ["tune", *TINY, "--num-samples", "2", "--family", "marche", "--target", "psnr>=30", *out]  # last flag wins
    c += [(f"tune {flag} {v}", tn + [flag, v]) for flag, v in (
        ("--target", "psnr=>30"), ("--target", "fid<=10"), ("--target", "psnr<=30"), ("--target", "psnr>=nan"),
        ("--target", "psnr>=abc"), ("--statistic", "median"), ("--param", "nosuch=1,2"), ("--param", "budget="),
        ("--param", "budget=a,b"), ("--param", "budget=0,16"), ("--strategy-opt", "nosuch=1"),
        ("--heldout-seeds", "1"), ("--calibration-seeds", ""), ("--calibration-seeds", "a"),
        ("--heldout-seeds", "3,3"), ("--search", "bogus"), ("--num-samples", "0"), ("--batch-size", "0"),
        ("--num-iter", "0"), ("--cfg", "nan"), ("--labels", "10"))]
    c += [("tune --family nosuch", ["tune", *TINY, "--family", "nosuch", "--target", "psnr>=30", *out]),
          ("tune --family full (nothing to tune)", ["tune", *TINY, "--family", "full", "--target", "psnr>=30", *out]),
          ("tune without --target", ["tune", *TINY, "--family", "marche", *out])]
    tr = ["train", "--preset", "mar_tiny", "--dataset", "digits", "--out", "{out}"]
    c += [(f"train {flag} {v}", tr + [flag, v]) for flag, v in (
        ("--iters", "0"), ("--batch-size", "0"), ("--lr", "0"), ("--lr", "nan"), ("--ema-rate", "1"),
        ("--max-minutes", "-1"), ("--ckpt-every", "0"), ("--preset", "nosuch"), ("--init", "{missing}"),
        ("--init", "{random}"), ("--init", "{payload}"), ("--init", "{ints}"), ("--attention", "flash"))]
    c += [("train --data missing", ["train", "--preset", "mar_tiny", "--data", "{missing}", "--out", "{out}"])]
    c += [(f"quality {src}", ["quality", f"{{{src}}}"]) for src in ("missing", "random", "empty", "dir")]
    c += [(f"quality --classifier {src}", ["quality", "{samples}", "--classifier", f"{{{src}}}"])
          for src in ("payload", "random", "missing")]
    c += [(f"analyze {src}", ["analyze", f"{{{src}}}"]) for src in ("missing", "random", "dir", "broken", "undone")]
    c += [(f"analyze {flag} {v}", ["analyze", "{store}", flag, v]) for flag, v in (
        ("--layer", "99"), ("--layer", "-1"), ("--k", "0"), ("--threshold", "2"), ("--lazymar-layer", "99"))]
    c += [(f"figures {name}", ["figures", *args, "--out", "{out}"]) for name, args in (
        ("missing", ["{missing}"]), ("undone", ["{undone}"]), ("--only bogus", ["{store}", "--only", "bogus"]),
        ("--format bogus", ["{store}", "--format", "bogus"]))]
    st = ["study", "--out", "{out}"]
    c += [(f"study {flag} {v}", st + [flag, v]) for flag, v in (
        ("--samples-per-seed", "0"), ("--seeds", "a"), ("--seeds", "1,1"), ("--num-iter", "0"), ("--cfg", "nan"),
        ("--checkpoint", "{payload}"), ("--temperature", "0"))]
    c += [(f"verify {src}", ["verify", f"{{{src}}}"]) for src in ("missing", "random", "dir")]
    return c


@dataclass
class Files:
    """The prepared inputs of the matrix, in one folder; ``marker`` is what the payload would create."""
    root: Path

    @property
    def marker(self) -> Path:
        return self.root / "PAYLOAD_RAN"

    def mapping(self) -> dict:
        r = self.root
        return {k: str(r / v) for k, v in dict(
            payload="payload.pth", random="random.bin", empty="empty.pth", ints="ints.pth", dir="folder",
            missing="no_such_file", bad_yaml="bad.yaml", list_yaml="list.yaml", store="store.zarr",
            undone="undone.zarr", broken="broken.zarr", samples="samples.npz").items()}


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def prepare(root: Path) -> Files:
    """Write every input file the cases name (one small recorded store and its damaged copies included)."""
    import numpy as np
    import torch

    from mar_probe.cli import main
    files = Files(Path(root))
    root = files.root
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _Payload(files.marker), "model_ema": _Payload(files.marker)}, root / "payload.pth")
    (root / "random.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    (root / "empty.pth").write_bytes(b"")
    torch.save({"epoch": 3, "lr": 0.1}, root / "ints.pth")
    (root / "folder").mkdir(exist_ok=True)
    (root / "bad.yaml").write_text("variables: [dec_k\n  - : :")
    (root / "list.yaml").write_text("- dec_k\n- dec_v\n")
    np.savez(root / "samples.npz", images=np.zeros((4, 28, 28, 1), np.uint8), labels=np.arange(4))
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        main(["record", *TINY, "--num-samples", "2", "--vars", "dec_k,dec_v,z_cfg_resid,attn_gen",
              "--out", str(root / "store.zarr")])
    for name in ("undone.zarr", "broken.zarr"):
        shutil.copytree(root / "store.zarr", root / name, dirs_exist_ok=True)
    import zarr
    done = zarr.open_array(str(root / "undone.zarr" / "done"), mode="r+")
    done[...] = False
    meta = root / "broken.zarr" / "dec_k" / "zarr.json"
    meta.write_text(meta.read_text()[:30])
    return files


@dataclass
class Outcome:
    case: str
    rc: int
    lines: int
    problems: list

    @property
    def ok(self) -> bool:
        return not self.problems


def check(case: str, rc: int, err: str, out_dir: Path, marker: Path) -> Outcome:
    """The verdict on one case's exit code, stderr and side effects."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "%|" not in ln]
    problems = []
    if rc == 0:
        problems.append("exit 0")
    if "Traceback" in err:
        problems.append("traceback")
    if len(lines) > 2:
        problems.append(f"{len(lines)} lines on stderr")
    if out_dir.exists():
        problems.append("wrote its output folder")
    if marker.exists():
        problems.append("PAYLOAD RAN")
    if "weights_only=False" in err:
        problems.append("advises weights_only=False")
    return Outcome(case, rc, len(lines), problems)


def fill(argv: list[str], files: Files, out_dir: Path) -> list[str]:
    values = {**files.mapping(), "out": str(out_dir)}
    return [a.format(**values) if "{" in a else a for a in argv]


def run_case(case: str, argv: list[str], files: Files, out_dir: Path) -> Outcome:
    """Run one case in-process (argparse's exit counts as its exit code)."""
    import warnings

    from mar_probe.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = main(fill(argv, files, out_dir))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - an escaped exception is exactly what the matrix looks for
            import traceback
            err.write(traceback.format_exc())
            rc = 1
    return check(case, rc, err.getvalue(), out_dir, files.marker)
