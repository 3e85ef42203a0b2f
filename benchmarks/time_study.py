"""Time the README's main command, ``mar-probe study``, on the embedded default (issue 15: the README's numbers
come from files).

Runs ``mar-probe study --out OUT`` in a child process (a fresh output folder, so nothing is reused) and records its
wall time, the CPU seconds of the child (user and system, ``resource.getrusage(RUSAGE_CHILDREN)``), the load
average before and after, the machine and the command, in ``benchmarks/results/study_time.json``, which the README
is rendered from (``benchmarks/render_docs.py``).

    python benchmarks/time_study.py [--out runs/study-timing] [--nice 0]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def time_study(out: Path, nice: int = 0) -> dict:
    """Run the study into ``out`` (removed first) and return its timing record."""
    if out.exists():
        shutil.rmtree(out)
    command = ["mar-probe", "study", "--out", str(out)]
    before, t0 = _load(), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"command": " ".join(command), "wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "load_before": before, "load_after": _load(), "nice": nice}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/study-timing", help="the study's output folder (removed first)")
    p.add_argument("--nice", type=int, default=0, help="niceness of the study process (default: 0)")
    args = p.parse_args(argv)
    record = time_study(Path(args.out), args.nice)
    path = write_result("study_time", {"script": "python benchmarks/time_study.py " + " ".join(argv or sys.argv[1:]),
                                       **record})
    print(f"mar-probe study: {record['wall_s']:.1f} s wall, {record['user_s']:.1f} s user; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
