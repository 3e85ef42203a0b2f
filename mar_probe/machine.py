"""What a measurement ran on: host, CPU, cores, threads, library versions, date."""
from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path

import torch


def machine() -> dict:
    """The machine and software a measurement ran on (stored beside every timing)."""
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
