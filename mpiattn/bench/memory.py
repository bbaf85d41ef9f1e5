"""Memory per rank: what a process holds (measured) and what a case should need (the library's models).

* :class:`MemoryMeter` measures: the peak resident set size of the process
  (``ru_maxrss``) on CPU, which only means something in a fresh process per
  case, or the high-water of CuPy's memory pool on GPU.
* :func:`estimate_bytes` asks the library: the strategy's
  :meth:`~mpiattn.strategies.base.Strategy.memory` (the one ``auto`` picks
  or the task names; a model of the native engine's blocks and tiles), or
  :func:`~mpiattn.kernels.reference.dense_nbytes` for the dense peer. The
  ``--max-memory`` guard and the memory curve use it, and every record
  shows it beside the measured peak.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import numpy as np

from .. import backend
from ..kernels import DEFAULT_TILE, engines
from ..kernels.reference import dense_nbytes
from ..layouts import local_length, local_lengths
from ..comm.topology import Topology
from ..strategies import machines, registry
from ..strategies.base import Strategy
from ..strategies.machines import Machine
from .tasks import DENSE, Task

__all__ = ["MemoryMeter", "rss_now", "rss_peak", "shard_bytes", "machine_for", "plan_call", "estimate_bytes"]


def rss_now() -> int:
    """Current resident set size in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil
            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - optional
            return 0


def rss_peak() -> int:
    """Peak resident set size in bytes: ``ru_maxrss``, or the current size where Linux's batched
    counters have not caught up yet (by a few pages)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak if sys.platform == "darwin" else peak * 1024), rss_now())


class MemoryMeter:
    """Peak memory of this rank: RSS high-water on CPU, CuPy pool high-water on GPU.

    Parameters
    ----------
    xp : module
        numpy, or cupy: then the default allocator is wrapped so that every
        allocation updates the high-water of the pool's used bytes.
    """

    def __init__(self, xp: Any):
        self.gpu = xp is not np
        self.peak_used = 0
        if self.gpu:
            self.pool = xp.get_default_memory_pool()
            xp.cuda.set_allocator(self._malloc)

    @property
    def kind(self) -> str:
        """What :meth:`peak` reads (recorded as ``memory_kind``)."""
        return "cupy-pool-high-water" if self.gpu else "ru_maxrss"

    def _malloc(self, size: int) -> Any:
        mem = self.pool.malloc(size)
        self.peak_used = max(self.peak_used, self.pool.used_bytes())
        return mem

    def now(self) -> int:
        return int(self.pool.used_bytes()) if self.gpu else rss_now()

    def peak(self) -> int:
        return int(self.peak_used) if self.gpu else rss_peak()

    def reset(self) -> None:
        """Restart the GPU high-water (the CPU one cannot be reset: use a fresh process)."""
        if self.gpu:
            self.peak_used = int(self.pool.used_bytes())


def shard_bytes(t: Task, P: int, rank: int = 0, grads: bool = False) -> int:
    """Bytes of this rank's q, k, v, out shards (and dout, dq, dk, dv with ``grads``)."""
    n = local_length(t.N, rank, P, t.layout)
    m = local_length(t.M, rank, P, t.layout)
    words = t.B * t.H * n * (t.E + t.Ev) + t.B * t.Hkv * m * (t.E + t.Ev)
    return np.dtype(t.dtype).itemsize * words * (2 if grads else 1)


def machine_for(t: Task) -> Machine:
    """The machine the cost model assumes for task ``t``, as the library finds it
    (``$MPIATTN_MACHINE``, else the device's profile)."""
    return machines.load(machines.resolve_name(None, t.spec().device))


def plan_call(t: Task, P: int, topology: Topology | None = None) -> tuple[Strategy, int]:
    """The strategy :func:`mpiattn.attention` would run for task ``t`` on ``P`` ranks (on one node,
    unless ``topology`` is given), and its block rows (``t.block``, else the engine's preference
    for the longest key/value shard).

    Raises
    ------
    ValueError
        The task's strategy does not support the call (the registry's reason).
    """
    spec = t.spec()
    topology = Topology.blocks(P, P) if topology is None else topology
    engine = engines.get(engines.AUTO[0] if spec.options.engine == "auto" else spec.options.engine)
    block = t.block or engine.block_rows(spec, max(local_lengths(t.M, P, t.layout)))
    machine = machine_for(t) if registry.needs_choice(spec.options.strategy) else None
    strategy, _ = registry.resolve(spec, topology, block, machine)
    return strategy, block


def estimate_bytes(t: Task, P: int, pass_: str) -> int:
    """Estimated peak bytes per rank (inputs included) of attention task ``t`` at ``P`` ranks for
    ``pass_`` ("fwd" or "fwdbwd"). The peers run on one process: ``dense`` by
    :func:`~mpiattn.kernels.reference.dense_nbytes` (every row at once, accumulation dtype),
    ``torch`` as the strategy ``auto`` picks at ``P = 1`` (a blocked online softmax, like torch's
    flash kernels). Raises ValueError where the task's strategy does not support the call.
    """
    if t.impl == DENSE:
        shapes = ((t.B, t.H, t.N, t.E), (t.B, t.Hkv, t.M, t.E), (t.B, t.Hkv, t.M, t.Ev))
        return dense_nbytes(*shapes, block_rows=None, itemsize=backend.accum_dtype(t.dtype).itemsize)
    P = 1 if t.single_process else P
    strategy, _ = plan_call(t, P)
    # the models count the native engine's blocks and score tiles: block_size rows, else its tile
    return int(strategy.memory(t.spec(), P, t.block or DEFAULT_TILE, pass_ != "fwd"))
