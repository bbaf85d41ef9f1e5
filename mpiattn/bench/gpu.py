"""The GPU suite: attention beside the GEMM ceilings and torch, in one job, within a time budget.

Run with one rank per GPU (``jobs/gpu_check.sh`` runs it on one GPU)::

    python -m mpiattn.bench.gpu --out DIR [--budget-s 120] [--engines native,torch] [--impl auto]
    mpiexec -n 4 python -m mpiattn.bench.gpu --out DIR
    python -m mpiattn.bench.report DIR/gpu_bench.jsonl        # the table

It runs the bench's own cases on the GPUs of this job (the workloads of
``python -m mpiattn bench --device gpu --in-process``): for every
configuration (global length N, ``--heads`` H, head dim E = Ev, dtype),
cheapest first, and every engine asked for, mpiattn's forward and forward +
backward (``--impl``, default ``auto``: the library's choice, recorded as
``strategy_used``) with the GEMM ceilings measured right after (a square
GEMM in the input dtype, attention's tiles in the accumulation dtype), and
on a single rank torch's ``scaled_dot_product_attention`` on the same
problem (the ``torch`` peer: the fraction of ideal). First, one record
compares the fused online-softmax step of :mod:`mpiattn.kernels.fused` with
the generic code on one ``(H, block, block)`` score tile.

A case whose estimated time would overrun the budget is skipped (and
recorded as such). Records are appended to ``DIR/gpu_bench.jsonl`` as they
come (JSON lines that :mod:`.report` and :mod:`.plot` read), so a run cut
short keeps what it measured. Only rank 0 writes; messages go to the ``log``
callback (:func:`main` prints them on rank 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..comm.node import usable_cores
from ..timing import Timer
from .tasks import PEERS, SDPA, Settings, Task, attention_flops

__all__ = ["Options", "plan", "fused_step", "run_suite", "main"]

Log = Callable[[str], None]
#: Seconds a case needs besides its attention calls (warm-up problem, ceilings).
_OVERHEAD_S = 2.0


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
    impl: str = "auto"
    engines: tuple[str | None, ...] = (None,)
    torch: bool = True
    gemm_size: int = 2048


def plan(opts: Options, ranks: int) -> list[Task]:
    """The cases, cheapest first: every configuration and engine, then the torch peer (one rank only).

    ``opts.repeat`` timed calls at the smallest length, one above.
    """
    configs = sorted(((N, E, dt) for N in opts.sizes for E in opts.dims for dt in opts.dtypes),
                     key=lambda x: (x[0] * x[0] * x[1], x[2]))
    tasks = []
    for N, E, dt in configs:
        base = Task(impl=opts.impl, H=opts.heads, N=N, E=E, dtype=dt, block=opts.block, device="gpu",
                    repeat=opts.repeat if N == min(opts.sizes) else 1, warmup=0, ceilings=True, plan="gpu",
                    gemm_size=opts.gemm_size)
        tasks += [base.replace(engine=engine) for engine in opts.engines]
        if opts.torch and ranks == 1:
            tasks.append(base.replace(impl=SDPA, ceilings=False))
    return tasks


def fused_step(timer: Timer, H: int, block: int, dtype: str = "float32") -> dict:
    """The fused forward tile kernel against its array-code twin on an ``(H, block, block)`` tile.

    Both are called directly (whatever engine a call would use); the kernel
    is compiled first (NVRTC, cached on disk by CuPy), outside the timing.
    """
    from ..kernels import fused as fk

    cp = timer.xp
    S0 = cp.random.standard_normal((H, block, block), dtype=np.float32).astype(dtype) * 4
    m0, l0 = cp.full((H, block), -np.inf, dtype=dtype), cp.zeros((H, block), dtype=dtype)
    O0 = cp.zeros((H, block, 64), dtype=dtype)
    rec: dict[str, Any] = {"workload": "fused", "tile": [H, block, block], "dtype": dtype, "status": "ok"}
    outs = {}
    for name, fn in (("generic", fk.generic.softmax_fwd_), ("fused", fk.softmax_fwd_)):
        bufs = [(S0.copy(), m0.copy(), l0.copy(), O0.copy()) for _ in range(4)]
        S, m, l, O = bufs[0]
        fn(S, S, m, l, O)
        outs[name] = (S, l)
        it = iter(bufs[1:])

        def step() -> None:
            S, m, l, O = next(it)
            fn(S, S, m, l, O)

        rec[f"{name}_softmax_step_ms"] = 1e3 * timer.measure(step, 0, 3).median
    rec["softmax_step_max_abs_diff"] = float(cp.abs(outs["generic"][0] - outs["fused"][0]).max())
    rec["rowsum_max_rel_diff"] = float((cp.abs(outs["generic"][1] - outs["fused"][1]) / outs["generic"][1]).max())
    rec["speedup"] = rec["generic_softmax_step_ms"] / rec["fused_softmax_step_ms"]
    return rec


def _numbers(r: Mapping[str, Any], P: int) -> float:
    """Input numbers (q, k, v, dout) one of ``P`` ranks draws for an attention task or record ``r``."""
    return r["B"] * (r["H"] * r["N"] + r["Hkv"] * r["M"]) * (r["E"] + r["Ev"]) / P


class _Budget:
    """Admits a case while its estimated time fits what is left (rank 0 decides for every rank).

    The estimate: the last forward's seconds per FLOP for the dtype (the
    forward, the backward at about 3.5 times, every timed call and one more),
    the inputs' seconds per number drawn, and :data:`_OVERHEAD_S`.
    """

    def __init__(self, c: Any, seconds: float):
        self.c, self.end = c, time.perf_counter() + seconds
        self.rate: dict[str, float] = {}  # seconds per forward FLOP per rank, by dtype
        self.inputs = 0.0                 # seconds per input number

    def learn(self, records: list[dict]) -> None:
        for r in records:
            if r.get("workload") == "attention" and r.get("pass") == "fwd" and r.get("status") == "ok":
                self.inputs = max(self.inputs, r["inputs_s"] / _numbers(r, r["P"]))
                if r["impl"] not in PEERS:
                    self.rate[r["dtype"]] = r["time_s"] * r["P"] / r["flops"]

    def __call__(self, t: Task) -> str | None:
        left = self.end - time.perf_counter()
        need = (self.rate.get(t.dtype, 0.0) * attention_flops(t, "fwd") / self.c.size * 4.5 * (t.repeat + 1)
                + self.inputs * _numbers(t.to_dict(), 1 if t.single_process else self.c.size))
        why = None if left > need + _OVERHEAD_S else f"budget: {left:.0f} s left, about {need:.0f} s needed"
        return self.c.bcast_obj(why)


def run_suite(opts: Options, log: Log = lambda msg: None) -> int:
    """Run the GPU suite on every rank of ``MPI.COMM_WORLD``; returns 0 (failed cases are recorded as such)."""
    from mpi4py import MPI

    from ..comm import get_comm
    from .app import summary
    from .worker import device_module, run_in_job

    c = get_comm(MPI.COMM_WORLD)
    timer = Timer(c, device_module(c, "gpu"))
    path = os.path.join(opts.out, "gpu_bench.jsonl")
    budget, stamp = _Budget(c, opts.budget_s), time.strftime("%Y-%m-%dT%H:%M:%S")
    if c.rank == 0:
        os.makedirs(opts.out, exist_ok=True)

    def emit(records: list[dict]) -> None:
        budget.learn(records)
        if c.rank == 0:
            with open(path, "a") as f:
                f.writelines(json.dumps(dict(r, run=stamp, suite="gpu")) + "\n" for r in records)
        r = records[0]
        if r["workload"] == "env":
            log(f"{r.get('gpu', 'GPU')} x {c.size} rank(s), transport {c.transport}, budget {opts.budget_s:.0f} s "
                f"-> {path}")
        elif r["workload"] == "fused":
            log(f"fused kernels: {r}")
        else:
            timer.xp.get_default_memory_pool().free_all_blocks()  # (the torch peer allocates apart)
            engine = f"/{r['engine']}" if r.get("engine") else ""
            log(f"{r['impl']}{engine} N={r['N']} E={r['E']} {r['dtype']}: {summary(records)}")

    try:
        emit([fused_step(timer, opts.heads, opts.block)])
    except Exception as exc:  # noqa: BLE001 - report and go on
        emit([{"workload": "fused", "status": "error", "reason": f"{type(exc).__name__}: {exc}"}])
    timer.xp.get_default_memory_pool().free_all_blocks()
    run_in_job(c, plan(opts, c.size), Settings(device="gpu", cores=usable_cores()), emit, admit=budget)
    log(f"done in {opts.budget_s - (budget.end - time.perf_counter()):.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.gpu [options]``: run the suite, print progress on rank 0."""
    import argparse

    from ..kernels import engines
    from ..strategies import registry
    from .app import choices, engine_name, list_of, positive

    ap = argparse.ArgumentParser(prog="python -m mpiattn.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_bench.jsonl ($OUT)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget for the whole run")
    ap.add_argument("--sizes", type=list_of(positive), default=[32768, 65536, 131072], help="global lengths N")
    ap.add_argument("--heads", type=positive, default=8)
    ap.add_argument("--dims", type=list_of(positive), default=[64, 128], help="head dims E (= Ev)")
    ap.add_argument("--dtypes", type=list_of(choices(("float16", "float32", "float64"))),
                    default=["float16", "float32"])
    ap.add_argument("--block", type=positive, default=4096, help="block size (rows per piece, tile edge)")
    ap.add_argument("--repeat", type=positive, default=3, help="timed repeats at the smallest size (1 above)")
    ap.add_argument("--impl", type=choices(registry.NAMES), default="auto",
                    help=f"the strategy: {', '.join(registry.NAMES)} (default auto: the library's choice)")
    ap.add_argument("--engines", type=list_of(engine_name), default=[None],
                    help=f"engines, side by side: {', '.join(engines.NAMES)}, default (engine= not passed)")
    ap.add_argument("--no-torch", action="store_true", help="no torch SDPA peer")
    ap.add_argument("--gemm-size", type=positive, default=2048,
                    help="edge of the square GEMM ceiling measured after each case (default 2048)")
    args = ap.parse_args(argv)
    opts = Options(out=args.out, budget_s=args.budget_s, sizes=tuple(args.sizes), heads=args.heads,
                   dims=tuple(args.dims), dtypes=tuple(args.dtypes), block=args.block, repeat=args.repeat,
                   impl=args.impl, engines=tuple(args.engines), torch=not args.no_torch,
                   gemm_size=args.gemm_size)
    t0 = time.perf_counter()
    return run_suite(opts, lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True))


if __name__ == "__main__":
    sys.exit(main())
