"""The long fault-injection run of issue 19, as a hostile user would try it, in real processes.

1. **Kill loop**: ``mar-probe record`` killed with SIGKILL at seeded random moments (a quarter of them within the
   first second, before the store exists), then ``--resume``: the store must equal an uninterrupted one, with no
   temporary folder left behind.
2. **Corrupt-store matrix**: in a finished store, one chunk of every variable deleted or overwritten with garbage:
   ``mar-probe verify`` must find it (exit 1), ``open_run`` must report it, and ``record --resume --repair`` must
   give arrays identical to the undamaged store.
3. **Bad-input matrix**: every case of ``tests/fault_cases.py`` as a subprocess: non-zero exit, at most two lines
   on stderr, no traceback, nothing written, the payload's marker never created.

    python benchmarks/fault_injection.py --kills 20

writes ``benchmarks/results/fault_injection.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import RESULTS, write_result  # noqa: E402
from fault_cases import cases, check, fill, prepare  # noqa: E402

from mar_probe.store.integrity import FLAG_VARIABLES  # noqa: E402

RECORD = ["--model", "mar_tiny", "--num-samples", "32", "--num-iter", "8", "--cfg", "2.0", "--seed", "5",
          "--vars", "enc_v,dec_k,z_cfg_resid,attn_gen", "--layers", "1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "mar_probe.cli", *args]


def _same(a: Path, b: Path) -> bool:
    import zarr
    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    names = sorted(n for n, _ in ga.arrays())
    if names != sorted(n for n, _ in gb.arrays()):
        return False
    for n in names:
        x, y = ga[n][...], gb[n][...]
        if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
            return False
    return True


def kill_loop(root: Path, ref: Path, trials: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(trials):
        delay = float(rng.uniform(0.1, 1.0) if i % 4 == 0 else rng.uniform(1.0, 12.0))
        out = root / f"kill{i}.zarr"
        proc = subprocess.Popen(_cli("record", *RECORD, "--out", str(out)), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        existed = out.exists()
        rerun = subprocess.run(_cli("record", *RECORD, "--out", str(out), "--resume"), env=ENV, capture_output=True,
                               text=True)
        leftovers = [p.name for p in root.glob(f".kill{i}.zarr.tmp-*")]
        rows.append(dict(trial=i, kill_after_s=round(delay, 2), store_existed=existed, rc=rerun.returncode,
                         identical=rerun.returncode == 0 and _same(out, ref), leftovers=leftovers))
        print("kill", rows[-1], flush=True)
    return rows


def _damage(store: Path, variable: str, how: str) -> None:
    chunk = sorted(p for p in (store / variable).iterdir() if p.name != "zarr.json")[1]
    if how == "delete":
        chunk.unlink()
    else:
        chunk.write_bytes(b"garbage" * 11)


def corrupt_matrix(root: Path, ref: Path) -> list[dict]:
    from mar_probe.store import open_run
    import zarr

    from mar_probe.store.integrity import data_variables
    group = zarr.open_group(str(ref), mode="r", use_consolidated=False)
    variables = sorted(v.name for v in data_variables(group)) + list(FLAG_VARIABLES)
    rows = []
    for variable in variables:
        for how in ("delete", "garbage"):
            store = root / f"{variable}-{how}.zarr"
            shutil.copytree(ref, store)
            _damage(store, variable, how)
            verify = subprocess.run(_cli("verify", str(store)), env=ENV, capture_output=True, text=True)
            reported = _open_run_reports(open_run, store, variable)
            if variable in FLAG_VARIABLES and how == "delete":
                # a missing flag chunk reads as "not finished": no data is lost, a plain --resume redoes the steps
                verify_ok = verify.returncode == 0
                repair = subprocess.run(_cli("record", *RECORD, "--out", str(store), "--resume"), env=ENV,
                                        capture_output=True, text=True)
                rows.append(dict(variable=variable, damage=how, verify_exit=verify.returncode, detected=verify_ok,
                                 open_run_reports=reported, repaired_identical=repair.returncode == 0
                                 and _same(store, ref), note="reads as unfinished; plain --resume"))
                print("corrupt", rows[-1], flush=True)
                continue
            repair = subprocess.run(_cli("record", *RECORD, "--out", str(store), "--resume", "--repair"), env=ENV,
                                    capture_output=True, text=True)
            rows.append(dict(variable=variable, damage=how, verify_exit=verify.returncode,
                             detected=verify.returncode == 1 and variable in verify.stdout, open_run_reports=reported,
                             repaired_identical=repair.returncode == 0 and _same(store, ref)))
            print("corrupt", rows[-1], flush=True)
    return rows


def _open_run_reports(open_run, store: Path, variable: str) -> bool:
    """A warning on open, or an error naming the damage when the variable is read."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds = open_run(store)
            if variable in ds.variables:
                _ = ds[variable].values  # reading it decodes every chunk
        except Exception as exc:  # noqa: BLE001
            return "damaged" in str(exc)
    return any("damaged" in str(w.message) or "incomplete" in str(w.message) for w in caught)


def bad_inputs(root: Path) -> list[dict]:
    files = prepare(root / "inputs")
    rows = []
    for i, (case, argv) in enumerate(cases()):
        out = root / f"bad{i}"
        proc = subprocess.run(_cli(*fill(argv, files, out)), env=ENV, capture_output=True, text=True)
        o = check(case, proc.returncode, proc.stderr, out, files.marker)
        rows.append(dict(case=case, rc=o.rc, stderr_lines=o.lines, problems=o.problems,
                         message=(proc.stderr.strip().splitlines() or [""])[-1][:300]))
    return rows


def write_table(kills, corrupt, bad, command: str) -> Path:
    ok_kill = sum(r["identical"] and not r["leftovers"] for r in kills)
    before = sum(not r["store_existed"] for r in kills)
    lines = ["# Fault injection (issue 19)", "", f"Command: `{command}`", "",
             f"- Kill loop: **{ok_kill}/{len(kills)}** stores identical to the uninterrupted one after `--resume`, "
             f"no temporary folder left; {before} of the kills came before the store existed.",
             f"- Corrupt-store matrix: {sum(r['detected'] for r in corrupt)}/{len(corrupt)} detected by `verify`, "
             f"{sum(r['open_run_reports'] for r in corrupt)}/{len(corrupt)} reported by `open_run`, "
             f"{sum(r['repaired_identical'] for r in corrupt)}/{len(corrupt)} repaired to identical arrays.",
             f"- Bad-input matrix: {sum(not r['problems'] for r in bad)}/{len(bad)} cases clean; tracebacks "
             f"{sum('traceback' in r['problems'] for r in bad)}, exit-0 acceptances "
             f"{sum('exit 0' in r['problems'] for r in bad)}, output written "
             f"{sum('wrote its output folder' in r['problems'] for r in bad)}, "
             f"payload ran {sum('PAYLOAD RAN' in r['problems'] for r in bad)}.", "",
             "| case | exit | message |", "|---|---:|---|"]
    for r in bad:
        flag = "" if not r["problems"] else f" **{', '.join(r['problems'])}**"
        lines.append(f"| `{r['case']}` | {r['rc']} | {r['message'].replace('|', '/')}{flag} |")
    path = RESULTS / "fault_injection.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mar_probe_faults_"))
    ref = root / "ref.zarr"
    subprocess.run(_cli("record", *RECORD, "--out", str(ref)), env=ENV, check=True, capture_output=True)
    kills = kill_loop(root, ref, args.kills, args.seed)
    corrupt = corrupt_matrix(root, ref)
    bad = bad_inputs(root)
    command = "python benchmarks/fault_injection.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_result("fault_injection", dict(command=command, kills=kills, corrupt=corrupt, bad_inputs=bad))
    print(write_table(kills, corrupt, bad, command).read_text()[:1500])
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
