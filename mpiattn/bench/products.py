#!/usr/bin/env python
"""Benchmark the sequence-sharded products against a plain local numpy.matmul.

Run with one BLAS thread per rank and no more ranks than cores, e.g.::

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_products.py

For each of matmul_nt, matmul_nn, matmul_tn (global sizes N = M rows, d
columns) it prints the best wall time of the distributed call, the achieved
GFLOP/s of the whole job (2·N·M·d / time), and the ratio to a plain local
``numpy.matmul`` doing the same work per rank (the same shapes, local random
operands, no communication; for tn the transposed view ``x.T @ y``, the plain
NumPy spelling of Aᵀ·B) run at the same time on every rank in this run, the
two timed alternately; best of ``--repeat`` each.

It then measures comm/compute overlap for one ring step of matmul_nt: the
transfer of one piece to the next rank alone, the piece's matmul alone, and
both together (Isend/Irecv posted, matmul, wait), and reports the hidden
fraction ``(t_transfer + t_matmul - t_both) / t_transfer`` (1 = the transfer
was fully hidden, 0 = not at all).

Only rank 0 prints. Not a test: nothing is asserted about timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def blas_info() -> str:
    try:
        import threadpoolctl
    except ImportError:
        return "threadpoolctl not installed (pip install threadpoolctl to see the BLAS kernel)"
    rows = []
    for lib in threadpoolctl.threadpool_info():
        rows.append(f"{lib.get('internal_api')} {lib.get('version')} kernel={lib.get('architecture')} "
                    f"threads={lib.get('num_threads')}")
    return "; ".join(rows) or "no BLAS found by threadpoolctl"


def timed(c, fn, repeat: int) -> tuple[float, object]:
    """Best-of-``repeat`` wall time of ``fn()``, measured between barriers (slowest rank counts)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        c.barrier()
        t0 = time.perf_counter()
        out = fn()
        c.barrier()
        best = min(best, time.perf_counter() - t0)
    return best, out


def shapes(op: str, n: int, m: int, d: int, n_r: int, m_r: int):
    """(this rank's a, b) for the distributed call, and (x, y) of the equivalent local matmul."""
    if op == "nt":   # (n_r, d)·(M, d)^T
        return (n_r, d), (m_r, d), ((n_r, d), (d, m))
    if op == "nn":   # (n_r, M)·(M, d)
        return (n_r, m), (m_r, d), ((n_r, m), (m, d))
    # tn: (m_r, N)^T·(m_r, d); locally the same transposed view (see bench_op)
    return (m_r, n), (m_r, d), ((m_r, n), (m_r, d))


def bench_op(c, op: str, n: int, d: int, dtype, layout: str, repeat: int, block_size) -> dict:
    import mpiattn
    from mpiattn.layouts import local_length

    rng = np.random.default_rng(1000 + c.rank)
    n_r = local_length(n, c.rank, c.size, layout)
    sa, sb, (sx, sy) = shapes(op, n, n, d, n_r, n_r)
    a = rng.standard_normal(sa, dtype=np.float32).astype(dtype, copy=False)
    b = rng.standard_normal(sb, dtype=np.float32).astype(dtype, copy=False)
    fn = {"nt": mpiattn.matmul_nt, "nn": mpiattn.matmul_nn, "tn": mpiattn.matmul_tn}[op]
    x = rng.standard_normal(sx, dtype=np.float32).astype(dtype, copy=False)
    y = rng.standard_normal(sy, dtype=np.float32).astype(dtype, copy=False)
    if op == "tn":
        x = x.T  # plain numpy spelling of Aᵀ·B: a transposed view
    t_dist = t_local = float("inf")
    for _ in range(repeat):  # alternate, so both see the same machine state
        t, out = timed(c, lambda: fn(a, b, layout=layout, block_size=block_size), 1)
        del out
        t_dist = min(t_dist, t)
        t, out = timed(c, lambda: np.matmul(x, y), 1)
        del out
        t_local = min(t_local, t)
    del a, b, x, y
    flops = 2.0 * n * n * d
    return {"op": op, "t_dist": t_dist, "t_local": t_local,
            "gflops_dist": flops / t_dist / 1e9, "gflops_local": flops / t_local / 1e9,
            "ratio": t_local / t_dist}


def bench_overlap(c, n_r: int, d: int, dtype, k: int, repeat: int) -> dict | None:
    """One ring step of matmul_nt: send a (k, d) piece to rank+1 while computing a·pieceᵀ, a (n_r, d)."""
    if c.size < 2:
        return None
    rng = np.random.default_rng(7 + c.rank)
    a = rng.standard_normal((n_r, d), dtype=np.float32).astype(dtype)
    mine = rng.standard_normal((k, d), dtype=np.float32).astype(dtype)
    other = rng.standard_normal((k, d), dtype=np.float32).astype(dtype)
    incoming = np.empty_like(mine)
    out = np.empty((n_r, k), dtype=dtype)
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size

    def transfer():
        rq = c.irecv(incoming, prv, 77)
        sq = c.isend(mine, nxt, 77)
        rq.wait()
        sq.wait()

    def compute():
        np.matmul(a, other.T, out=out)

    def both():
        rq = c.irecv(incoming, prv, 77)
        sq = c.isend(mine, nxt, 77)
        np.matmul(a, other.T, out=out)
        rq.wait()
        sq.wait()

    samples = {"transfer": [], "matmul": [], "both": []}
    for _ in range(repeat):
        for name, fn in (("transfer", transfer), ("matmul", compute), ("both", both)):
            t, _ = timed(c, fn, 1)
            samples[name].append(t)
    med = {k_: statistics.median(v) for k_, v in samples.items()}
    spread = max(samples["matmul"]) - min(samples["matmul"])
    hidden = (med["transfer"] + med["matmul"] - med["both"]) / med["transfer"]
    return {"rows": k, "a_rows": n_r, "bytes": mine.nbytes, **med, "spread": spread, "hidden": max(0.0, min(1.0, hidden)),
            "hidden_raw": hidden}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384, help="global rows N = M (default 16384)")
    ap.add_argument("--d", type=int, default=512, help="inner/outer width d (default 512)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    ap.add_argument("--ops", default="nt,nn,tn")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per measurement (best counts)")
    ap.add_argument("--block-size", type=int, default=None, help="rows per piece (default: library's)")
    ap.add_argument("--overlap-d", type=int, default=None, help="d for the overlap step (default --d)")
    ap.add_argument("--overlap-repeat", type=int, default=7)
    ap.add_argument("--overlap-small-rows", type=int, default=64,
                    help="rows of a in the second, transfer-sized overlap step (default 64)")
    args = ap.parse_args()

    from mpi4py import MPI

    from mpiattn import products
    from mpiattn.comm import get_comm

    c = get_comm(MPI.COMM_WORLD)
    dtype = np.dtype(args.dtype)
    say = print if c.rank == 0 else (lambda *a, **k: None)
    say(f"# mpiattn products benchmark: P={c.size} ranks, N=M={args.n}, d={args.d}, {dtype}, "
        f"layout={args.layout}, block_size={args.block_size or 'default'}")
    say(f"# BLAS: {blas_info()}")
    say("# env: " + " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in
                             ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE",
                              "MPIR_CVAR_ENABLE_HEAVY_YIELD")))
    say(f"# MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    say(f"# load average at start: {os.getloadavg()[0]:.2f} (other processes on the machine skew timings)")
    say(f"{'op':>4} {'time_s':>8} {'GFLOP/s':>9} {'local_s':>8} {'local_GFLOP/s':>13} {'ratio':>6}")
    for op in args.ops.split(","):
        res = bench_op(c, op, args.n, args.d, dtype, args.layout, args.repeat, args.block_size)
        say(f"{op:>4} {res['t_dist']:8.3f} {res['gflops_dist']:9.1f} {res['t_local']:8.3f} "
            f"{res['gflops_local']:13.1f} {res['ratio']:6.3f}")
    d_ov = args.overlap_d or args.d
    n_r = -(-args.n // c.size)
    block = min(n_r, args.block_size or products.default_block_size(n_r, d_ov * dtype.itemsize))
    if c.size < 2:
        say("# overlap: needs >= 2 ranks")
    for a_rows, what in ((n_r, "as in the run above"), (args.overlap_small_rows, "a of few rows")):
        ov = bench_overlap(c, a_rows, d_ov, dtype, block, args.overlap_repeat)
        if ov is None:
            break
        say(f"# overlap, one matmul_nt ring step, {what}: a {a_rows} x {d_ov}, piece {block} x {d_ov} "
            f"= {ov['bytes'] / 2**20:.1f} MiB, median of {args.overlap_repeat}:")
        say(f"#   transfer alone {ov['transfer'] * 1e3:.2f} ms, matmul alone {ov['matmul'] * 1e3:.2f} ms, "
            f"both {ov['both'] * 1e3:.2f} ms -> hidden fraction of the transfer {ov['hidden']:.2f} "
            f"(raw {ov['hidden_raw']:+.2f})")
        if ov["spread"] > ov["transfer"]:
            say(f"#   (the matmul alone varies by {ov['spread'] * 1e3:.2f} ms between samples, more than the "
                "transfer takes: this hidden fraction is not resolvable)")
    say(f"# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
