"""Fresh MPI jobs per case, and the memory-per-rank curve built from them.

:func:`spawn` runs a list of tasks in one ``mpiexec -n P python -m
mpiattn.bench --worker FILE`` job (so each case's peak resident memory is
its own) and returns its records, or one ``error`` record per task when the
job failed. Messages go to the ``log`` callback the caller passes (the
application prints them); nothing here prints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

from ..comm.node import usable_cores
from .memory import estimate_bytes
from .presets import Plan
from .tasks import MiB, Settings, Task, write_job

__all__ = ["launcher", "worker_env", "spawn", "largest_n", "memory_curve"]

Log = Callable[[str], None]

_MPI_ENV = re.compile(r"^(PMI_|PMIX_|HYDRA_|MPI_LOCAL|OMPI_COMM_WORLD|OMPI_UNIVERSE|OMPI_MCA_ess|OMPI_MCA_pmix|"
                      r"OMPI_MCA_orte|OMPI_FILE_LOCATION|OMPI_APP_CTX|OMPI_FIRST_RANKS|PRTE_|I_MPI_HYDRA)")


def launcher(mpiexec: str | None = None) -> list[str]:
    """The launch command: ``mpiexec`` (split), else the one beside this Python, else on PATH."""
    if mpiexec:
        return shlex.split(mpiexec)
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return [local if os.path.exists(local) else (shutil.which("mpiexec") or shutil.which("mpirun") or "mpiexec")]


def worker_env(threads: int, P: int) -> dict:
    """This environment without its own MPI job's variables, with the thread counts set."""
    env = {k: v for k, v in os.environ.items() if not _MPI_ENV.match(k)}
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    if P * threads > usable_cores():
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"   # waiting MPICH ranks yield the core
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn(P: int, tasks: Sequence[Task], settings: Settings, log: Log, mpiexec: str | None = None) -> list[dict]:
    """Run ``tasks`` in one fresh ``mpiexec -n P`` job; its records (or one error record per task)."""
    with tempfile.TemporaryDirectory(prefix="mpiattn-bench-") as tmp:
        cfg, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.jsonl")
        write_job(cfg, settings, tasks, out)
        cmd = launcher(mpiexec) + ["-n", str(P), sys.executable, "-m", "mpiattn.bench", "--worker", cfg]
        try:
            proc = subprocess.run(cmd, env=worker_env(settings.threads, P), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=settings.timeout)
            text, code = proc.stdout, proc.returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            text, code = str(exc), -1
        records = []
        if os.path.exists(out):
            with open(out) as f:
                records = [json.loads(ln) for ln in f if ln.strip()]
    if code != 0:
        tail = " | ".join(text.strip().splitlines()[-6:])
        log(f"    worker failed (exit {code}): {tail}")
        if not any(r.get("workload") != "env" for r in records):
            records += [dict(t.to_dict(), P=P, status="error", reason=f"worker exit {code}: {tail[-300:]}")
                        for t in tasks]
    return records


def largest_n(task: Task, P: int, budget: int, grain: int) -> int:
    """Largest multiple of ``grain`` whose estimate fits ``budget`` bytes per rank (0 if none)."""
    pass_ = task.passes[0]

    def fits(N: int) -> bool:
        return estimate_bytes(task.replace(N=N, M=N), P, pass_) <= budget

    lo, hi = 0, grain
    while fits(hi) and hi < 2**31:
        lo, hi = hi, hi * 2
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def memory_curve(plan: Plan, settings: Settings, log: Log, mpiexec: str | None = None) -> list[dict]:
    """For each ``P`` of the plan: the largest N whose peak fits ``memory_cap`` per rank, verified.

    The model's N (above a measured baseline) runs in a fresh job; if the
    measured peak exceeds the cap, N shrinks by the overshoot and runs again
    (at most four runs per ``P``). It times the plan's first strategy with its
    first engine (the baseline probe too: an engine's libraries are part of
    the floor).
    """
    cap = plan.memory_cap
    fresh = settings.replace(fresh=True, max_memory=None)
    impl, engine = plan.impl[0], plan.engines[0] if plan.engines else None
    out = []
    for P in plan.memory_ranks:
        probe = spawn(P, [Task(workload="baseline", engine=engine, dtype=plan.dtype, B=plan.batch, H=plan.heads,
                               Hkv=plan.kv_heads or plan.heads, E=plan.head_dim, Ev=plan.v_dim or plan.head_dim,
                               layout=plan.layout, block=plan.block, device=settings.device)],
                      fresh, log, mpiexec)
        base = next((r["baseline_bytes"] for r in probe
                     if r.get("workload") == "baseline" and r.get("status") == "ok"), None)
        if base is None:
            out.append(dict(workload="memory_curve", P=P, impl=impl, engine=engine, cap_bytes=cap,
                            status="baseline probe failed"))
            continue
        task = plan.attention_task(0, False, settings.device, False, impl=impl, engine=engine).replace(
            passes=(plan.memory_pass,), repeat=1, warmup=0, plan="memory")
        grain = 256 * P
        N_est = N = largest_n(task, P, cap - base, grain)
        rec = dict(workload="memory_curve", P=P, impl=impl, engine=engine, cap_bytes=cap, baseline_bytes=base,
                   N_estimate=N_est, pass_=plan.memory_pass, status="no N fits the cap")
        for attempt in range(4):
            if N <= 0:
                break
            est = base + estimate_bytes(task.replace(N=N, M=N), P, plan.memory_pass)
            log(f"  memory curve P={P}: trying N={N} (estimate {est / MiB:.0f} MiB, cap {cap / MiB:.0f} MiB)")
            recs = spawn(P, [task.replace(N=N, M=N)], fresh, log, mpiexec)
            run = next((r for r in recs if r.get("workload") == "attention" and r.get("status") == "ok"
                        and r.get("pass") == plan.memory_pass), None)
            if run is None:
                rec["status"] = "verifying run failed"
                break
            peak = run["peak_bytes"]
            rec.update(N_verified=N, peak_bytes=peak, run_baseline_bytes=run["baseline_bytes"],
                       attempts=attempt + 1)
            if peak <= cap:
                rec["status"] = "ok"
                break
            scale = (cap - run["baseline_bytes"]) / max(1, peak - run["baseline_bytes"])
            N = int(N * min(0.98, scale * 0.98)) // grain * grain
            rec["status"] = "over the cap"
        out.append(rec)
    return out
