"""The one timer of the package: barrier-delimited, device-synchronised phases and calls.

The command line times the phases of a run, the benchmark its calls, with a
:class:`Timer`::

    timer = Timer(comm, xp)                      # xp: numpy or cupy
    with timer.phase("forward"):                 # timer.times["forward"], in seconds
        out, lse = attention(q, k, v, comm)
    m = timer.measure(lambda: fn(a, b), warmup=1, repeat=5)
    m.median, m.cpu_median, m.times

A call is timed on every rank of ``comm`` at once: the device queue is
drained and the ranks meet at a barrier before and after it, so the wall
time is the slowest rank's. The CPU time of the call is this process's, the
largest over the ranks: on a machine shared with other work it leaves out
the time the process was descheduled (MPI ranks waiting for each other
poll, so it counts their waits). A timer keeps its own running totals of
both clocks (:meth:`Timer.cpu_wall_ratio`); the module keeps no state.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["Measurement", "Timer", "measure"]


@dataclass
class Measurement:
    """The timed calls of one :meth:`Timer.measure`.

    Attributes
    ----------
    times : list of float
        Wall seconds of each timed call (the slowest rank).
    cpus : list of float
        CPU seconds of each timed call (the largest over the ranks).
    result : object
        The last call's return value when asked for (``keep_last``), else None.
    """

    times: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpus)

    @property
    def best(self) -> float:
        return min(self.times)


class Timer:
    """Times calls on every rank of a communicator, device-synchronised.

    Parameters
    ----------
    comm : mpiattn.comm.Comm
        Every rank of it calls the same methods in the same order.
    xp : module
        numpy, or cupy: then every queued kernel of the current device (all
        streams) finishes before a clock is read.
    on_phase : callable(name), optional
        Told the name of each :meth:`phase` as it starts (the command line
        keeps what a run is doing for a signal's message).

    Attributes
    ----------
    times : dict
        Phase name -> wall seconds (:meth:`phase`).
    """

    def __init__(self, comm: Any, xp: Any = np, on_phase: Callable[[str], None] | None = None):
        self.comm, self.xp, self.on_phase = comm, xp, on_phase
        self.times: dict[str, float] = {}
        self.wall_total = 0.0
        self.cpu_total = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block run by every rank: from a barrier to a barrier, the device drained.

        On an error (raised alike on every rank) the closing barrier is
        skipped everywhere and nothing is recorded.
        """
        if self.on_phase is not None:
            self.on_phase(name)
        self.sync()
        self.comm.barrier()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.comm.barrier()
        self.times[name] = time.perf_counter() - t0

    def summary(self) -> str:
        """``read 0.1 s, forward 2.3 s, ...`` of the phases so far."""
        return ", ".join(f"{k} {v:.3g} s" for k, v in self.times.items())

    def sync(self) -> None:
        """Wait for all queued work of the current device, every stream (no-op for NumPy)."""
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()

    def once(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        """Run ``fn`` between barriers: (wall s, CPU s max over ranks, result)."""
        self.sync()
        self.comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        self.sync()
        self.comm.barrier()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        self.wall_total += wall
        self.cpu_total += cpu
        if self.comm.size > 1:
            cpu = max(self.comm.allgather_obj(cpu))
        return wall, cpu, res

    def measure(self, fn: Callable[[], Any], warmup: int = 0, repeat: int = 1,
                keep_last: bool = False) -> Measurement:
        """``warmup`` untimed then ``repeat`` timed calls of ``fn``.

        The previous call's result is dropped before each call, so two of
        them never live at once. With ``keep_last`` the last result is kept
        in :attr:`Measurement.result`.
        """
        m = Measurement()
        res = None
        for i in range(int(warmup) + int(repeat)):
            res = None
            wall, cpu, res = self.once(fn)
            if i >= warmup:
                m.times.append(wall)
                m.cpus.append(cpu)
        m.result = res if keep_last else None
        return m

    def cpu_wall_ratio(self, reset: bool = True) -> float:
        """Lowest CPU/wall ratio over the ranks of the calls since the last reset.

        Well below 1 means the process was descheduled (other load on the
        machine). A collective call.
        """
        ratio = self.cpu_total / self.wall_total if self.wall_total > 0 else 1.0
        if reset:
            self.reset()
        return min(self.comm.allgather_obj(ratio)) if self.comm.size > 1 else ratio

    def reset(self) -> None:
        """Restart the running totals of :meth:`cpu_wall_ratio`."""
        self.wall_total = self.cpu_total = 0.0


def measure(comm: Any, fn: Callable[[], Any], warmup: int = 0, repeat: int = 1, xp: Any = np,
            keep_last: bool = False) -> Measurement:
    """:meth:`Timer.measure` with a timer of its own."""
    return Timer(comm, xp).measure(fn, warmup, repeat, keep_last)
