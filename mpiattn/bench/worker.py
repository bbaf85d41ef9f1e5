"""Inside one MPI job: run the tasks on every rank, hand back JSON-ready records.

The launcher starts ``mpiexec -n P python -m mpiattn.bench --worker FILE``;
:func:`main` reads the job (:func:`mpiattn.bench.tasks.read_job`), runs its
tasks through :func:`run_in_job` and has rank 0 append each record to the
job's JSON-lines file as soon as it exists. Nothing here prints.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from .environment import environment
from .memory import MemoryMeter
from .tasks import Settings, Task, read_job

__all__ = ["device_module", "run_task", "run_in_job", "main"]

Emit = Callable[[list[dict]], None]


def device_module(c: Any, device: str) -> Any:
    """numpy, or cupy with one GPU bound to this rank (:func:`mpiattn.gpu.bind_device`)."""
    import numpy as np

    if device == "cpu":
        return np
    from .. import gpu

    gpu.bind_device(c)
    import cupy

    return cupy


def run_task(c: Any, xp: Any, task: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """Run one task on every rank of ``c``; the same records come back on every rank.

    Parameters
    ----------
    c : mpiattn.comm.Comm
    xp : module
        numpy or cupy: where the inputs live.
    task : Task
    settings : Settings
    mem : MemoryMeter

    Returns
    -------
    list of dict
        JSON-ready records.
    """
    from . import ceilings, products, workloads
    from ..timing import Timer

    kind = task.workload
    if kind == "attention":
        return workloads.attention_task(c, xp, task, settings, mem)
    if kind == "gemm_square":
        return ceilings.gemm_square(Timer(c, xp), task)
    if kind == "gemm_tile":
        return ceilings.gemm_tile(Timer(c, xp), task)
    if kind == "product":
        return products.product_task(c, xp, task, settings, mem)
    if kind == "overlap":
        return products.overlap_task(c, xp, task, settings, mem)
    if kind == "baseline":
        return workloads.baseline_task(c, xp, task, settings, mem)
    raise ValueError(f"unknown benchmark workload {kind!r}")


def run_in_job(c: Any, tasks: Sequence[Task], settings: Settings, emit: Emit,
               admit: Callable[[Task], str | None] | None = None) -> None:
    """Run ``tasks`` on every rank of ``c``; ``emit(records)`` is called on every rank after each.

    The first call emits the job's ``env`` record. Records are marked
    ``fresh`` (the job ran one case) and ``oversubscribed`` (more ranks times
    threads than usable cores). ``admit(task)``, called on every rank before
    each task, may return why to skip it (the same answer on every rank).
    """
    xp = device_module(c, settings.device)
    mem = MemoryMeter(xp)
    emit([dict(workload="env", P=c.size, transport=c.transport, **environment())])
    oversub = c.size * settings.threads > settings.cores
    for t in tasks:
        why = admit(t) if admit is not None else None
        if why is not None:
            recs = [dict(t.to_dict(), P=c.size, status="skipped", reason=why)]
        else:
            with c.abort_on_error():
                recs = run_task(c, xp, t, settings, mem)
        for rec in recs:
            rec.setdefault("P", c.size)
            rec["fresh"] = settings.fresh
            if oversub:
                rec["oversubscribed"] = True
        emit(recs)


def main(path: str) -> int:
    """The worker's entry (every rank): run the job described in ``path``."""
    from mpi4py import MPI

    from ..comm import get_comm

    settings, tasks, out_path = read_job(path)
    c = get_comm(MPI.COMM_WORLD)
    out = open(out_path, "a") if c.rank == 0 else None

    def emit(records: list[dict]) -> None:
        if out is not None:
            for r in records:
                out.write(json.dumps(r) + "\n")
            out.flush()

    try:
        run_in_job(c, tasks, settings, emit)
    finally:
        if out is not None:
            out.close()
    return 0
