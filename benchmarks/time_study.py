"""Time the README's main command, ``mar-probe study``, on the embedded default (issue 15: the README's numbers
come from files).

Runs ``mar-probe study --out OUT`` in a child process (a fresh output folder, so nothing is reused) and records its
wall time, the CPU seconds of the child (user and system, ``resource.getrusage(RUSAGE_CHILDREN)``), the load
average before and after, the machine and the command, in ``benchmarks/results/study_time.json``, which the README
is rendered from (``benchmarks/render_docs.py``).

    python benchmarks/time_study.py [--out runs/study-timing] [--nice 0]

Before a model replaces the embedded default, ``--versus PATH`` times the study on both, alternating (default, PATH,
default, PATH, ... for ``--rounds``), so the load of a shared machine falls on both alike, and writes the two
records and the ratio of their median wall times to ``benchmarks/results/NAME.json`` (``--name``): issue 14 asks
that the study still finish in about a minute on the new default, or be shrunk. The two runs before issue 14's
model shipped (it lay at ``data/training/fashion_b128.pth`` then, beside the default ``fashion_small.pth``):

    python benchmarks/time_study.py --versus data/training/fashion_b128.pth --rounds 2 --name study_time_b128

``--versus-flags`` gives the candidate's runs study flags of their own, to time a shrunk study against today's:

    python benchmarks/time_study.py --versus data/training/fashion_b128.pth --versus-flags '--samples-per-seed 1' \\
        --rounds 2 --name study_time_b128_shrunk
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def time_study(out: Path, nice: int = 0, checkpoint: str | None = None, flags: tuple[str, ...] = ()) -> dict:
    """Run the study into ``out`` (removed first), on ``checkpoint`` or the embedded default, with the study's
    ``flags``, and return its timing record."""
    if out.exists():
        shutil.rmtree(out)
    command = (["mar-probe", "study", "--out", str(out)] + (["--checkpoint", checkpoint] if checkpoint else [])
               + list(flags))
    before, used, t0 = _load(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # cumulative over children: this run's is the difference
    return {"command": " ".join(command), "wall_s": wall, "user_s": usage.ru_utime - used.ru_utime,
            "sys_s": usage.ru_stime - used.ru_stime, "load_before": before, "load_after": _load(), "nice": nice}


def time_versus(out: Path, checkpoint: str, rounds: int, nice: int = 0, flags: tuple[str, ...] = ()) -> dict:
    """The study on the embedded default and on ``checkpoint`` (with the study's ``flags``, e.g. a smaller study
    for a slower model), alternating for ``rounds`` rounds, with the ratio of their median wall times
    (``checkpoint`` over the default)."""
    runs: dict[str, list[dict]] = {"default": [], "versus": []}
    for _ in range(rounds):
        runs["default"].append(time_study(out, nice))
        runs["versus"].append(time_study(out, nice, checkpoint, flags))
    medians = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    return {"checkpoint": checkpoint, "flags": list(flags), "rounds": rounds, **runs, "median_wall_s": medians,
            "ratio": medians["versus"] / medians["default"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/study-timing", help="the study's output folder (removed first)")
    p.add_argument("--nice", type=int, default=0, help="niceness of the study process (default: 0)")
    p.add_argument("--versus", metavar="PATH", help="also time the study on this checkpoint, alternating with the "
                                                    "embedded default (default: the embedded default alone)")
    p.add_argument("--versus-flags", default="", metavar="FLAGS",
                   help="study flags for the --versus runs only, e.g. '--samples-per-seed 1' (a shrunk study)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each with --versus (default: 2)")
    p.add_argument("--name", default="study_time", help="result file: benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds!r}")
    if args.versus and not Path(args.versus).is_file():
        p.error(f"--versus: no checkpoint at {args.versus!r}")
    if args.versus_flags and not args.versus:
        p.error(f"--versus-flags {args.versus_flags!r} needs --versus PATH")
    script = shlex.join(["python", "benchmarks/time_study.py", *(argv if argv is not None else sys.argv[1:])])
    if args.versus:
        flags = tuple(shlex.split(args.versus_flags))
        record = time_versus(Path(args.out), args.versus, args.rounds, args.nice, flags)
        summary = (f"median {record['median_wall_s']['versus']:.1f} s on {args.versus} against "
                   f"{record['median_wall_s']['default']:.1f} s on the default ({record['ratio']:.2f}x)")
    else:
        record = time_study(Path(args.out), args.nice)
        summary = f"{record['wall_s']:.1f} s wall, {record['user_s']:.1f} s user"
    path = write_result(args.name, {"script": script, **record})
    print(f"mar-probe study: {summary}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
