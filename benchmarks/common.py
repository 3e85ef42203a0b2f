"""Shared helpers for benchmarks: machine description and result files."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from mar_probe.machine import machine  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).resolve().parent / "results"


def bench_parser(doc: str):
    """An argument parser with the paper setting's flags: mar_base, batch 1, 64 steps, CFG 3.0, 100 head steps."""
    import argparse
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mar_base")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-iter", type=int, default=64)
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--num-sampling-steps", default="100")
    return p


def command_line(script: str, argv) -> str:
    """The command that ran ``benchmarks/<script>`` with ``argv``, quoted for a shell: what a result file records so
    that the docs print the command that made it (not a copy typed beside it)."""
    return shlex.join(["python", f"benchmarks/{script}", *argv])


def result_path(name: str) -> Path:
    """``benchmarks/results/<name>.json``: where :func:`write_result` writes ``name``."""
    return RESULTS / f"{name}.json"


def write_result(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine attached."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def sci(value: float, digits: int = 2) -> str:
    """``6e-4``, ``2.4e-9``: short scientific notation with at most ``digits`` significant digits."""
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"
