"""Processes started by ``torchrun`` (issue 16, item 1): their ranks, devices and the few collectives they need.

``torchrun --nproc_per_node N -m mar_probe record ...`` starts N copies of the command with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their environment. :meth:`Ranks.from_env`
reads them; :func:`process_group` joins the ranks with torch.distributed (gloo on CPU, nccl on GPU). Recording
needs only three collective steps, all of them small Python objects: every rank's settings (refused unless
equal, before anything is written), rank 0's store creation (the others wait for it, and learn if it failed) and
the counts at the end. Samples are split as ``--shard RANK/WORLD_SIZE`` would split them, so a torchrun record,
hand-run shards and one process give identical stores.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

#: The variables torchrun sets for every process, and what each must be.
ENV_VARS = {"RANK": "rank of this process, 0 <= RANK < WORLD_SIZE", "WORLD_SIZE": "number of processes, >= 1",
            "LOCAL_RANK": "rank on this node (its GPU index), >= 0"}


#: Hours a rank may wait at a collective for the others.
COLLECTIVE_TIMEOUT_H = 12


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """This process's place among the processes of a torchrun launch."""
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, environ=None) -> Ranks | None:
        """The ranks torchrun set, or None when ``WORLD_SIZE`` is not set (a plain process)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        values = {}
        for name, meaning in ENV_VARS.items():
            text = env.get(name, "0" if name == "LOCAL_RANK" else None)
            if text is None or not text.strip().isdigit():
                raise ValueError(f"environment variable {name}={text!r} is not a non-negative integer; expected "
                                 f"{meaning} (torchrun sets it)")
            values[name] = int(text)
        if values["WORLD_SIZE"] < 1 or values["RANK"] >= values["WORLD_SIZE"]:
            raise ValueError(f"RANK={values['RANK']!r} and WORLD_SIZE={values['WORLD_SIZE']!r} are inconsistent; "
                             "expected 0 <= RANK < WORLD_SIZE")
        return cls(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"])

    @property
    def shard(self) -> tuple[int, int]:
        """The part of the samples this rank writes, as ``--shard RANK/WORLD_SIZE``."""
        return self.rank, self.world_size

    def device(self, requested: str | None) -> str:
        """This rank's GPU for ``cuda`` (or nothing requested, when CUDA is there), else what was asked.

        The GPU is ``cuda:LOCAL_RANK``; with more ranks on a node than GPUs (e.g. 2 ranks on 1 GPU) ranks share
        them, ``cuda:(LOCAL_RANK mod the GPU count)``."""
        import torch
        if requested in (None, "cuda") and (requested == "cuda" or torch.cuda.is_available()):
            count = torch.cuda.device_count()
            return f"cuda:{self.local_rank % count if count else self.local_rank}"
        return requested or "cpu"


def check_shard(ranks: Ranks | None, shard) -> tuple[int, int] | None:
    """The shard a process writes: ``shard`` alone, the ranks' alone, or both when they agree."""
    if ranks is None:
        return shard
    if shard is not None and tuple(shard) != ranks.shard:
        raise ValueError(f"--shard {shard[0]}/{shard[1]} disagrees with torchrun's RANK={ranks.rank} "
                         f"WORLD_SIZE={ranks.world_size}; under torchrun leave out --shard (each rank writes "
                         "RANK/WORLD_SIZE)")
    return ranks.shard


@contextmanager
def process_group(ranks: Ranks | None, device: str = "cpu"):
    """torch.distributed joined for the duration (nothing for a plain process); nccl on CUDA, gloo otherwise."""
    if ranks is None or ranks.world_size == 1:
        yield
        return
    import torch
    import torch.distributed as dist
    backend = _backend(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))  # nccl's object collectives run on the current device
    if not dist.is_initialized():  # the timeout bounds the wait at a collective: compare's gather waits for the
        # slowest rank's runs, so it is hours, not torch's default 30 minutes; a dead rank is noticed by torchrun
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size,
                                timeout=datetime.timedelta(hours=COLLECTIVE_TIMEOUT_H))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _backend(device) -> str:
    """nccl when every rank of the node has a GPU of its own; gloo on CPU, and where ranks share a GPU (nccl
    refuses two ranks on one device; the collectives here carry a few small Python objects, so gloo costs
    nothing)."""
    import torch
    if not str(device).startswith("cuda"):
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.device_count() >= local_world else "gloo"


def gather(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` outside a process group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank0(work, what: str):
    """Run ``work()`` on rank 0 while the other ranks wait; its result on rank 0, None elsewhere (or ``work()``
    itself outside a process group). A failure on rank 0 (a ValueError or OSError) is raised there as it is, and
    on every other rank as a ValueError saying that rank 0 could not prepare ``what``, so no rank waits forever."""
    result, error = None, None
    if rank() == 0:
        try:
            result = work()
        except (ValueError, OSError) as exc:
            error = exc
    first = gather(None if error is None else f"{type(error).__name__}: {error}")[0]
    if error is not None:
        raise error
    if first is not None:
        raise ValueError(f"rank 0 could not prepare {what}: {first}")
    return result


def rank() -> int:
    """This process's rank in the process group (0 outside one)."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
