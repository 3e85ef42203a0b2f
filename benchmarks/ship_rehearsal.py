"""Rehearse shipping a new embedded default (issue 14): run the README's test suite as if the candidate had replaced it.

Issue 14 asks that every command, test and notebook work unchanged on the new default and that the suite stay under
20 minutes on 2 cores. Before a candidate ships this says what shipping will have to change: the script checks the
committed tree out into a scratch git worktree (the working copy is not touched), puts the candidate at
``data/<its file name>``, removes the file ``DEFAULT_CHECKPOINT`` names there (issue 14: the model a new default
replaces leaves ``data/``) and points ``DEFAULT_CHECKPOINT`` at the candidate, then runs ``python -m pytest -q``
there with the worktree first on ``PYTHONPATH``. It records the suite's wall time, the counts, every failure with
the first line of its message and the slowest tests in ``benchmarks/results/NAME.json``; the worktree is removed
afterwards.

    python benchmarks/ship_rehearsal.py --candidate data/training/fashion_b128.pth --name ship_rehearsal_b128_p29

Without ``--candidate`` the scratch tree is the committed tree as it is, so the file records what the README's test
command costs on this machine (issue 14: the suite stays under 20 minutes on 2 cores):

    python benchmarks/ship_rehearsal.py --name suite_time

A suite that runs past ``--timeout`` seconds is stopped and recorded as timed out, with its elapsed time.
``DEFAULT_PRESET`` (what ``train`` and ``create_model()`` build by default) is left as it is: a candidate of another
preset needs that line changed too. A candidate of the default's own file name (the next phase of the same model)
simply replaces it (the training line's latest phase lies at ``data/training/fashion_b128.pth`` until it ships).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, write_result  # noqa: E402

from mar_probe._io import file_sha256  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the one line shipping edits: where the library's default checkpoint lives (mar_probe/models/checkpoints.py)
DEFAULT_LINE = re.compile(r'^DEFAULT_CHECKPOINT = DATA_DIR / "([^"]+)"$', re.MULTILINE)


def _switch_default(tree: Path, candidate: Path) -> None:
    """In the scratch ``tree``: the candidate in ``data/``, the default it replaces out, the library pointed at it."""
    source = tree / "mar_probe/models/checkpoints.py"
    text = source.read_text()
    found = DEFAULT_LINE.findall(text)
    if len(found) != 1:
        raise RuntimeError(f"expected one line matching {DEFAULT_LINE.pattern!r} in {str(source)!r}, found "
                           f"{len(found)}; update this script to where the default checkpoint is set now")
    (tree / "data" / found[0]).unlink()  # issue 14: the model a new default replaces leaves data/
    shutil.copy2(candidate, tree / "data" / candidate.name)
    source.write_text(DEFAULT_LINE.sub(f'DEFAULT_CHECKPOINT = DATA_DIR / "{candidate.name}"', text))


def _cases(junit: Path, strip: str = "") -> list[dict]:
    """Every test case of a JUnit XML report: its id, seconds and outcome (with the message's first line, ``strip``
    (the scratch tree's path) taken out of it, so paths read as the repository's)."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                lines = (found.get("message") or "").splitlines()
                outcome, message = tag, (lines[0].replace(strip, "")[:300] if lines else "")
                break
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}", "seconds": float(case.get("time", 0)),
                      "outcome": outcome, "message": message})
    return cases


def _summary(cases: list[dict], slowest: int) -> dict:
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
    ranked = sorted(cases, key=lambda c: -c["seconds"])[:slowest]
    return {"counts": counts, "failures": [c for c in cases if c["outcome"] in ("failure", "error")],
            "slowest": [{"id": c["id"], "seconds": c["seconds"]} for c in ranked]}


def _addopts(tree: Path) -> str:
    """The pytest options the tree's ``pyproject.toml`` adds to every run (how many worker processes, since the
    suite runs in two: the README's command does not show them)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return "unknown (no tomllib before Python 3.11)"
    config = tomllib.loads((tree / "pyproject.toml").read_text())
    return config.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("addopts", "")


def rehearse(candidate: Path | None, commit: str, timeout: float, slowest: int) -> dict:
    """Run the suite on ``commit`` (checked out in a scratch worktree) with ``candidate`` as the default (None: the
    committed default)."""
    scratch = Path(tempfile.mkdtemp(prefix="ship_rehearsal_"))
    tree, junit = scratch / "tree", scratch / "junit.xml"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        if candidate is not None:
            _switch_default(tree, candidate)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        load_before, start = os.getloadavg(), time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=tree, env=env, timeout=timeout, capture_output=True, text=True)
            returncode, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            returncode, tail = None, ""
        seconds = time.perf_counter() - start
        # the load averages (1, 5, 15 min) say what else ran: the suite's time is only comparable on a quiet machine
        record = {"seconds": seconds, "timed_out": returncode is None, "returncode": returncode,
                  "addopts": _addopts(tree), "load_before": load_before, "load_after": os.getloadavg(),
                  "output_tail": tail}
        cases = _cases(junit, strip=f"{tree}/") if junit.exists() else None
        return {**record, **(_summary(cases, slowest) if cases is not None else {})}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", type=Path, default=None,
                   help="the checkpoint that would become the default (none: time the committed tree's suite)")
    p.add_argument("--name", default="ship_rehearsal", help="result file benchmarks/results/NAME.json")
    p.add_argument("--timeout", type=float, default=3600.0, help="stop the suite after this many seconds")
    p.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to record")
    p.add_argument("--load", default="", help="what else ran on the machine meanwhile, stored with the result")
    args = p.parse_args(argv)
    candidate = args.candidate  # None: the committed tree's suite as it is
    if candidate is not None and not candidate.is_file():
        raise SystemExit(f"--candidate {str(candidate)!r} is not a file")
    sha = file_sha256(candidate) if candidate is not None else None
    # resolved before the run: HEAD may move while the suite runs (the first rehearsal recorded a later commit)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, capture_output=True,
                            check=True).stdout.strip()
    result = rehearse(candidate.resolve() if candidate is not None else None, commit, args.timeout, args.slowest)
    command = command_line("ship_rehearsal.py", argv or sys.argv[1:])
    path = write_result(args.name, {"command": command, "candidate": str(candidate) if candidate is not None else None,
                                    "candidate_sha256": sha,
                                    "commit": commit, "load": args.load, **result})
    print(f"{result.get('counts')} in {result['seconds']:.0f} s -> {path}")


if __name__ == "__main__":
    main()
