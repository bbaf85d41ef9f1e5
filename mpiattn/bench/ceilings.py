"""GEMM ceilings: how fast this machine multiplies, measured beside attention.

Two ceilings, each run on every rank at once (so a 2-rank ceiling includes
what two busy cores cost each other):

* **square**: :func:`mpiattn.gemm.matmul` of two ``S x S`` matrices
  (default 2048), the machine's ceiling: operands in the input dtype (on a
  GPU float16 goes to the tensor cores, float32 accumulation), the same call
  the kernels make;
* **tile**: the GEMMs of the native engine's tile shapes and operand views
  (``block`` or :data:`mpiattn.kernels.DEFAULT_TILE` rows), e.g.
  ``(512x64)(64x512)`` and ``(512x512)(512x64)`` forward, plus the three
  backward ones, through :func:`mpiattn.gemm.matmul` with the kernels'
  operand dtypes (:func:`mpiattn.gemm.operand_dtype`).

:func:`attach` measures both right after an attention case, in its process,
so that a change of load on the machine cannot skew the fractions.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .. import backend, gemm
from ..kernels import DEFAULT_TILE
from .tasks import Task, tile_key
from ..timing import Timer

__all__ = ["gemm_rate", "gemm_square", "gemm_tile", "attach"]


def gemm_rate(timer: Timer, fn: Callable[[], None], flops: float, repeat: int,
              min_time: float = 0.05) -> tuple[float, list[float], float]:
    """Per-rank GFLOP/s of ``fn`` (every rank runs it at once).

    Calls are batched so that a sample lasts at least ``min_time`` seconds.

    Returns
    -------
    rate : float
        GFLOP/s by the median wall time.
    times : list of float
        Wall seconds per sample.
    rate_cpu : float
        GFLOP/s by the median CPU time.
    """
    fn()
    wall, _, _ = timer.once(fn)
    reps = int(timer.comm.bcast_obj(max(1, int(math.ceil(min_time / max(wall, 1e-6))))))

    def many() -> None:
        for _ in range(reps):
            fn()

    m = timer.measure(many, 0, repeat)
    return flops * reps / m.median / 1e9, m.times, flops * reps / m.cpu_median / 1e9


def gemm_square(timer: Timer, t: Task) -> list[dict]:
    """The square-GEMM ceiling (``t.gemm_size``, ``t.dtype``)."""
    c, xp = timer.comm, timer.xp
    size, dt = int(t.gemm_size), np.dtype(t.dtype)
    rng = np.random.default_rng([5, c.rank])
    op = gemm.operand_dtype(xp, dt)
    a = backend.to_device(rng.standard_normal((size, size)).astype(op), xp)
    b = backend.to_device(rng.standard_normal((size, size)).astype(op), xp)
    out = xp.empty((size, size), dtype=backend.accum_dtype(dt))
    rate, times, rate_cpu = gemm_rate(timer, lambda: gemm.matmul(a, b, out), 2.0 * size**3, t.repeat)
    return [dict(t.to_dict(), P=c.size, status="ok", gflops_per_rank=rate, times_s=times,
                 gflops_per_rank_cpu=rate_cpu, shape=f"({size}x{size})({size}x{size})")]


def gemm_tile(timer: Timer, t: Task, P: int | None = None) -> list[dict]:
    """GEMMs of attention's tile shapes for ``P`` ranks (default the job's), with the kernels' operand views."""
    c, xp = timer.comm, timer.xp
    acc = backend.accum_dtype(t.dtype)
    B, Hkv, G, E, Ev = t.B, t.Hkv, t.H // t.Hkv, t.E, t.Ev
    T = int(t.block or DEFAULT_TILE)
    P = c.size if P is None else P
    Tq = min(T, -(-t.N // P))
    Tk = min(T, -(-t.M // P))
    R = Tq * G
    rng = np.random.default_rng([6, c.rank])

    op = gemm.operand_dtype(xp, t.dtype)

    def arr(*shape: int, dtype: Any = acc) -> Any:
        return backend.to_device(rng.standard_normal(shape).astype(dtype), xp)

    qs, do = arr(B, Hkv, 4 * R, E, dtype=op), arr(B, Hkv, 4 * R, Ev, dtype=op)
    kc, vc = arr(B, Hkv, Tk, E, dtype=op), arr(B, Hkv, Tk, Ev, dtype=op)
    S, dS = arr(B, Hkv, R, Tk), arr(B, Hkv, R, Tk)
    P, dS_op = arr(B, Hkv, R, Tk, dtype=op), arr(B, Hkv, R, Tk, dtype=op)
    o_r, dq_r = arr(B, Hkv, R, Ev), arr(B, Hkv, R, E)
    dk_r, dv_r = arr(B, Hkv, Tk, E), arr(B, Hkv, Tk, Ev)
    q_t, do_t = qs[..., R:2 * R, :], do[..., R:2 * R, :]
    kT, vT = kc.swapaxes(-1, -2), vc.swapaxes(-1, -2)

    def fwd() -> None:
        gemm.matmul(q_t, kT, S)
        gemm.matmul(P, vc, o_r, beta=1.0)

    def bwd() -> None:
        gemm.matmul(q_t, kT, S)
        gemm.matmul(do_t, vT, dS)
        gemm.matmul(P.swapaxes(-1, -2), do_t, dv_r, beta=1.0)
        gemm.matmul(dS_op, kc, dq_r, beta=1.0)
        gemm.matmul(dS_op.swapaxes(-1, -2), q_t, dk_r, beta=1.0)

    pairs = B * Hkv * R * Tk
    f_fwd, f_bwd = 2.0 * pairs * (E + Ev), 2.0 * pairs * (3 * E + 2 * Ev)
    r_fwd, times_f, c_fwd = gemm_rate(timer, fwd, f_fwd, t.repeat)
    r_bwd, times_b, c_bwd = gemm_rate(timer, bwd, f_bwd, t.repeat)
    r_both = (f_fwd + f_bwd) / (f_fwd / r_fwd + f_bwd / r_bwd)
    c_both = (f_fwd + f_bwd) / (f_fwd / c_fwd + f_bwd / c_bwd)
    shape = f"B*Hkv={B * Hkv}: ({R}x{E})({E}x{Tk}), ({R}x{Tk})({Tk}x{Ev})"
    base = dict(t.to_dict(), P=P, status="ok")
    return [dict(base, **{"pass": "fwd"}, gflops_per_rank=r_fwd, times_s=times_f, gflops_per_rank_cpu=c_fwd,
                 shape=shape),
            dict(base, **{"pass": "bwd"}, gflops_per_rank=r_bwd, times_s=times_b, gflops_per_rank_cpu=c_bwd,
                 shape=shape + " + 3 backward GEMMs"),
            dict(base, **{"pass": "fwdbwd"}, gflops_per_rank=r_both, gflops_per_rank_cpu=c_both,
                 shape=shape + " + 3 backward GEMMs")]


def attach(timer: Timer, t: Task, records: list[dict]) -> list[dict]:
    """Measure both ceilings now for attention task ``t`` and note them on its timed ``records``.

    Returns the ceiling records (``measured_with`` names the case).
    """
    P = records[0]["P"] if records else timer.comm.size
    sq = gemm_square(timer, t.replace(workload="gemm_square", repeat=5))
    tiles = gemm_tile(timer, t.replace(workload="gemm_tile", repeat=5, tile_key=tile_key(t.to_dict(), P)), P)
    rate = {r["pass"]: r["gflops_per_rank"] for r in tiles}
    for r in records:
        if r.get("status") == "ok" and "gflops_per_rank" in r:
            r["gemm_square_gflops_here"] = sq[0]["gflops_per_rank"]
            r["gemm_tile_gflops_here"] = rate[r["pass"]]
    where = f"{t.impl}{'/' + t.engine if t.engine else ''} N={t.N}"
    return [dict(g, P=P, measured_with=where) for g in sq + tiles]
