"""The ranks that share a node, its cores, and the BLAS threads they start.

NumPy's BLAS starts one thread per core in every process by default, so
``P`` ranks on a node of ``C`` cores run ``P * C`` threads on ``C`` cores,
which slows every matrix product down many times (the README's example ran
9-36x slower). The command line gives each rank its share of the cores
(:mod:`mpiattn.cli.resources`); the library leaves thread pools alone and
only warns, once per process, when a communicator's ranks on a node use
more BLAS threads than the node has cores (:func:`warn_if_oversubscribed`).

:func:`node_info` is collective (``Split_type`` on the communicator and one
allgather on the node); :class:`mpiattn.comm.core.Comm` calls it once, when
it is created at a point every rank reaches, and keeps the result.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["NodeInfo", "node_info", "usable_cores", "blas_threads", "OversubscriptionWarning",
           "oversubscription", "warn_if_oversubscribed"]


class OversubscriptionWarning(RuntimeWarning):
    """More BLAS threads on a node than it has cores."""


@dataclass(frozen=True)
class NodeInfo:
    """This rank's view of its node.

    Attributes
    ----------
    local_rank, local_size : int
        This rank's index among the communicator's ranks on its node, and
        their number.
    cores : int
        Cores usable by those ranks together (the union of their CPU
        affinity masks).
    own_cores : int
        Cores this rank may run on (its affinity mask).
    """

    local_rank: int
    local_size: int
    cores: int
    own_cores: int

    def share(self) -> int:
        """Threads per rank that fill the node without oversubscribing it (at least 1)."""
        return max(1, min(self.own_cores, self.cores // max(1, self.local_size)))


def _affinity() -> frozenset:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """Cores this process may run on (local)."""
    return len(_affinity())


def node_info(mpi_comm: Any) -> NodeInfo:
    """Who shares this rank's node, and how many cores they have (collective on ``mpi_comm``)."""
    own = _affinity()
    if mpi_comm.Get_size() == 1:
        return NodeInfo(0, 1, len(own), len(own))
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        masks = node.allgather(own)
        return NodeInfo(node.Get_rank(), node.Get_size(), len(frozenset().union(*masks)), len(own))
    finally:
        node.Free()


def blas_threads() -> int | None:
    """The largest thread count of the BLAS/OpenMP pools loaded in this process (threadpoolctl).

    None when threadpoolctl is not installed or finds no pool. Asked anew at
    each call (a few milliseconds): callers ask once per communicator.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    counts = [int(p.get("num_threads") or 0) for p in threadpool_info()
              if p.get("user_api") in ("blas", "openmp")]
    return max(counts) if counts else None


def oversubscription(node: NodeInfo, threads: int | None) -> str | None:
    """A sentence when ``node.local_size * threads`` exceeds the node's cores, else None.

    One thread per rank is never reported: fewer threads cannot help (more
    ranks than cores is the launcher's choice).
    """
    if threads is None or threads <= 1 or node.local_size * threads <= node.cores:
        return None
    fit = node.share()
    return (f"mpiattn: {node.local_size} ranks on this node each run {threads} BLAS threads, "
            f"{node.local_size * threads} threads on {node.cores} cores: matrix products will "
            f"be many times slower. Set OMP_NUM_THREADS={fit} (or call "
            f"threadpoolctl.threadpool_limits({fit})) in each rank; `python -m mpiattn` does this "
            "itself")


def warn_if_oversubscribed(node: NodeInfo) -> None:
    """Warn (on the node's first rank) when the node is oversubscribed (local).

    :class:`mpiattn.comm.core.Comm` calls it once per communicator; Python's
    warning filters then show it once per place in the user's code.
    """
    if node.local_rank != 0 or node.local_size == 1:
        return
    text = oversubscription(node, blas_threads())
    if text:
        warnings.warn(text, OversubscriptionWarning, stacklevel=4)
