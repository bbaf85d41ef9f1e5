#!/usr/bin/env python
"""Ring attention on GPUs: TFLOP/s per rank beside a plain GEMM and torch, as JSON.

Run with one rank per GPU (``jobs/gpu_check.sh`` runs it on one GPU)::

    python benchmarks/gpu_bench.py --out DIR [--budget-s 120]
    mpiexec -n 4 python benchmarks/gpu_bench.py --out DIR

For every configuration (global length N, H heads, head dim E = Ev, dtype),
cheapest first, it measures on the same GPUs in the same run:

* ``ring``: ``mpiattn.attention(strategy="ring")`` forward, and forward +
  ``attention_backward``, on this rank's N/P rows (contiguous layout, not
  causal). FLOPs per rank: forward ``4 (N/P) N H E``, backward
  ``10 (N/P) N H E`` (five GEMMs, the score recompute included).
* ``gemm``: plain ``cupy.matmul`` doing the forward's GEMMs (the same tile
  shapes, the same FLOPs) in the input dtype, and in float32 for float16
  inputs (the ring accumulates float16 in float32): the ceiling.
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` forward and
  forward + autograd backward on the whole sequence on one GPU (single-rank
  runs only), when torch is importable; also the largest difference between
  its output and the ring's at the first size.
* ``fused``: the fused online-softmax kernels of :mod:`mpiattn.gpu_kernels`
  against the generic code on one score tile (time and max difference).

Times are medians of the repeats, each between barriers after a device
synchronisation. The run stops starting new measurements when the next one
is estimated to overrun ``--budget-s``; skipped ones are listed as such.
Results are rewritten to ``DIR/gpu_bench.json`` after every measurement, so
a run cut short still leaves what it measured. Only rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

T0 = time.perf_counter()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_bench.json ($OUT)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget for the whole run")
    ap.add_argument("--sizes", default="32768,65536,131072", help="global sequence lengths N")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dims", default="64,128", help="head dims E (= Ev)")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--block", type=int, default=4096, help="ring block size (rows per piece, tile edge)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats at the smallest size (1 above)")
    ap.add_argument("--no-torch", action="store_true")
    return ap.parse_args()


class Run:
    """Shared state: communicator, output document, budget."""

    def __init__(self, args: argparse.Namespace):
        from mpi4py import MPI

        import cupy

        from mpiattn import gpu
        from mpiattn.comm import get_comm

        self.args, self.cp = args, cupy
        self.c = get_comm(MPI.COMM_WORLD)
        self.dev = gpu.bind_device(self.c)
        self.doc: dict[str, Any] = {"meta": self.meta(), "results": [], "fused": [], "sections": {}}
        self.path = os.path.join(args.out, "gpu_bench.json")

    def meta(self) -> dict:
        cp, c = self.cp, self.c
        from mpi4py import MPI

        import mpiattn

        props = cp.cuda.runtime.getDeviceProperties(self.dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"gpu": name, "gpus_per_rank": 1, "ranks": c.size, "cupy": cp.__version__,
                "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "mpiattn": mpiattn.__version__,
                "mpi": MPI.Get_library_version().splitlines()[0].strip(), "numpy": np.__version__,
                "python": platform.python_version(), "transport": c.transport,
                "transport_reason": getattr(c.device_transport, "reason", ""), "block": self.args.block,
                "budget_s": self.args.budget_s, "flops": {"forward": "4 (N/P) N H E", "backward": "10 (N/P) N H E"},
                "env": {k: os.environ[k] for k in ("CUPY_TF32", "MPIATTN_GPU_TRANSPORT",
                                                   "MPIATTN_FUSED_KERNELS") if k in os.environ}}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - T0)

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision for everyone (budget checks must not split the ranks)."""
        return bool(self.c.bcast_obj(flag))

    def say(self, msg: str) -> None:
        if self.c.rank == 0:
            print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)

    def save(self) -> None:
        if self.c.rank == 0:
            os.makedirs(self.args.out, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(self.doc, fh, indent=1)
            os.replace(tmp, self.path)

    def timed(self, fn: Callable[[], Any], repeat: int) -> float:
        """Median seconds of ``fn()`` over ``repeat`` runs, slowest rank, device-synchronised."""
        times = []
        for _ in range(repeat):
            self.cp.cuda.Device().synchronize()
            self.c.barrier()
            t = time.perf_counter()
            fn()
            self.cp.cuda.Device().synchronize()
            self.c.barrier()
            times.append(time.perf_counter() - t)
        return float(self.c.mpi.allreduce(statistics.median(times), op=_max_op()))

    def free(self) -> None:
        self.cp.get_default_memory_pool().free_all_blocks()


def _max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def tflops(flops: float, seconds: float | None) -> float | None:
    return None if not seconds else flops / seconds / 1e12


# ---------------------------------------------------------------- workloads
def gemm_rate(run: Run, n_r: int, N: int, H: int, E: int, dtype: str) -> tuple[float, float]:
    """(seconds, FLOPs) of the forward's GEMMs as plain cupy.matmul over the same tiles."""
    cp, blk = run.cp, run.args.block
    rows, cols = min(blk, n_r), min(blk, N)
    a = cp.random.standard_normal((H, rows, E), dtype=np.float32).astype(dtype)
    bt = cp.random.standard_normal((H, E, cols), dtype=np.float32).astype(dtype)
    v = cp.random.standard_normal((H, cols, E), dtype=np.float32).astype(dtype)
    s = cp.empty((H, rows, cols), dtype=dtype)
    o = cp.empty((H, rows, E), dtype=dtype)
    tiles = max(1, -(-n_r // rows)) * max(1, -(-N // cols))

    def go() -> None:
        for _ in range(tiles):
            cp.matmul(a, bt, out=s)
            cp.matmul(s, v, out=o)

    go()  # warm-up (cuBLAS heuristics)
    return run.timed(go, 1), 4.0 * tiles * rows * cols * E * H


def ring(run: Run, N: int, H: int, E: int, dtype: str, repeat: int, want_out: bool = False) -> dict:
    import mpiattn

    cp, c = run.cp, run.c
    rows = mpiattn.partition(N, c.mpi)
    n_r = int(rows.size)
    shape = (1, H, n_r, E)
    q, k, v, do = (cp.random.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4))
    kw = dict(strategy="ring", block_size=run.args.block, check_finite=False)

    def fwd() -> Any:
        return mpiattn.attention(q, k, v, c.mpi, **kw)

    def fwdbwd() -> None:
        out, lse = mpiattn.attention(q, k, v, c.mpi, **kw)
        mpiattn.attention_backward(do, q, k, v, out, lse, c.mpi, **kw)

    res: dict[str, Any] = {"n_per_rank": n_r}
    t_fwd = run.timed(fwd, repeat)
    res["fwd_s"] = t_fwd
    res["fwd_tflops_per_rank"] = tflops(4.0 * n_r * N * H * E, t_fwd)
    if want_out:
        res["_out"] = (fwd()[0], (q, k, v))
    if run.agree(run.left() > 3.5 * t_fwd * repeat):
        t = run.timed(fwdbwd, repeat)
        res["fwdbwd_s"] = t
        res["fwdbwd_tflops_per_rank"] = tflops(14.0 * n_r * N * H * E, t)
    else:
        res["fwdbwd"] = "skipped: budget"
    return res


def torch_sdpa(run: Run, N: int, H: int, E: int, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F

    torch.cuda.set_device(run.dev)
    dt = getattr(torch, dtype)
    q, k, v, do = (torch.randn(1, H, N, E, device="cuda", dtype=dt) for _ in range(4))

    def sync() -> None:
        torch.cuda.synchronize()

    def fwd() -> None:
        F.scaled_dot_product_attention(q, k, v)

    def fwdbwd() -> None:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv).backward(do)

    out: dict[str, Any] = {"torch": torch.__version__}
    for name, fn, flops in (("fwd", fwd, 4.0 * N * N * H * E), ("fwdbwd", fwdbwd, 14.0 * N * N * H * E)):
        fn()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        t = time.perf_counter() - t
        out[f"torch_{name}_s"] = t
        out[f"torch_{name}_tflops"] = tflops(flops, t)
    del q, k, v, do
    torch.cuda.empty_cache()
    return out


def torch_diff(run: Run, out: Any, qkv: tuple, dtype: str) -> float:
    import torch
    import torch.nn.functional as F

    run.cp.cuda.Device().synchronize()  # cupy's streams are not torch's
    t = [torch.as_tensor(x, device="cuda") for x in qkv]
    ref = F.scaled_dot_product_attention(*(x.float() for x in t))
    got = torch.as_tensor(out, device="cuda").float()
    return float((got - ref).abs().max())


def fused(run: Run, H: int, dtype: str = "float32") -> dict:
    from mpiattn import gpu_kernels as gk

    cp, blk = run.cp, run.args.block
    S0 = cp.random.standard_normal((H, blk, blk), dtype=np.float32).astype(dtype) * 4
    m0 = cp.full((H, blk), -np.inf, dtype=dtype)
    l0 = cp.zeros((H, blk), dtype=dtype)
    res: dict[str, Any] = {"tile": [H, blk, blk], "dtype": dtype}
    outs = {}
    for name, fn in (("generic", gk.reference.softmax_step_), ("fused", gk.softmax_step_)):
        S, m, l = S0.copy(), m0.copy(), l0.copy()
        fn(S, m, l)
        outs[name] = (S, l)
        bufs = [(S0.copy(), m0.copy(), l0.copy()) for _ in range(3)]
        it = iter(bufs)
        t = run.timed(lambda: fn(*next(it)), 3)
        res[f"{name}_softmax_step_ms"] = 1e3 * t
    res["softmax_step_max_abs_diff"] = float(cp.abs(outs["generic"][0] - outs["fused"][0]).max())
    res["rowsum_max_rel_diff"] = float((cp.abs(outs["generic"][1] - outs["fused"][1]) / outs["generic"][1]).max())
    res["speedup"] = res["generic_softmax_step_ms"] / res["fused_softmax_step_ms"]
    return res


# --------------------------------------------------------------------- main
def main() -> int:
    args = parse()
    run = Run(args)
    run.say(f"{run.doc['meta']['gpu']} x {run.c.size} rank(s), transport {run.c.transport}, "
            f"budget {args.budget_s:.0f} s -> {run.path}")
    sizes = [int(s) for s in args.sizes.split(",")]
    dims = [int(s) for s in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    H = args.heads
    have_torch = False
    if not args.no_torch and run.c.size == 1:
        try:
            import torch

            have_torch = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - torch is optional
            have_torch = False
    run.doc["meta"]["torch_compared"] = have_torch

    t = time.perf_counter()
    try:
        run.doc["fused"].append(fused(run, H))
    except Exception as exc:  # noqa: BLE001 - report and go on
        run.doc["fused"].append({"error": f"{type(exc).__name__}: {exc}"})
    run.free()
    run.doc["sections"]["fused_s"] = time.perf_counter() - t
    run.save()
    run.say(f"fused kernels: {run.doc['fused'][-1]}")

    configs = sorted(((N, E, dt) for N in sizes for E in dims for dt in dtypes), key=lambda x: (x[0] * x[0] * x[1], x[2]))
    cost_rate: dict[str, float] = {}  # seconds per forward FLOP per rank, by dtype
    for i, (N, E, dt) in enumerate(configs):
        rec: dict[str, Any] = {"N": N, "H": H, "E": E, "Ev": E, "dtype": dt, "ranks": run.c.size}
        n_r = -(-N // run.c.size)
        flops = 4.0 * n_r * N * H * E
        first = i < len(dims) * len(dtypes) and N == sizes[0]
        repeat = args.repeat if first else 1
        guess = cost_rate.get(dt, 0.0) * flops * (1 + 3.5) * (repeat + (1 if first else 0))
        if not run.agree(run.left() > max(guess, 1.0)):
            rec["status"] = f"skipped: budget ({run.left():.0f} s left, about {guess:.0f} s needed)"
            run.doc["results"].append(rec)
            run.say(f"N={N} E={E} {dt}: {rec['status']}")
            continue
        t = time.perf_counter()
        try:
            if first:  # warm-up: kernel compilation and cuBLAS heuristics
                ring(run, min(N, 4 * args.block), H, E, dt, 1)
            res = ring(run, N, H, E, dt, repeat, want_out=have_torch and i == 0)
            out = res.pop("_out", None)
            rec.update(res)
            cost_rate[dt] = rec["fwd_s"] / flops
            g_s, g_f = gemm_rate(run, n_r, N, H, E, dt)
            rec["gemm_tflops"] = tflops(g_f, g_s)
            if dt == "float16":
                g_s, g_f = gemm_rate(run, n_r, N, H, E, "float32")
                rec["gemm_fp32_tflops"] = tflops(g_f, g_s)
            rec["fwd_frac_of_gemm"] = rec["fwd_tflops_per_rank"] / rec["gemm_tflops"]
            if "fwdbwd_tflops_per_rank" in rec:
                rec["fwdbwd_frac_of_gemm"] = rec["fwdbwd_tflops_per_rank"] / rec["gemm_tflops"]
            if have_torch and run.left() > 5:
                run.free()
                try:
                    if out is not None:
                        rec["max_abs_diff_vs_torch"] = torch_diff(run, out[0], out[1], dt)
                    out = None
                    rec.update(torch_sdpa(run, N, H, E, dt))
                    if rec.get("torch_fwd_tflops"):
                        rec["fwd_vs_torch"] = rec["fwd_tflops_per_rank"] / rec["torch_fwd_tflops"]
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory in a fallback kernel
                    rec["torch_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rec["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - record, keep going
            rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        rec["section_s"] = time.perf_counter() - t
        run.doc["results"].append(rec)
        run.free()
        run.save()
        show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                if k.endswith(("tflops", "tflops_per_rank", "frac_of_gemm", "_s", "status", "diff_vs_torch"))}
        run.say(f"N={N} E={E} {dt}: {show}")
    run.doc["sections"]["total_s"] = time.perf_counter() - T0
    run.save()
    run.say(f"done in {time.perf_counter() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
