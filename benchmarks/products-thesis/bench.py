#!/usr/bin/env python
"""The thesis' product shapes: ``matmul_nt``/``nn``/``tn`` beside one ``numpy.matmul`` of the whole product.

Run under ``mpiexec -n P`` (P = 1 or 2 here, never more ranks than cores);
see README.md in this folder for the commands and the results.

Shapes (float32, T rows, width d)::

    nt  A (T x d),  B (T x d)  ->  A·Bᵀ (T x T)
    nn  A (T x T),  B (T x d)  ->  A·B  (T x d)
    tn  A (T x T),  B (T x d)  ->  Aᵀ·B (T x d)

Every repeat times, in this order and with barriers between them:

``dist``
    the distributed call on all P ranks (wall time of the slowest rank);
``numpy``
    one ``numpy.matmul`` of the whole product on rank 0 (the others sleep);
    the "ideal" distributed time is ``numpy / P``;
``local``
    (P > 1) every rank at once runs a plain ``numpy.matmul`` of its own share
    of the work (no communication): what the machine gives P concurrent
    GEMMs, the ceiling of any distributed product on it.

Each call makes its output anew (the first touch of its pages is timed, as a single call
pays it), or, with ``--reuse-output``, writes into the output its warm-up call made
(``out=``, for ``numpy.matmul`` too): the steady state of a loop.

Reported: ``dist / numpy`` (P = 1; 1.0 = no overhead) and the fraction of
ideal ``(numpy / P) / dist`` (P > 1), each as the median and the range over
the repeats (each ratio from the same repeat), and ``(numpy / P) / local``
for the machine's own ceiling. Rank 0 draws the whole operands and its
shards are views of them; the other ranks draw their own shards (values do
not matter for timing; the tests check the results).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiattn
from mpiattn.layouts import local_length


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    rows = [f"{i.get('internal_api')} {i.get('version')} kernel={i.get('architecture')} "
            f"threads={i.get('num_threads')}" for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(rows) or "no BLAS found"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def shapes(op: str, T: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global shapes of A and B."""
    return {"nt": ((T, d), (T, d)), "nn": ((T, T), (T, d)), "tn": ((T, T), (T, d))}[op]


def draw(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def quiet_barrier(comm: MPI.Intracomm) -> None:
    """A barrier whose waiting ranks sleep instead of polling (they must not take CPU from rank 0)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def timed(comm: MPI.Intracomm, fn) -> float:
    """Wall seconds of ``fn()`` on every rank at once (the slowest rank); the result is dropped."""
    quiet_barrier(comm)
    t0 = time.perf_counter()
    r = fn()
    dt = time.perf_counter() - t0
    del r
    quiet_barrier(comm)
    return comm.allreduce(dt, op=MPI.MAX)


def run_op(comm: MPI.Intracomm, op: str, T: int, d: int, repeat: int, block: int | None,
           reuse: bool = False) -> dict:
    P, rank = comm.size, comm.rank
    (sa, sb) = shapes(op, T, d)
    rows = [local_length(T, r, P, "contiguous") for r in range(P)]
    lo = sum(rows[:rank])
    rng = np.random.default_rng([rank, T, d])
    if rank == 0:
        A, B = draw(rng, sa), draw(rng, sb)
        a, b = A[:rows[0]], B[:rows[0]]
    else:
        A = B = None
        a, b = draw(rng, (rows[rank],) + sa[1:]), draw(rng, (rows[rank],) + sb[1:])
    fn = {"nt": mpiattn.matmul_nt, "nn": mpiattn.matmul_nn, "tn": mpiattn.matmul_tn}[op]

    outs = {}  # --reuse-output: every timed call writes into the output of its warm-up

    def whole():
        if rank != 0:
            return None
        return {"nt": lambda: np.matmul(A, B.T, out=outs.get("numpy")),
                "nn": lambda: np.matmul(A, B, out=outs.get("numpy")),
                "tn": lambda: np.matmul(A.T, B, out=outs.get("numpy"))}[op]()

    # every rank's own share of the work as one local matmul (no communication)
    if P > 1:
        b_full = B if rank == 0 else draw(rng, (T, d))
        share = {"nt": lambda: np.matmul(a, b_full.T, out=outs.get("local")),
                 "nn": lambda: np.matmul(a, b_full, out=outs.get("local")),
                 "tn": lambda: np.matmul(a.T, b, out=outs.get("local"))}[op]

    warm = fn(a, b, comm, block_size=block)    # warm-up (and the communicator's first use)
    if reuse:
        outs["dist"] = warm
        outs["numpy"] = whole()
        if P > 1:
            outs["local"] = share()
    del warm
    res: dict[str, list[float]] = {"dist": [], "numpy": [], "local": []}
    for _ in range(repeat):
        res["dist"].append(timed(comm, lambda: fn(a, b, comm, block_size=block, out=outs.get("dist"))))
        res["numpy"].append(timed(comm, whole))
        if P > 1:
            res["local"].append(timed(comm, share))
    return res


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="nt,nn,tn")
    ap.add_argument("--T", type=int, default=37500, help="rows (default 37500, the thesis' shape)")
    ap.add_argument("--T-square", type=int, default=None,
                    help="T for nn and tn, whose A is T x T (default: --T)")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--reuse-output", action="store_true",
                    help="every timed call writes into one output made by a warm-up call (out=), "
                         "numpy.matmul too: a loop's steady state, the first touch of the output's "
                         "pages paid once")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    P = comm.size
    if comm.rank == 0:
        print(f"# products-thesis: P={P}, d={args.d}, float32, contiguous, block_size="
              f"{args.block_size or 'default'}, repeats={args.repeat}, "
              f"outputs {'reused (out=)' if args.reuse_output else 'new each call'}")
        print(f"# CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)")
        print(f"# BLAS: {blas_info()}")
        print(f"# env: " + " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in
                                    ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
                                     "OPENBLAS_L2_SIZE", "MPIR_CVAR_ENABLE_HEAVY_YIELD")))
        print(f"# MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# mpiattn: {mpiattn.__file__}")
        print(f"# loadavg at start: {loadavg()}", flush=True)
    for op in args.ops.split(","):
        T = args.T if op == "nt" else (args.T_square or args.T)
        res = run_op(comm, op, T, args.d, args.repeat, args.block_size, args.reuse_output)
        if comm.rank != 0:
            continue
        dist, ref = res["dist"], res["numpy"]
        line = f"{op} T={T}: dist {fmt(dist)} s, numpy.matmul {fmt(ref)} s"
        if P == 1:
            line += f", dist/numpy {fmt([x / y for x, y in zip(dist, ref)])}"
        else:
            line += (f", fraction of ideal (numpy/P)/dist {fmt([y / P / x for x, y in zip(dist, ref)])}"
                     f"; local shares {fmt(res['local'])} s, machine ceiling (numpy/P)/local "
                     f"{fmt([y / P / z for z, y in zip(res['local'], ref)])}")
        print(line, flush=True)
    if comm.rank == 0:
        print(f"# loadavg at end: {loadavg()}", flush=True)


if __name__ == "__main__":
    main()
