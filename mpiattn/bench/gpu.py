"""The GPU suite: ring attention TFLOP/s per rank beside a plain GEMM and torch, as JSON.

Run with one rank per GPU (``jobs/gpu_check.sh`` runs it on one GPU)::

    python -m mpiattn.bench.gpu --out DIR [--budget-s 120] [--engines native,torch]
    mpiexec -n 4 python -m mpiattn.bench.gpu --out DIR

For every configuration (global length N, H heads, head dim E = Ev, dtype),
cheapest first, and every engine asked for, it measures on the same GPUs in
the same run, all with the bench's one harness
(:class:`~mpiattn.timing.Timer`: device-synchronised, between
barriers):

* ``ring``: ``mpiattn.attention(strategy="ring")`` forward, and forward +
  ``attention_backward``, on this rank's N/P rows (contiguous layout, not
  causal); the nominal FLOPs of :func:`mpiattn.bench.tasks.attention_flops`
  (forward ``4 (N/P) N H E``, backward ``10 (N/P) N H E`` per rank);
* ``gemm``: plain ``cupy.matmul`` doing the forward's GEMMs (the same tile
  shapes, the same FLOPs) in the input dtype, and in float32 for float16
  inputs (the ring accumulates float16 in float32): the ceiling;
* ``torch``: ``scaled_dot_product_attention`` forward and forward + autograd
  backward on the whole sequence on one GPU (single-rank runs only), when
  torch is importable; the fraction of ideal ``T_torch / (P T_ring)`` and the
  largest difference between its output and the ring's at the first size;
* ``fused``: the fused online-softmax step of :mod:`mpiattn.kernels.fused`
  against the generic code on one score tile (time and max difference).

The run stops starting new measurements when the next one is estimated to
overrun the budget; skipped ones are listed as such. Results are rewritten
to ``DIR/gpu_bench.json`` after every measurement, so a run cut short still
leaves what it measured. Only rank 0 writes; messages go to the ``log``
callback (:func:`main`, the ``python -m mpiattn.bench.gpu`` entry, prints
them on rank 0).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from .tasks import Task, attention_flops
from ..timing import Timer
from .workloads import Unavailable, implementation, torch_impl

__all__ = ["Options", "run_suite", "main"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    """What the GPU suite measures (the options of ``python -m mpiattn.bench.gpu``)."""

    out: str = "."
    budget_s: float = 120.0
    sizes: tuple[int, ...] = (32768, 65536, 131072)
    heads: int = 8
    dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("float16", "float32")
    block: int = 4096
    repeat: int = 3
    engines: tuple[str | None, ...] = (None,)
    torch: bool = True


class _Run:
    """One run's communicator, timer, output document and budget."""

    def __init__(self, opts: Options, log: Log):
        from mpi4py import MPI

        import cupy

        from .. import gpu
        from ..comm import get_comm

        self.opts, self.cp, self.t0 = opts, cupy, time.perf_counter()
        self.c = get_comm(MPI.COMM_WORLD)
        self.dev = gpu.bind_device(self.c)
        self.timer = Timer(self.c, cupy)
        self.log = log if self.c.rank == 0 else (lambda msg: None)
        self.doc: dict[str, Any] = {"meta": self.meta(), "results": [], "fused": [], "sections": {}}
        self.path = os.path.join(opts.out, "gpu_bench.json")

    def meta(self) -> dict:
        from mpi4py import MPI

        from .. import __version__

        cp, c = self.cp, self.c
        props = cp.cuda.runtime.getDeviceProperties(self.dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"gpu": name, "gpus_per_rank": 1, "ranks": c.size, "cupy": cp.__version__,
                "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "mpiattn": __version__,
                "mpi": MPI.Get_library_version().splitlines()[0].strip(), "numpy": np.__version__,
                "python": platform.python_version(), "transport": c.transport,
                "transport_reason": getattr(c.device_transport, "reason", ""), "options": asdict(self.opts),
                "flops": {"forward": "4 (N/P) N H E", "backward": "10 (N/P) N H E"},
                "env": {k: os.environ[k] for k in ("CUPY_TF32", "MPIATTN_GPU_TRANSPORT", "MPIATTN_FUSED_KERNELS")
                        if k in os.environ}}

    def left(self) -> float:
        return self.opts.budget_s - (time.perf_counter() - self.t0)

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision for everyone (budget checks must not split the ranks)."""
        return bool(self.c.bcast_obj(flag))

    def seconds(self, fn: Callable[[], Any], repeat: int, warmup: int = 0) -> float:
        return self.timer.measure(fn, warmup, repeat).median

    def save(self) -> None:
        if self.c.rank == 0:
            os.makedirs(self.opts.out, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(self.doc, fh, indent=1)
            os.replace(tmp, self.path)

    def free(self) -> None:
        self.cp.get_default_memory_pool().free_all_blocks()

    def normal(self, shape: tuple, dtype: str) -> Any:
        return self.cp.random.standard_normal(shape, dtype=np.float32).astype(dtype)


def _tflops(flops: float, seconds: float | None) -> float | None:
    return None if not seconds else flops / seconds / 1e12


def gemm_rate(run: _Run, n_r: int, N: int, H: int, E: int, dtype: str) -> float | None:
    """TFLOP/s of the forward's GEMMs as plain cupy.matmul over the same tiles."""
    cp, blk = run.cp, run.opts.block
    rows, cols = min(blk, n_r), min(blk, N)
    a, bt = run.normal((H, rows, E), dtype), run.normal((H, E, cols), dtype)
    v = run.normal((H, cols, E), dtype)
    s, o = cp.empty((H, rows, cols), dtype=dtype), cp.empty((H, rows, E), dtype=dtype)
    tiles = max(1, -(-n_r // rows)) * max(1, -(-N // cols))

    def go() -> None:
        for _ in range(tiles):
            cp.matmul(a, bt, out=s)
            cp.matmul(s, v, out=o)

    return _tflops(4.0 * tiles * rows * cols * E * H, run.seconds(go, 1, warmup=1))   # warm-up: cuBLAS heuristics


def ring(run: _Run, t: Task, repeat: int, keep_out: bool = False) -> dict:
    """Forward and forward+backward of attention task ``t`` on this rank's rows."""
    from ..layouts import local_length

    c = run.c
    impl = implementation(c, t)
    n_r = local_length(t.N, c.rank, c.size, t.layout)
    q, k, v, do = (run.normal((t.B, t.H, n_r, t.E), t.dtype) for _ in range(4))

    def fwdbwd() -> None:
        res = impl.forward(q, k, v)
        impl.backward(do, q, k, v, res)

    res: dict[str, Any] = {"n_per_rank": n_r}
    t_fwd = run.seconds(lambda: impl.forward(q, k, v), repeat)
    res["fwd_s"] = t_fwd
    res["fwd_tflops_per_rank"] = _tflops(attention_flops(t, "fwd") / c.size, t_fwd)
    if keep_out:
        res["_out"] = (impl.forward(q, k, v)[0], (q, k, v))
    if run.agree(run.left() > 3.5 * t_fwd * repeat):
        t_both = run.seconds(fwdbwd, repeat)
        res["fwdbwd_s"] = t_both
        res["fwdbwd_tflops_per_rank"] = _tflops(attention_flops(t, "fwdbwd") / c.size, t_both)
    else:
        res["fwdbwd"] = "skipped: budget"
    return res


def torch_sdpa(run: _Run, t: Task) -> dict:
    """``scaled_dot_product_attention`` on the whole problem on this GPU (one warm-up call, one timed)."""
    import torch

    torch.cuda.set_device(run.dev)
    impl = torch_impl(t)
    q, k, v, do = (run.normal((t.B, t.H, t.N, t.E), t.dtype) for _ in range(4))

    def fwdbwd() -> None:
        impl.backward(do, q, k, v, impl.autograd_forward(q, k, v))

    out: dict[str, Any] = {"torch": torch.__version__}
    for name, fn in (("fwd", lambda: impl.forward(q, k, v)), ("fwdbwd", fwdbwd)):
        secs = run.seconds(fn, 1, warmup=1)
        out[f"torch_{name}_s"] = secs
        out[f"torch_{name}_tflops"] = _tflops(attention_flops(t, name), secs)
    q = k = v = do = None           # free before emptying the cache
    torch.cuda.empty_cache()
    return out


def torch_diff(run: _Run, out: Any, qkv: tuple) -> float:
    """Largest |ring - torch| of the forward output (torch in float32 on the same inputs)."""
    import torch
    import torch.nn.functional as F

    run.timer.sync()  # cupy's streams are not torch's
    ref = F.scaled_dot_product_attention(*(torch.as_tensor(x, device="cuda").float() for x in qkv))
    return float((torch.as_tensor(out, device="cuda").float() - ref).abs().max())


def fused(run: _Run, H: int, dtype: str = "float32") -> dict:
    """The fused online-softmax step against the generic one on an ``(H, block, block)`` tile."""
    from ..kernels import fused as fk

    cp, blk = run.cp, run.opts.block
    S0 = run.normal((H, blk, blk), dtype) * 4
    m0, l0 = cp.full((H, blk), -np.inf, dtype=dtype), cp.zeros((H, blk), dtype=dtype)
    res: dict[str, Any] = {"tile": [H, blk, blk], "dtype": dtype, "fused_enabled": fk.use_fused(cp)}
    outs = {}
    for name, fn in (("generic", fk.generic.softmax_step_), ("fused", fk.softmax_step_)):
        S, m, l = S0.copy(), m0.copy(), l0.copy()
        fn(S, m, l)
        outs[name] = (S, l)
        bufs = iter([(S0.copy(), m0.copy(), l0.copy()) for _ in range(3)])
        res[f"{name}_softmax_step_ms"] = 1e3 * run.seconds(lambda: fn(*next(bufs)), 3)
    res["softmax_step_max_abs_diff"] = float(cp.abs(outs["generic"][0] - outs["fused"][0]).max())
    res["rowsum_max_rel_diff"] = float((cp.abs(outs["generic"][1] - outs["fused"][1]) / outs["generic"][1]).max())
    res["speedup"] = res["generic_softmax_step_ms"] / res["fused_softmax_step_ms"]
    return res


def _have_torch(run: _Run) -> bool:
    if not run.opts.torch or run.c.size != 1:
        return False
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - torch is optional
        return False


def _measure(run: _Run, t: Task, rec: dict, first: bool, want_diff: bool, have_torch: bool) -> None:
    """One configuration and engine into ``rec`` (errors recorded by the caller)."""
    opts, c = run.opts, run.c
    repeat = opts.repeat if first else 1
    if first:  # warm-up: kernel compilation and cuBLAS heuristics
        ring(run, t.replace(N=min(t.N, 4 * opts.block), M=min(t.N, 4 * opts.block)), 1)
    res = ring(run, t, repeat, keep_out=want_diff)
    out = res.pop("_out", None)
    rec.update(res)
    n_r = -(-t.N // c.size)
    rec["gemm_tflops"] = gemm_rate(run, n_r, t.N, t.H, t.E, t.dtype)
    if t.dtype == "float16":
        rec["gemm_fp32_tflops"] = gemm_rate(run, n_r, t.N, t.H, t.E, "float32")
    rec["fwd_frac_of_gemm"] = rec["fwd_tflops_per_rank"] / rec["gemm_tflops"]
    if "fwdbwd_tflops_per_rank" in rec:
        rec["fwdbwd_frac_of_gemm"] = rec["fwdbwd_tflops_per_rank"] / rec["gemm_tflops"]
    if have_torch and run.left() > 5:
        run.free()
        try:
            if out is not None:
                rec["max_abs_diff_vs_torch"] = torch_diff(run, out[0], out[1])
            out = None
            rec.update(torch_sdpa(run, t.replace(impl="torch", engine=None)))
            for p in ("fwd", "fwdbwd"):
                if rec.get(f"torch_{p}_s") and rec.get(f"{p}_s"):
                    rec[f"{p}_frac_ideal"] = rec[f"torch_{p}_s"] / (c.size * rec[f"{p}_s"])
            if rec.get("torch_fwd_tflops"):
                rec["fwd_vs_torch"] = rec["fwd_tflops_per_rank"] / rec["torch_fwd_tflops"]
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory in a fallback kernel
            rec["torch_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["status"] = "ok"


def run_suite(opts: Options, log: Log = lambda msg: None) -> int:
    """Run the GPU suite on every rank of ``MPI.COMM_WORLD``; returns an exit code (0)."""
    run = _Run(opts, log)
    run.log(f"{run.doc['meta']['gpu']} x {run.c.size} rank(s), transport {run.c.transport}, "
            f"budget {opts.budget_s:.0f} s -> {run.path}")
    have_torch = _have_torch(run)
    run.doc["meta"]["torch_compared"] = have_torch

    t = time.perf_counter()
    try:
        run.doc["fused"].append(fused(run, opts.heads))
    except Exception as exc:  # noqa: BLE001 - report and go on
        run.doc["fused"].append({"error": f"{type(exc).__name__}: {exc}"})
    run.free()
    run.doc["sections"]["fused_s"] = time.perf_counter() - t
    run.save()
    run.log(f"fused kernels: {run.doc['fused'][-1]}")

    configs = sorted(((N, E, dt) for N in opts.sizes for E in opts.dims for dt in opts.dtypes),
                     key=lambda x: (x[0] * x[0] * x[1], x[2]))
    cost_rate: dict[str, float] = {}  # seconds per forward FLOP per rank, by dtype
    for i, (N, E, dt) in enumerate(configs):
        for j, engine in enumerate(opts.engines):
            task = Task(impl="ring", engine=engine, H=opts.heads, N=N, E=E, dtype=dt, block=opts.block,
                        device="gpu", repeat=opts.repeat, warmup=0)
            rec: dict[str, Any] = {"N": N, "H": opts.heads, "E": E, "Ev": E, "dtype": dt, "ranks": run.c.size,
                                   "engine": engine}
            flops = attention_flops(task, "fwd") / run.c.size
            first = i < len(opts.dims) * len(opts.dtypes) and N == opts.sizes[0]
            guess = cost_rate.get(dt, 0.0) * flops * (1 + 3.5) * ((opts.repeat + 1) if first else 1)
            label = f"N={N} E={E} {dt}" + (f" engine={engine}" if engine else "")
            if not run.agree(run.left() > max(guess, 1.0)):
                rec["status"] = f"skipped: budget ({run.left():.0f} s left, about {guess:.0f} s needed)"
                run.doc["results"].append(rec)
                run.log(f"{label}: {rec['status']}")
                continue
            t = time.perf_counter()
            try:
                _measure(run, task, rec, first, have_torch and i == 0 and j == 0, have_torch)
                cost_rate[dt] = rec["fwd_s"] / flops
            except Unavailable as exc:
                rec["status"] = f"skipped: {exc}"
            except Exception as exc:  # noqa: BLE001 - record, keep going
                rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            rec["section_s"] = time.perf_counter() - t
            run.doc["results"].append(rec)
            run.free()
            run.save()
            show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                    if k.endswith(("tflops", "tflops_per_rank", "frac_of_gemm", "frac_ideal", "_s", "status",
                                   "diff_vs_torch"))}
            run.log(f"{label}: {show}")
    run.doc["sections"]["total_s"] = time.perf_counter() - run.t0
    run.save()
    run.log(f"done in {time.perf_counter() - run.t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.gpu [options]``: run the suite, print progress on rank 0."""
    import argparse

    from .app import choices, engine_name, list_of, positive

    ap = argparse.ArgumentParser(prog="python -m mpiattn.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_bench.json ($OUT)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget for the whole run")
    ap.add_argument("--sizes", type=list_of(positive), default=[32768, 65536, 131072], help="global lengths N")
    ap.add_argument("--heads", type=positive, default=8)
    ap.add_argument("--dims", type=list_of(positive), default=[64, 128], help="head dims E (= Ev)")
    ap.add_argument("--dtypes", type=list_of(choices(("float16", "float32", "float64"))),
                    default=["float16", "float32"])
    ap.add_argument("--block", type=positive, default=4096, help="ring block size (rows per piece, tile edge)")
    ap.add_argument("--repeat", type=positive, default=3, help="timed repeats at the smallest size (1 above)")
    ap.add_argument("--engines", type=list_of(engine_name), default=[None],
                    help="engines of the ring, side by side: native, torch, auto, default (engine= not passed)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    opts = Options(out=args.out, budget_s=args.budget_s, sizes=tuple(args.sizes), heads=args.heads,
                   dims=tuple(args.dims), dtypes=tuple(args.dtypes), block=args.block, repeat=args.repeat,
                   engines=tuple(args.engines), torch=not args.no_torch)
    t0 = time.perf_counter()
    return run_suite(opts, lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True))


if __name__ == "__main__":
    sys.exit(main())
