"""What a measurement ran on: host, CPU, cores, threads, library versions, date."""
from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path

import torch


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(key: str) -> str | None:
    """The value of the first ``key : value`` line of ``/proc/cpuinfo`` (None where the file or the key is absent)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(wanted) -> dict[str, bool]:
    """Which of the ``wanted`` CPU flags ``/proc/cpuinfo`` reports (all False where it does not exist), e.g. whether
    bf16 matrix work can be fast (``avx512_bf16``, ``amx_bf16``; issue 14)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return {f: f in flags for f in wanted}


def machine() -> dict:
    """The machine and software a measurement ran on (stored beside every timing)."""
    cpu = _cpuinfo_field("model name") or platform.processor() or ""
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
