"""The machine a benchmark runs on: versions, BLAS, cores, memory, load.

:func:`environment` is the ``env`` record of every job; the other functions
help the launcher decide what may run (available memory; the usable cores
are :func:`mpiattn.comm.node.usable_cores`) and when (:func:`wait_idle`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from ..comm.node import usable_cores

__all__ = ["environment", "available_memory", "cpu_ticks", "wait_idle"]

_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
         "MPIR_CVAR_ENABLE_HEAVY_YIELD", "MPIATTN_GPU_TRANSPORT", "CUPY_TF32")


def available_memory() -> int:
    """``MemAvailable`` in bytes (8 GiB where /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(ln.split(":", 1) for ln in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 * 2**30


def _blas() -> Any:
    try:
        import threadpoolctl
    except ImportError:
        return "threadpoolctl not installed (pip install threadpoolctl to record the BLAS kernel)"
    return [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                     "threading_layer")}
            for lib in threadpoolctl.threadpool_info()]


def environment() -> dict:
    """What the numbers depend on: BLAS kernel and threads, versions, CPU, GPU, load."""
    from .. import __version__

    env: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__, "mpiattn": __version__,
                           "hostname": os.uname().nodename, "cpu_count": os.cpu_count(),
                           "cores_usable": usable_cores()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        env["cpu"] = ""
    env["blas"] = _blas()
    env["vars"] = {k: os.environ[k] for k in _VARS if k in os.environ}
    try:
        env["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        from mpi4py import MPI
        env["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informative only
        pass
    if "torch" in sys.modules:
        env["torch"] = sys.modules["torch"].__version__
    if "cupy" in sys.modules:
        try:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            name = props["name"]
            env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
            env["cupy"] = cupy.__version__
            env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception:  # noqa: BLE001 - informative only
            pass
    return env


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (None where unreadable)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return total - idle, total


def wait_idle(limit_s: float, cores: int, calm_s: int = 3, busy_limit: float = 0.2) -> tuple[float, float | None]:
    """Wait (at most ``limit_s``) until the machine uses under ``busy_limit`` cores for ``calm_s`` s in a row.

    Returns
    -------
    waited : float
        Seconds waited.
    busy : float or None
        Busy cores seen last (None without /proc/stat).
    """
    t0 = time.time()
    calm, busy = 0, None
    prev = cpu_ticks()
    while prev is not None and time.time() - t0 < limit_s:
        time.sleep(1.0)
        now = cpu_ticks()
        if now is None or now[1] == prev[1]:
            break
        busy = cores * (now[0] - prev[0]) / (now[1] - prev[1])
        prev = now
        calm = calm + 1 if busy < busy_limit else 0
        if calm >= calm_s:
            break
    return time.time() - t0, busy
