#!/usr/bin/env python
"""Where ``matmul_nt``'s time goes at P > 1: its GEMM calls, the waits between them, and the
first touch of the output's pages.

    mpiexec -n 2 python benchmarks/products-thesis/steps.py --T 20000

Per repeat and rank: the call's wall time; the time inside its GEMM calls (``mpiattn.gemm.matmul``
timed around each call) and their count; the gaps between calls (waiting for the next piece of
B, copies) and after the last; and, beside it, one plain ``numpy.matmul`` of this rank's own
diagonal block into a freshly allocated output and again into the same, already touched one:
their difference is what the first touch of those pages costs.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiattn
import mpiattn.products.matmul as products

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--T", type=int, default=20000)
ap.add_argument("--d", type=int, default=768)
ap.add_argument("--repeat", type=int, default=3)
args = ap.parse_args()
comm = MPI.COMM_WORLD
rank, P = comm.rank, comm.size
n = args.T // P
rng = np.random.default_rng(rank)
a = rng.standard_normal((n, args.d), dtype=np.float32)
b = rng.standard_normal((n, args.d), dtype=np.float32)
calls = []
plain = products.gemm.matmul


def timed(x, y, out=None, **kw):
    t0 = time.perf_counter()
    res = plain(x, y, out, **kw)
    calls.append((t0, time.perf_counter()))
    return res


products.gemm.matmul = timed
mpiattn.matmul_nt(a, b, comm)  # warm-up
for _ in range(args.repeat):
    calls.clear()
    comm.Barrier()
    t0 = time.perf_counter()
    c = mpiattn.matmul_nt(a, b, comm)
    t1 = time.perf_counter()
    inside = sum(e - s for s, e in calls)
    gaps = [calls[i + 1][0] - calls[i][1] for i in range(len(calls) - 1)]
    del c
    out = np.empty((n, args.T), np.float32)
    s0 = time.perf_counter()
    np.matmul(a, b.T, out=out[:, :n])
    s1 = time.perf_counter()
    np.matmul(a, b.T, out=out[:, :n])
    s2 = time.perf_counter()
    del out
    rows = comm.gather((rank, t1 - t0, inside, len(calls), sum(gaps), max(gaps, default=0.0),
                        t1 - calls[-1][1] if calls else 0.0, s1 - s0, s2 - s1), 0)
    if rank == 0:
        for row in rows:
            print("rank %d: call %.3f s, in GEMMs %.3f s (%d calls), gaps %.3f s (largest %.3f), "
                  "after the last %.3f s | own block: fresh output %.3f s, touched %.3f s" % row,
                  flush=True)
