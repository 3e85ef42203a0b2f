"""Shared helpers for benchmarks: machine description and result files."""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

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


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_result(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine attached."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
