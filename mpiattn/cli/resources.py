"""What the command line checks and sets up before any work: the launch, and BLAS threads.

Launch sanity
    A launcher that gives the ranks no way to find each other (``srun
    --mpi=none``, a site with ``MpiDefault=none``, or mpi4py built against
    another MPI than the launcher's) starts ``N`` independent single-rank
    jobs, each believing it is alone: ``N`` times the work, ``N`` processes
    racing to rename one output. :func:`launch_problem` compares the
    communicator size with what the launcher announced in the environment
    (``OMPI_COMM_WORLD_SIZE`` from Open MPI, ``PMI_SIZE`` from Hydra and
    PMI-2 launchers, ``SLURM_STEP_NUM_TASKS`` inside an ``srun`` step). It
    uses no communication: a singleton cannot reach its siblings anyway.

Threads
    Each rank gets its share of its node's cores for BLAS (cores usable by
    the node's ranks divided by their number, at least 1), set with
    threadpoolctl. ``--threads N`` overrides that; so do ``OMP_NUM_THREADS``,
    ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` when set (the BLAS read
    them itself at start-up, and they are left alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..comm import node as nodes

__all__ = ["LAUNCH_VARS", "THREAD_VARS", "SHARE", "REQUESTED", "launch_problem", "launcher_rank",
           "Threads", "configure_threads"]

#: Environment variables in which launchers announce the job size, most specific first.
LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")
#: Environment variables that fix the BLAS thread count.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: ``Threads.source`` of the default: the node's cores divided among its ranks.
SHARE = "share of the node"
#: ``Threads.source`` when ``--threads`` chose the count.
REQUESTED = "--threads"

_FIX = {
    "SLURM_STEP_NUM_TASKS": "srun started the tasks without an MPI plugin that this MPI speaks: "
                            "use `srun --mpi=pmi2` (MPICH and most MPIs) or `srun --mpi=pmix` "
                            "(Open MPI), see `srun --mpi=list`, or set MpiDefault in slurm.conf",
    "PMI_SIZE": "the launcher's MPI is not the one mpi4py loaded: use the mpiexec of the MPI "
                "that `python -m mpi4py --mpi-library` shows, or build mpi4py against the "
                "launcher's MPI (`python -m pip install --no-binary=mpi4py mpi4py` with its "
                "mpicc on PATH); under SLURM try `srun --mpi=pmi2`",
    "OMPI_COMM_WORLD_SIZE": "Open MPI's mpirun started the ranks but mpi4py loaded another "
                            "MPI: build mpi4py against Open MPI (`python -m pip install "
                            "--no-binary=mpi4py mpi4py` with Open MPI's mpicc on PATH), or use "
                            "the mpiexec of the MPI that `python -m mpi4py --mpi-library` shows",
}


def _announced(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, size) of the most specific launcher announcement, or None."""
    for var in LAUNCH_VARS:
        text = env.get(var, "").strip()
        if text.isdigit() and int(text) > 0:
            return var, int(text)
    return None


def launch_problem(size: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why the launch looks broken (the communicator has ``size`` ranks), or None (local).

    ``OMPI_COMM_WORLD_SIZE`` and ``PMI_SIZE`` come from the MPI launcher
    itself and win over ``SLURM_STEP_NUM_TASKS`` (``mpiexec`` inside an
    allocation starts its proxies with ``srun``: one task per node). The
    batch step itself exports no ``SLURM_STEP_NUM_TASKS`` (only
    ``SLURM_NTASKS``; SLURM 22.05, checked by the CI lane ``slurm``), so a
    program started directly in a batch script is a plain singleton.
    """
    env = os.environ if env is None else env
    found = _announced(env)
    if found is None or found[1] == size:
        return None
    var, announced = found
    alone = (f"{announced} processes were started ({var}={announced}) but each one's MPI "
             f"sees {'only itself' if size == 1 else f'{size} ranks'}")
    return (f"{alone}, so they would each run the whole job (and race to write one output). "
            f"Fix: {_FIX[var]}.")


def launcher_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank according to the launcher's environment (None when unknown)."""
    env = os.environ if env is None else env
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        text = env.get(var, "").strip()
        if text.isdigit():
            return int(text)
    return None


@dataclass
class Threads:
    """The BLAS threads of this rank.

    Attributes
    ----------
    count : int or None
        Threads per rank (None: no thread pool found, or threadpoolctl missing).
    source : str
        Why that many: ``--threads``, an environment variable, or the share.
    node : NodeInfo
    limiter : object or None
        What restores the previous limits and environment.
    """

    count: int | None
    source: str
    node: nodes.NodeInfo
    limiter: Any = None
    requested: int | None = None

    def describe(self) -> str:
        """E.g. ``1 per rank (OMP_NUM_THREADS=1; 2 ranks on 2 cores on this node)``.

        With ``--threads N`` above what the BLAS library can run, it says so
        (``64 per rank (--threads 100000: the BLAS library runs at most 64; ...)``).
        """
        n = self.node
        count = "unknown" if self.count is None else f"{self.count} per rank"
        where = f"{n.local_size} rank(s) on {n.cores} core(s) on this node"
        source = self.source
        if self.requested is not None:
            source = f"--threads {self.requested}"
            if self.count is not None and self.count < self.requested:
                source += f": the BLAS library runs at most {self.count}"
        return f"{count} ({where})" if source == SHARE else f"{count} ({source}; {where})"

    def counted(self) -> "Threads":
        """Fill ``count`` from the thread pools as they are now; returns self."""
        self.count = nodes.blas_threads()
        return self

    def restore(self) -> None:
        """Put back the thread limits from before :func:`configure_threads`."""
        if self.limiter is not None:
            limiter, self.limiter = self.limiter, None
            limiter.restore_original_limits()


class _Limits:
    """threadpoolctl limits on the pools loaded now, and the thread variables for those loaded later."""

    def __init__(self, n: int):
        self.saved = {var: os.environ.get(var) for var in THREAD_VARS}
        os.environ.update({var: str(n) for var in THREAD_VARS})  # e.g. torch's pool, made later
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            self.limiter = None
        else:
            self.limiter = threadpool_limits(limits=n)

    def restore_original_limits(self) -> None:
        for var, value in self.saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if self.limiter is not None:
            self.limiter.restore_original_limits()


def _threadpool_limits(n: int) -> Any:
    return _Limits(n)


def configure_threads(node: nodes.NodeInfo, requested: int | None,
                      env: Mapping[str, str] | None = None) -> Threads:
    """Set this rank's BLAS threads (local): ``--threads``, else the environment, else the share."""
    env = os.environ if env is None else env
    if requested is not None:
        return Threads(None, REQUESTED, node, _threadpool_limits(requested), requested).counted()
    given = [f"{var}={env[var]}" for var in THREAD_VARS if env.get(var, "").strip()]
    if given:
        return Threads(nodes.blas_threads(), ", ".join(given), node)
    return Threads(None, SHARE, node, _threadpool_limits(node.share())).counted()
