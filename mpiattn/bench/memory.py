"""Memory per rank: what a process holds (measured) and what a case should need (modelled).

* :class:`MemoryMeter` measures: the peak resident set size of the process
  (``ru_maxrss``) on CPU, which only means something in a fresh process per
  case, or the high-water of CuPy's memory pool on GPU.
* :func:`estimate_bytes` models the arrays each implementation keeps alive
  at its peak; the ``--max-memory`` guard and the memory-per-rank curve use
  it, and every record shows it beside the measured peak.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import numpy as np

from .. import backend
from ..layouts import local_length
from .tasks import Task

__all__ = ["MemoryMeter", "rss_now", "rss_peak", "shard_bytes", "estimate_bytes"]


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
    """Peak resident set size of this process in bytes (``ru_maxrss``).

    Linux updates its counters in batches, so the current size read just
    before may exceed ``ru_maxrss`` by a few pages: the larger one is returned.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak if sys.platform == "darwin" else peak * 1024), rss_now())


class MemoryMeter:
    """Peak memory of this rank: RSS high-water on CPU, CuPy pool high-water on GPU.

    On GPU the default CuPy allocator is wrapped so that every allocation
    updates the high-water of the pool's used bytes.

    Parameters
    ----------
    xp : module
        numpy or cupy.
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
    s = np.dtype(t.dtype).itemsize
    n = local_length(t.N, rank, P, t.layout)
    m = local_length(t.M, rank, P, t.layout)
    q_out = t.B * t.H * n * (t.E + t.Ev)
    kv = t.B * t.Hkv * m * (t.E + t.Ev)
    return s * (q_out + kv) * (2 if grads else 1)


def estimate_bytes(t: Task, P: int, pass_: str) -> int:
    """Estimated peak bytes per rank above the baseline for attention task ``t`` at ``P`` ranks.

    A model of the arrays each implementation keeps alive at its peak
    (inputs, folded copies, accumulators, one score tile, pieces in flight).

    Parameters
    ----------
    t : Task
    P : int
    pass_ : {"fwd", "fwdbwd"}

    Returns
    -------
    int
    """
    B, H, Hkv, E, Ev = t.B, t.H, t.Hkv, t.E, t.Ev
    s = np.dtype(t.dtype).itemsize
    a = backend.accum_dtype(t.dtype).itemsize
    cast = 0 if s == a else 1                           # float16 keeps float32 copies besides the inputs
    impl = t.impl
    one = t.single_process
    n = t.N if one else -(-t.N // P)
    m = t.M if one else -(-t.M // P)
    G = H // Hkv
    q_row, o_row, kv_row = B * H * E, B * H * Ev, B * Hkv * (E + Ev)    # words per row
    inputs = s * (n * q_row + m * kv_row)
    out_lse = s * n * o_row + a * B * H * n
    dout = s * n * o_row
    if impl == "dense":                                 # the (B, H, N, M) probabilities, kept for backward
        scores = a * B * H * n * m
        upcast = cast * a * (n * q_row + m * kv_row * G)
        fwd = inputs + upcast + scores + out_lse + a * n * o_row
        bwd = fwd + dout + scores + a * (n * q_row + m * kv_row * G) * 2
        return int(fwd if pass_ == "fwd" else bwd)
    if impl == "torch":                                 # flash kernels: O(rows) extra
        fwd = inputs + out_lse + a * n * o_row
        bwd = inputs + out_lse + dout + inputs + cast * a * (n * q_row + m * kv_row)
        return int(fwd if pass_ == "fwd" else max(fwd, bwd))
    if impl == "materialized":                          # n x M scores per head, a few of them alive
        scores = a * B * H * n * t.M
        fwd = inputs + out_lse + 3 * scores + a * n * (q_row + o_row)
        bwd = inputs + out_lse + dout + 4 * scores + a * (n * q_row * 2 + m * kv_row * G * 2)
        return int(fwd if pass_ == "fwd" else max(fwd, bwd))
    # blocked strategies: ring, allgather, ulysses (auto is one of them)
    T = int(t.block or 512)
    hp = P if impl == "ulysses" else 1                  # ulysses: whole sequence, H/P heads
    n_loc = t.N if impl == "ulysses" else n
    m_loc = t.M if impl == "ulysses" else m
    Tq, Tk = min(T, n_loc), min(T, m_loc)
    BK = max(1, B * Hkv // hp)
    tile_f = a * BK * (Tq * G * (Tk + Ev + 8) + Tk * (E + Ev))
    tile_b = a * BK * (Tq * G * (2 * Tk + E + 4) + 2 * Tk * (E + Ev))
    rounds = P if impl == "allgather" else 1
    pieces_f = 3 * rounds * Tk * kv_row * s
    pieces_b = pieces_f + 3 * rounds * Tk * kv_row * a
    moved = 0
    if impl == "ulysses":                               # head-sharded copies, with their send buffers
        moved = 2 * s * (t.N * (q_row + o_row) + t.M * kv_row) // P
    rows = a * n_loc * B * H // hp                      # one accumulation word per (query row, head)
    # forward: folded q, running o and its normalised copy, m and l, one tile, pieces in flight
    fwd = inputs + moved + rows * (E + 2 * Ev + 3) + cast * s * n * o_row + tile_f + pieces_f
    # backward: out, lse, dout kept; folded q and dout, dq, dk, dv accumulators, tiles, pieces
    bwd = (inputs + out_lse + dout + moved + rows * (2 * E + Ev + 2) + a * m_loc * kv_row // hp
           + cast * s * (n * q_row + m * kv_row) + tile_b + pieces_b)
    return int(fwd if pass_ == "fwd" else max(fwd, bwd))
