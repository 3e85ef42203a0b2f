"""Running the analysis on a dask.distributed cluster: a local one of N worker processes, or one at an address.

:func:`dask_cluster` yields a :class:`distributed.Client` (or None: the single process) for the ``scheduler``
argument of :func:`~mar_probe.analysis.run_summary` and :func:`mar_probe.plot.report.write_figures`. The graphs
are the same either way; on a cluster each worker reads its own chunks from the store (the graph holds the
store's path, not its data), so the results equal the single-process ones and every worker must see the store
at the same path (a shared file system for a cluster of several machines).
"""
from __future__ import annotations

import contextlib
import logging

DEFAULT_TIMEOUT = 10.0  # seconds to reach a scheduler (and for it to have a worker)


class SchedulerError(ValueError):
    """A dask scheduler that cannot be reached, or one without workers."""


def _check_args(scheduler, workers, threads_per_worker, timeout) -> None:
    if scheduler is not None and workers is not None:
        raise ValueError(f"give --scheduler (the address of a running cluster) or --workers (a local cluster), not "
                         f"both; got scheduler={scheduler!r} and workers={workers!r}")
    for name, value, what in (("workers", workers, "local worker processes"),
                              ("threads_per_worker", threads_per_worker, "threads of each worker")):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer ({what}), got {value!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _probe(address: str, timeout: float) -> None:
    """Open and close one connection to ``address`` within ``timeout``; raise :class:`SchedulerError` if it fails.

    A :class:`distributed.Client` that fails to connect leaves an object whose finaliser blocks the interpreter's
    exit and prints a traceback, so the address is tried first (in a thread: callers may run an event loop).
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from distributed.comm import connect

    async def once():
        comm = await connect(address, timeout=timeout)
        await comm.close()

    with ThreadPoolExecutor(1) as pool:
        try:
            pool.submit(asyncio.run, once()).result()
        except (OSError, ValueError, TypeError) as exc:
            raise SchedulerError(f"scheduler {address!r} cannot be reached within {timeout:g} s ({exc}); expected "
                                 "the address of a running `dask scheduler`, e.g. tcp://HOST:8786") from None


def _connect(address: str, timeout: float):
    from distributed import Client
    _probe(address, timeout)
    client = Client(address, timeout=timeout, set_as_default=False)
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError:
        client.close()
        raise SchedulerError(f"scheduler {address!r} has no worker after {timeout:g} s; start some with "
                             f"`dask worker {address}` on machines that see the store") from None
    return client


@contextlib.contextmanager
def dask_cluster(*, scheduler: str | None = None, workers: int | None = None, threads_per_worker: int = 1,
                 timeout: float = DEFAULT_TIMEOUT, dashboard_address: str = "127.0.0.1:0"):
    """A :class:`distributed.Client` for the analysis, closed (with its local cluster) on exit.

    Parameters
    ----------
    scheduler : str, optional
        Address of a running scheduler (``tcp://HOST:8786``, from ``dask scheduler``).
    workers : int, optional
        Start a :class:`distributed.LocalCluster` of this many worker processes instead.
    threads_per_worker : int
        Threads of each local worker.
    timeout : float
        Seconds to reach ``scheduler`` and for it to have a worker.
    dashboard_address : str
        HTTP address of the local cluster's scheduler (its dashboard, with bokeh installed): by default a free
        port of this machine, so that several clusters do not compete for 8787.

    Yields
    ------
    distributed.Client or None
        None when neither ``scheduler`` nor ``workers`` is given: compute in this process.

    Raises
    ------
    SchedulerError
        ``scheduler`` cannot be reached within ``timeout`` (a ValueError naming the address), or has no worker.
    """
    _check_args(scheduler, workers, threads_per_worker, timeout)
    if scheduler is None and workers is None:
        yield None
        return
    if scheduler is not None:
        with _connect(scheduler, timeout) as client:
            yield client
        return
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=workers, threads_per_worker=threads_per_worker, processes=True,
                      dashboard_address=dashboard_address, silence_logs=logging.ERROR) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield client


def using_scheduler(scheduler):
    """A context in which dask computes on ``scheduler`` (a name or a Client); None: dask's default."""
    import dask
    return contextlib.nullcontext() if scheduler is None else dask.config.set(scheduler=scheduler)
