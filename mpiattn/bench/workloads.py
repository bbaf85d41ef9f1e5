"""What ``mpiattn bench`` measures inside one (MPI) job: inputs, timers, workloads, memory.

Each function here runs on every rank of a communicator and returns plain,
JSON-ready records (dicts); :mod:`mpiattn.bench` decides what to run, in which
processes, and turns the records into tables, targets and plots.

A *task* is a dict naming one workload and its global sizes::

    {"workload": "attention", "impl": "ring", "B": 1, "H": 1, "Hkv": 1,
     "N": 32768, "M": 32768, "E": 64, "Ev": 64, "dtype": "float32",
     "causal": False, "layout": "contiguous", "block": None,
     "passes": ["fwd", "fwdbwd"], "repeat": 5, "warmup": 1}

``impl`` is an mpiattn strategy (``ring``, ``allgather``, ``ulysses``,
``materialized``, ``auto``), ``reference`` (single-process NumPy/CuPy attention
that materialises the scores, the way one would write it without mpiattn) or
``torch`` (``torch.nn.functional.scaled_dot_product_attention``). Workloads
``gemm_square`` and ``gemm_tile`` measure the GEMM ceilings; ``product``
times :func:`mpiattn.matmul_nt`/``nn``/``tn`` beside a local matmul of the
same per-rank shapes.

Conventions
-----------
* Every rank draws only its own rows (a generator per rank), so no rank ever
  holds a global array (except ``reference`` and ``torch``, single-process by
  definition).
* Times are wall-clock seconds between barriers (the slowest rank counts),
  device-synchronised on GPU; a record keeps every repeat and the median.
* FLOPs are the nominal counts of exact attention over the visible
  (query, key) pairs ``V`` (all ``N*M``, about half when causal), summed over
  batch and heads: forward ``2 V (E + Ev)``, backward ``2 V (3 E + 2 Ev)``
  (five GEMMs, the scores recomputed). The same counts are used for every
  implementation, so GFLOP/s compare times, not algorithms.
* Memory: peak resident set size of the process (``ru_maxrss``) on CPU, which
  only means something in a fresh process per case; the high-water of CuPy's
  pool on GPU. ``baseline`` is the resident size just before the inputs are
  made (interpreter, libraries, MPI, BLAS buffers after a small warm-up).
* Bytes sent per rank are counted (payload handed to MPI for other ranks) by
  wrapping :class:`mpiattn.comm.Comm`'s transfer methods during the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

from . import backend
from .layouts import local_length

__all__ = ["visible_pairs", "attention_flops", "estimate_bytes", "MemoryMeter", "ByteCounter",
           "run_task", "environment"]

MiB = 2**20


# ----------------------------------------------------------------- FLOPs and sizes
def visible_pairs(N: int, M: int, causal: bool) -> int:
    """Number of (query i, key j) pairs attended: ``N*M``, or ``#{j <= i}`` when causal."""
    if not causal:
        return N * M
    full = max(0, min(N, M))        # rows i < M see i + 1 keys
    return full * (full + 1) // 2 + max(0, N - M) * M


def attention_flops(t: dict, pass_: str) -> float:
    """Nominal FLOPs of task ``t`` for ``pass_`` in {"fwd", "bwd", "fwdbwd"} (whole job)."""
    V = visible_pairs(t["N"], t["M"], t["causal"]) * t["B"] * t["H"]
    fwd = 2.0 * V * (t["E"] + t["Ev"])
    bwd = 2.0 * V * (3 * t["E"] + 2 * t["Ev"])
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[pass_]


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _acc_size(dtype: str) -> int:
    return backend.accum_dtype(dtype).itemsize


def shard_bytes(t: dict, P: int, rank: int = 0, grads: bool = False) -> int:
    """Bytes of this rank's q, k, v, out shards (and dout, dq, dk, dv with ``grads``)."""
    s = _itemsize(t["dtype"])
    n = local_length(t["N"], rank, P, t["layout"])
    m = local_length(t["M"], rank, P, t["layout"])
    q_out = t["B"] * t["H"] * n * (t["E"] + t["Ev"])
    kv = t["B"] * t["Hkv"] * m * (t["E"] + t["Ev"])
    return s * (q_out + kv) * (2 if grads else 1)


def estimate_bytes(t: dict, P: int, pass_: str) -> int:
    """Estimated peak bytes per rank above the baseline for task ``t`` at ``P`` ranks.

    A model of the arrays each implementation keeps alive at its peak (inputs,
    folded copies, accumulators, one score tile, pieces in flight), used by
    the ``--max-memory`` guard and the memory-per-rank curve; the measured
    peak is always reported beside it.
    """
    B, H, Hkv, E, Ev = t["B"], t["H"], t["Hkv"], t["E"], t["Ev"]
    s, a = _itemsize(t["dtype"]), _acc_size(t["dtype"])
    cast = 0 if s == a else 1                           # float16 keeps float32 copies besides the inputs
    impl = t["impl"]
    one = impl in ("reference", "torch")
    n = t["N"] if one else -(-t["N"] // P)
    m = t["M"] if one else -(-t["M"] // P)
    G = H // Hkv
    q_row, o_row, kv_row = B * H * E, B * H * Ev, B * Hkv * (E + Ev)    # words per row
    inputs = s * (n * q_row + m * kv_row)
    out_lse = s * n * o_row + a * B * H * n
    dout = s * n * o_row
    if impl == "reference":                             # the (B, H, N, M) probabilities, kept for backward
        scores = a * B * H * n * m
        upcast = cast * a * (n * q_row + m * kv_row * G)
        fwd = inputs + upcast + scores + out_lse + a * n * o_row
        bwd = fwd + dout + scores + a * (n * q_row + m * kv_row * G) * 2
        return int(fwd if pass_ == "fwd" else bwd)
    if impl == "torch":                                 # flash kernels: O(rows) extra
        fwd = inputs + out_lse + a * n * o_row
        bwd = inputs + out_lse + dout + inputs + cast * a * (n * q_row + m * kv_row)
        return int(fwd if pass_ == "fwd" else max(fwd, bwd))
    if impl == "materialized":                          # n x M scores per head, a few of them alive
        scores = a * B * H * n * t["M"]
        fwd = inputs + out_lse + 3 * scores + a * n * (q_row + o_row)
        bwd = inputs + out_lse + dout + 4 * scores + a * (n * q_row * 2 + m * kv_row * G * 2)
        return int(fwd if pass_ == "fwd" else max(fwd, bwd))
    # blocked strategies: ring, allgather, ulysses (auto is one of them)
    T = int(t.get("block") or 512)
    hp = P if impl == "ulysses" else 1                  # ulysses: whole sequence, H/P heads
    n_loc = t["N"] if impl == "ulysses" else n
    m_loc = t["M"] if impl == "ulysses" else m
    Tq, Tk = min(T, n_loc), min(T, m_loc)
    BK = max(1, B * Hkv // hp)
    tile_f = a * BK * (Tq * G * (Tk + Ev + 8) + Tk * (E + Ev))
    tile_b = a * BK * (Tq * G * (2 * Tk + E + 4) + 2 * Tk * (E + Ev))
    rounds = P if impl == "allgather" else 1
    pieces_f = 3 * rounds * Tk * kv_row * s
    pieces_b = pieces_f + 3 * rounds * Tk * kv_row * a
    moved = 0
    if impl == "ulysses":                               # head-sharded copies, with their send buffers
        moved = 2 * s * (t["N"] * (q_row + o_row) + t["M"] * kv_row) // P
    rows = a * n_loc * B * H // hp                      # one accumulation word per (query row, head)
    # forward: folded q, running o and its normalised copy, m and l, one tile, pieces in flight
    fwd = inputs + moved + rows * (E + 2 * Ev + 3) + cast * s * n * o_row + tile_f + pieces_f
    # backward: out, lse, dout kept; folded q and dout, dq, dk, dv accumulators, tiles, pieces
    bwd = (inputs + out_lse + dout + moved + rows * (2 * E + Ev + 2) + a * m_loc * kv_row // hp
           + cast * s * (n * q_row + m * kv_row) + tile_b + pieces_b)
    return int(fwd if pass_ == "fwd" else max(fwd, bwd))


# ----------------------------------------------------------------- memory
def _rss_now() -> int:
    """Current resident set size in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil
            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - optional
            return 0


def _rss_peak() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss``).

    Linux updates its counters in batches, so the current size read just
    before may exceed ``ru_maxrss`` by a few pages: the larger one is returned.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak if sys.platform == "darwin" else peak * 1024), _rss_now())


class MemoryMeter:
    """Peak memory of this rank: RSS high-water on CPU, CuPy pool high-water on GPU.

    On GPU the default CuPy allocator is wrapped so that every allocation
    updates the high-water of the pool's used bytes.
    """

    def __init__(self, xp: Any):
        self.gpu = xp is not np
        self.peak_used = 0
        if self.gpu:
            self.pool = xp.get_default_memory_pool()
            xp.cuda.set_allocator(self._malloc)

    def _malloc(self, size: int) -> Any:
        mem = self.pool.malloc(size)
        self.peak_used = max(self.peak_used, self.pool.used_bytes())
        return mem

    def now(self) -> int:
        return int(self.pool.used_bytes()) if self.gpu else _rss_now()

    def peak(self) -> int:
        return int(self.peak_used) if self.gpu else _rss_peak()

    def reset(self) -> None:
        """Restart the GPU high-water (the CPU one cannot be reset: use a fresh process)."""
        if self.gpu:
            self.peak_used = int(self.pool.used_bytes())


# ----------------------------------------------------------------- bytes on the wire
class ByteCounter:
    """Counts the payload bytes this rank hands to MPI for other ranks.

    Used as a context manager: :class:`mpiattn.comm.Comm`'s transfer methods
    are wrapped while it is active (every Comm instance, also those that
    :mod:`mpiattn.products` makes for the materialised strategy).
    """

    def __init__(self) -> None:
        self.sent = 0

    @contextlib.contextmanager
    def active(self) -> Iterator["ByteCounter"]:
        from .comm import Comm

        names = ("isend", "gatherv_rows", "alltoallv_rows", "reduce_scatterv_rows", "allreduce_")
        orig = {nm: getattr(Comm, nm) for nm in names}
        counter = self

        def row_bytes(x: Any) -> int:
            return int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize

        def isend(self, arr, dest, tag):
            counter.sent += int(arr.nbytes)
            return orig["isend"](self, arr, dest, tag)

        def gatherv_rows(self, x, counts, root=0):
            receivers = self.size - 1 if root is None else int(root != self.rank)
            counter.sent += int(x.nbytes) * receivers
            return orig["gatherv_rows"](self, x, counts, root)

        def alltoallv_rows(self, x, send_counts, recv_counts):
            counter.sent += row_bytes(x) * (int(sum(send_counts)) - int(send_counts[self.rank]))
            return orig["alltoallv_rows"](self, x, send_counts, recv_counts)

        def reduce_scatterv_rows(self, x, counts):
            if self.size > 1:
                counter.sent += row_bytes(x) * (int(sum(counts)) - int(counts[self.rank]))
            return orig["reduce_scatterv_rows"](self, x, counts)

        def allreduce_(self, x):
            if self.size > 1:
                counter.sent += int(x.nbytes)
            return orig["allreduce_"](self, x)

        wrapped = dict(isend=isend, gatherv_rows=gatherv_rows, alltoallv_rows=alltoallv_rows,
                       reduce_scatterv_rows=reduce_scatterv_rows, allreduce_=allreduce_)
        try:
            for nm, fn in wrapped.items():
                setattr(Comm, nm, fn)
            yield self
        finally:
            for nm, fn in orig.items():
                setattr(Comm, nm, fn)


# ----------------------------------------------------------------- environment
def environment() -> dict:
    """What the numbers depend on: BLAS kernel and threads, versions, CPU, load."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__,
                           "hostname": os.uname().nodename, "cpu_count": os.cpu_count()}
    try:
        env["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        env["cores_usable"] = os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        env["cpu"] = ""
    try:
        import threadpoolctl
        env["blas"] = [{k: lib.get(k) for k in ("internal_api", "version", "architecture",
                                                 "num_threads", "threading_layer")}
                       for lib in threadpoolctl.threadpool_info()]
    except ImportError:
        env["blas"] = "threadpoolctl not installed (pip install threadpoolctl to record the BLAS kernel)"
    env["vars"] = {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                              "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                              "MPIR_CVAR_ENABLE_HEAVY_YIELD") if k in os.environ}
    try:
        env["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        from mpi4py import MPI
        env["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informative only
        pass
    from . import __version__
    env["mpiattn"] = __version__
    if "cupy" in sys.modules:
        try:
            import cupy
            dev = cupy.cuda.Device()
            env["gpu"] = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
            env["cupy"] = cupy.__version__
        except Exception:  # noqa: BLE001 - informative only
            pass
    return env


# ----------------------------------------------------------------- timing
#: Wall and CPU seconds of this process inside timed calls since the last reset: a CPU/wall
#: ratio well below 1 means the process was descheduled (other load on the machine).
_CLOCK = {"wall": 0.0, "cpu": 0.0}


def _sync(xp: Any) -> None:
    """Wait for all queued work of the current device, every stream (no-op for NumPy)."""
    if xp is not np:
        xp.cuda.Device().synchronize()


def _timed(c: Any, xp: Any, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Run ``fn`` between barriers (device-synchronised): (wall s, CPU s, result).

    Wall time counts the slowest rank. CPU time is this process's, the
    largest over the ranks: on a machine shared with other work it leaves out
    the time the process was descheduled (MPI ranks waiting for each other
    poll, so it counts their waits).
    """
    _sync(xp)
    c.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    res = fn()
    _sync(xp)
    c.barrier()
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    _CLOCK["wall"] += dt
    _CLOCK["cpu"] += cpu
    return dt, (cpu if c.size == 1 else max(c.allgather_obj(cpu))), res


def _cpu_ratio(c: Any) -> float:
    """Lowest CPU/wall ratio over the ranks since the last call (then reset)."""
    ratio = _CLOCK["cpu"] / _CLOCK["wall"] if _CLOCK["wall"] > 0 else 1.0
    _CLOCK["wall"] = _CLOCK["cpu"] = 0.0
    return min(c.allgather_obj(ratio))


def _repeat(c: Any, xp: Any, fn: Callable[[], Any], warmup: int, repeat: int,
            keep_last: bool = False) -> tuple[list[float], list[float], Any]:
    """Wall and CPU times of ``repeat`` calls after ``warmup`` (the previous result dropped before each)."""
    times, cpus, res = [], [], None
    for i in range(warmup + repeat):
        res = None
        dt, cpu, res = _timed(c, xp, fn)
        if i >= warmup:
            times.append(dt)
            cpus.append(cpu)
    return times, cpus, (res if keep_last else None)


def _max_over_ranks(c: Any, value: float) -> float:
    return max(c.allgather_obj(value))


# ----------------------------------------------------------------- inputs
def _draw(xp: Any, rng: np.random.Generator, shape: tuple, dtype: str) -> Any:
    dt = np.dtype(dtype)
    x = rng.standard_normal(shape, dtype=dt if dt in (np.float32, np.float64) else np.float32)
    if x.dtype != dt:
        x = x.astype(dt)
    return backend.to_device(x, xp)


def _local_qkv(xp: Any, t: dict, rank: int, P: int, seed: int) -> tuple[Any, Any, Any]:
    """This rank's q, k, v rows (a generator per rank and task: no global array anywhere)."""
    one = t["impl"] in ("reference", "torch")
    n = t["N"] if one else local_length(t["N"], rank, P, t["layout"])
    m = t["M"] if one else local_length(t["M"], rank, P, t["layout"])
    rng = np.random.default_rng([seed, P, rank])
    return (_draw(xp, rng, (t["B"], t["H"], n, t["E"]), t["dtype"]),
            _draw(xp, rng, (t["B"], t["Hkv"], m, t["E"]), t["dtype"]),
            _draw(xp, rng, (t["B"], t["Hkv"], m, t["Ev"]), t["dtype"]))


def _dout_for(xp: Any, q: Any, t: dict, rank: int, seed: int) -> Any:
    """A random ``dout`` shaped like this rank's output ``(B, H, n_r, Ev)``."""
    rng = np.random.default_rng([seed, 99, rank])
    return _draw(xp, rng, tuple(q.shape[:3]) + (t["Ev"],), t["dtype"])


# ----------------------------------------------------------------- implementations
def _mpiattn_impl(c: Any, t: dict) -> tuple[Callable, Callable]:
    import mpiattn

    kw = dict(causal=t["causal"], layout=t["layout"], strategy=t["impl"], block_size=t.get("block"),
              check_finite=t.get("check_finite", False))

    def fwd(q, k, v):
        return mpiattn.attention(q, k, v, c, **kw)

    def bwd(dout, q, k, v, res):
        return mpiattn.attention_backward(dout, q, k, v, res[0], res[1], c, **kw)

    return fwd, bwd


def _reference_impl(c: Any, t: dict) -> tuple[Callable, Callable]:
    """Plain attention that materialises the ``(B, H, N, M)`` probabilities (one process)."""
    acc = backend.accum_dtype(t["dtype"])
    G = t["H"] // t["Hkv"]
    scale = 1.0 / math.sqrt(t["E"])

    def heads(xp, x):
        x = x.astype(acc, copy=False)
        return x if G == 1 else xp.repeat(x, G, axis=1)

    def fwd(q, k, v):
        xp = backend.array_module(q)
        kk, vv = heads(xp, k), heads(xp, v)
        S = xp.matmul(q.astype(acc, copy=False), kk.swapaxes(-1, -2))
        S *= acc.type(scale)
        if t["causal"]:
            hidden = backend.to_device(np.triu(np.ones((t["N"], t["M"]), dtype=bool), 1), xp)
            for S2 in S.reshape(-1, t["N"], t["M"]):      # one (N, M) slice at a time (also on CuPy)
                S2[hidden] = -np.inf
        m = S.max(axis=-1, keepdims=True)
        S -= m
        xp.exp(S, out=S)
        l = S.sum(axis=-1, keepdims=True)
        S /= l
        out = xp.matmul(S, vv).astype(q.dtype, copy=False)
        return out, (m + xp.log(l))[..., 0], S

    def bwd(dout, q, k, v, res):
        xp = backend.array_module(q)
        out, _, Pm = res
        kk, vv = heads(xp, k), heads(xp, v)
        do = dout.astype(acc, copy=False)
        B, H, N, _ = q.shape
        dv = xp.matmul(Pm.swapaxes(-1, -2), do)
        dP = xp.matmul(do, vv.swapaxes(-1, -2))
        dP -= (do * out.astype(acc, copy=False)).sum(axis=-1, keepdims=True)
        dP *= Pm
        dq = xp.matmul(dP, kk) * acc.type(scale)
        dk = xp.matmul(dP.swapaxes(-1, -2), q.astype(acc, copy=False)) * acc.type(scale)
        if G > 1:
            dk = dk.reshape(B, t["Hkv"], G, t["M"], -1).sum(axis=2)
            dv = dv.reshape(B, t["Hkv"], G, t["M"], -1).sum(axis=2)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return fwd, bwd


def _torch_impl(c: Any, t: dict, threads: int) -> tuple[Callable, Callable, Callable]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(max(1, threads))
    kw = dict(is_causal=t["causal"])
    if t["H"] != t["Hkv"]:
        kw["enable_gqa"] = True

    def tensor(x):
        if backend.is_cupy_array(x):
            return torch.from_dlpack(x)
        return torch.from_numpy(x)

    def sync(x):
        if x.is_cuda:
            torch.cuda.synchronize()

    def fwd(q, k, v):
        with torch.no_grad():
            o = F.scaled_dot_product_attention(tensor(q), tensor(k), tensor(v), **kw)
            sync(o)
            return o

    leaves: dict = {}

    def fwd_grad(q, k, v):
        for name, x in (("q", q), ("k", k), ("v", v)):
            leaves[name] = tensor(x).detach().requires_grad_(True)
        o = F.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], **kw)
        sync(o)
        return o

    def bwd(dout, q, k, v, o):
        o.backward(tensor(dout))
        sync(o)
        grads = tuple(leaves[nm].grad for nm in "qkv")
        for nm in "qkv":
            leaves[nm].grad = None
        return grads

    return fwd, fwd_grad, bwd


# ----------------------------------------------------------------- tasks
def _attention_task(c: Any, xp: Any, t: dict, cfg: dict, mem: MemoryMeter) -> list[dict]:
    P, rank = c.size, c.rank
    impl = t["impl"]
    single = impl in ("reference", "torch")
    base = dict(t, P=1 if single else P)
    if single and P > 1:
        return [dict(base, status="skipped", reason=f"{impl} is single-process; run it at P=1")]
    passes = list(t.get("passes", ["fwd", "fwdbwd"]))
    if impl == "torch":
        try:
            fwd, fwd_grad, bwd = _torch_impl(c, t, int(cfg.get("torch_threads", 1)))
        except ImportError as exc:
            return [dict(base, **{"pass": p}, status="skipped", reason=f"torch not importable: {exc}")
                    for p in passes]
    elif impl == "reference":
        fwd, bwd = _reference_impl(c, t)
    else:
        fwd, bwd = _mpiattn_impl(c, t)

    # a small warm-up problem in the same process: code paths, BLAS buffers, MPI connections
    small = dict(t, N=min(t["N"], 256 * P), M=min(t["M"], 256 * P))
    q, k, v = _local_qkv(xp, small, rank, P, 7)
    res = (fwd_grad if impl == "torch" and "fwdbwd" in passes else fwd)(q, k, v)
    if "fwdbwd" in passes:
        bwd(_dout_for(xp, q, t, rank, 7), q, k, v, res)
    del q, k, v, res
    mem.reset()
    _CLOCK["wall"] = _CLOCK["cpu"] = 0.0
    baseline = _max_over_ranks(c, mem.now())

    limit = cfg.get("max_memory")
    allowed = []
    for p in passes:
        est = estimate_bytes(t, P, p)
        if limit and baseline + est > limit:
            allowed.append((p, est, f"estimated {(baseline + est) / MiB:.0f} MiB per rank "
                                    f"(baseline {baseline / MiB:.0f} + {est / MiB:.0f}) > --max-memory "
                                    f"{limit / MiB:.0f} MiB"))
        else:
            allowed.append((p, est, None))
    records = []
    if all(reason for _, _, reason in allowed):
        return [dict(base, **{"pass": p}, status="skipped", reason=r, est_bytes=e, baseline_bytes=baseline)
                for p, e, r in allowed]

    counter = ByteCounter()
    warmup, repeat = int(t.get("warmup", 1)), int(t.get("repeat", 5))
    q, k, v = _local_qkv(xp, t, rank, P, int(cfg.get("seed", 0)))
    common = dict(base, baseline_bytes=baseline, shard_bytes=_max_over_ranks(c, shard_bytes(t, P, rank)),
                  shard_bytes_grads=_max_over_ranks(c, shard_bytes(t, P, rank, grads=True)),
                  warmup=warmup, repeat=repeat, status="ok")
    # phase 1: forward alone (torch: inference mode)
    with counter.active():
        tf, cf, res = _repeat(c, xp, lambda: fwd(q, k, v), warmup, repeat, keep_last=True)
    calls = warmup + repeat
    fwd_sent = counter.sent / calls
    peak_fwd = mem.peak()
    est = dict((p, e) for p, e, _ in allowed)
    records.append(_time_record(c, common, "fwd", tf, cf, attention_flops(t, "fwd"), fwd_sent,
                                peak_fwd, est["fwd"] if "fwd" in est else estimate_bytes(t, P, "fwd"),
                                mem))
    if "fwd" not in passes:
        records.pop()
    # phase 2: backward on the last forward's results (torch: forward with autograd + backward)
    reason = dict((p, r) for p, _, r in allowed).get("fwdbwd")
    if "fwdbwd" in passes and reason:
        records.append(dict(common, **{"pass": "fwdbwd"}, status="skipped", reason=reason))
    elif "fwdbwd" in passes:
        dout = _dout_for(xp, q, t, rank, int(cfg.get("seed", 0)))
        counter.sent = 0
        if impl == "torch":
            res = None
            tfg, tb, total, total_cpu = [], [], [], []
            for i in range(warmup + repeat):
                o = None
                dt_f, cpu_f, o = _timed(c, xp, lambda: fwd_grad(q, k, v))
                dt_b, cpu_b, _ = _timed(c, xp, lambda: bwd(dout, q, k, v, o))
                if i >= warmup:
                    tfg.append(dt_f)
                    tb.append(dt_b)
                    total.append(dt_f + dt_b)
                    total_cpu.append(cpu_f + cpu_b)
        else:
            with counter.active():
                tb, cb, _ = _repeat(c, xp, lambda: bwd(dout, q, k, v, res), warmup, repeat)
            total = [statistics.median(tf) + b for b in tb]
            total_cpu = [statistics.median(cf) + b for b in cb]
        rec = _time_record(c, common, "fwdbwd", total, total_cpu, attention_flops(t, "fwdbwd"),
                           fwd_sent + counter.sent / calls, mem.peak(), est["fwdbwd"], mem)
        rec["times_bwd_s"] = tb
        if impl == "torch":
            rec["times_fwd_grad_s"] = tfg
            rec["note"] = "torch fwd+bwd: autograd forward + backward per repeat"
        else:
            rec["note"] = "fwd+bwd = median forward + each backward (backward reuses the forward's out, lse)"
        records.append(rec)
    if t.get("ceilings"):
        records += _ceilings(c, xp, t, records)
    return records


def _ceilings(c: Any, xp: Any, t: dict, records: list[dict]) -> list[dict]:
    """Measure the GEMM ceilings now (same process, same moment) and attach them to ``records``."""
    from .bench_report import tile_key

    P = records[0]["P"] if records else c.size
    sq = _gemm_square_task(c, xp, dict(workload="gemm_square", dtype=t["dtype"], size=int(t.get("gemm_size", 2048)),
                                       repeat=5, device=t.get("device", "cpu")), {})
    tiles = _gemm_tile_task(c, xp, dict(t, workload="gemm_tile", repeat=5, tile_key=list(tile_key(t, P)),
                                        passes=None), {}, P)
    rate = {r["pass"]: r["gflops_per_rank"] for r in tiles}
    for r in records:
        if r.get("status") == "ok" and "gflops_per_rank" in r:
            r["gemm_square_gflops_here"] = sq[0]["gflops_per_rank"]
            r["gemm_tile_gflops_here"] = rate[r["pass"]]
    where = f"{t['impl']} N={t['N']}"
    return [dict(g, P=P, measured_with=where) for g in sq + tiles]


def _time_record(c: Any, common: dict, pass_: str, times: list[float], cpus: list[float], flops: float,
                 sent: float, peak: int, est: int, mem: MemoryMeter) -> dict:
    med, med_cpu = statistics.median(times), statistics.median(cpus)
    peaks = c.allgather_obj(int(peak))
    P = common["P"]
    return dict(common, **{"pass": pass_}, times_s=times, time_s=med, time_min_s=min(times), flops=flops,
                cpu_wall_ratio=_cpu_ratio(c),
                loadavg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                gflops=flops / med / 1e9, gflops_per_rank=flops / med / 1e9 / P,
                times_cpu_s=cpus, time_cpu_s=med_cpu, gflops_per_rank_cpu=flops / med_cpu / 1e9 / P,
                bytes_sent_per_rank=_max_over_ranks(c, float(sent)),
                peak_bytes=max(peaks), peak_bytes_per_rank=peaks, est_bytes=est,
                memory_kind="cupy-pool-high-water" if mem.gpu else "ru_maxrss")


def _gemm_rate(c: Any, xp: Any, fn: Callable[[], None], flops: float, repeat: int,
               min_time: float = 0.05) -> tuple[float, list[float], float]:
    """Per-rank GFLOP/s of ``fn`` (every rank runs it at once): median of ``repeat`` samples by wall
    time, the samples, and the rate by CPU time (median)."""
    fn()
    dt, _, _ = _timed(c, xp, fn)
    reps = max(1, int(math.ceil(min_time / max(dt, 1e-6))))
    reps = int(c.bcast_obj(reps))

    def many():
        for _ in range(reps):
            fn()

    times, cpus, _ = _repeat(c, xp, many, 0, repeat)
    med = statistics.median(times)
    return flops * reps / med / 1e9, times, flops * reps / statistics.median(cpus) / 1e9


def _gemm_square_task(c: Any, xp: Any, t: dict, cfg: dict) -> list[dict]:
    size, dt = int(t.get("size", 2048)), np.dtype(t["dtype"])
    rng = np.random.default_rng([5, c.rank])
    a = backend.to_device(rng.standard_normal((size, size)).astype(dt), xp)
    b = backend.to_device(rng.standard_normal((size, size)).astype(dt), xp)
    out = xp.empty((size, size), dtype=dt)
    rate, times, rate_cpu = _gemm_rate(c, xp, lambda: xp.matmul(a, b, out=out), 2.0 * size**3,
                                       int(t.get("repeat", 5)))
    return [dict(t, P=c.size, status="ok", gflops_per_rank=rate, times_s=times, gflops_per_rank_cpu=rate_cpu,
                 shape=f"({size}x{size})({size}x{size})")]


def _gemm_tile_task(c: Any, xp: Any, t: dict, cfg: dict, P: int | None = None) -> list[dict]:
    """GEMMs of attention's tile shapes (for ``P`` ranks), with the operand views the kernels use."""
    acc = backend.accum_dtype(t["dtype"])
    B, Hkv, G, E, Ev = t["B"], t["Hkv"], t["H"] // t["Hkv"], t["E"], t["Ev"]
    T = int(t.get("block") or 512)
    P = c.size if P is None else P
    Tq = min(T, -(-t["N"] // P))
    Tk = min(T, -(-t["M"] // P))
    R = Tq * G
    rng = np.random.default_rng([6, c.rank])

    def arr(*shape):
        return backend.to_device(rng.standard_normal(shape).astype(acc), xp)

    qs, do = arr(B, Hkv, 4 * R, E), arr(B, Hkv, 4 * R, Ev)
    kc, vc = arr(B, Hkv, Tk, E), arr(B, Hkv, Tk, Ev)
    S, dS = arr(B, Hkv, R, Tk), arr(B, Hkv, R, Tk)
    o_r, dq_r = arr(B, Hkv, R, Ev), arr(B, Hkv, R, E)
    dk_r, dv_r = arr(B, Hkv, Tk, E), arr(B, Hkv, Tk, Ev)
    q_t, do_t = qs[..., R:2 * R, :], do[..., R:2 * R, :]
    kT, vT = kc.swapaxes(-1, -2), vc.swapaxes(-1, -2)

    def fwd():
        xp.matmul(q_t, kT, out=S)
        xp.matmul(S, vc, out=o_r)

    def bwd():
        xp.matmul(q_t, kT, out=S)
        xp.matmul(S.swapaxes(-1, -2), do_t, out=dv_r)
        xp.matmul(do_t, vT, out=dS)
        xp.matmul(dS, kc, out=dq_r)
        xp.matmul(dS.swapaxes(-1, -2), q_t, out=dk_r)

    pairs = B * Hkv * R * Tk
    repeat = int(t.get("repeat", 5))
    f_fwd, f_bwd = 2.0 * pairs * (E + Ev), 2.0 * pairs * (3 * E + 2 * Ev)
    r_fwd, times_f, c_fwd = _gemm_rate(c, xp, fwd, f_fwd, repeat)
    r_bwd, times_b, c_bwd = _gemm_rate(c, xp, bwd, f_bwd, repeat)
    r_both = (f_fwd + f_bwd) / (f_fwd / r_fwd + f_bwd / r_bwd)
    c_both = (f_fwd + f_bwd) / (f_fwd / c_fwd + f_bwd / c_bwd)
    shape = f"B*Hkv={B * Hkv}: ({R}x{E})({E}x{Tk}), ({R}x{Tk})({Tk}x{Ev})"
    return [dict(t, P=P, status="ok", **{"pass": "fwd"}, gflops_per_rank=r_fwd, times_s=times_f,
                 gflops_per_rank_cpu=c_fwd, shape=shape),
            dict(t, P=P, status="ok", **{"pass": "bwd"}, gflops_per_rank=r_bwd, times_s=times_b,
                 gflops_per_rank_cpu=c_bwd, shape=shape + " + 3 backward GEMMs"),
            dict(t, P=P, status="ok", **{"pass": "fwdbwd"}, gflops_per_rank=r_both, gflops_per_rank_cpu=c_both,
                 shape=shape + " + 3 backward GEMMs")]


def _product_task(c: Any, xp: Any, t: dict, cfg: dict, mem: MemoryMeter) -> list[dict]:
    """A distributed product beside a plain local matmul of the same per-rank shapes."""
    import mpiattn

    op, N, M, d, dt = t["op"], t["N"], t["M"], t["d"], t["dtype"]
    n = local_length(N, c.rank, c.size, t["layout"])
    m = local_length(M, c.rank, c.size, t["layout"])
    rng = np.random.default_rng([int(cfg.get("seed", 0)), c.size, c.rank, 3])
    shapes = {"nt": ((n, d), (m, d), (n, d), (d, M)),
              "nn": ((n, M), (m, d), (n, M), (M, d)),
              "tn": ((m, N), (m, d), (N, m), (m, d))}[op]
    a, b = _draw(xp, rng, shapes[0], dt), _draw(xp, rng, shapes[1], dt)
    fn = {"nt": mpiattn.matmul_nt, "nn": mpiattn.matmul_nn, "tn": mpiattn.matmul_tn}[op]
    warmup, repeat = int(t.get("warmup", 1)), int(t.get("repeat", 5))
    counter = ByteCounter()
    with counter.active():
        times, cpus, _ = _repeat(c, xp, lambda: fn(a, b, c, layout=t["layout"], block_size=t.get("block")),
                           warmup, repeat)
    sent = counter.sent / (warmup + repeat)
    del a, b
    x, y = _draw(xp, rng, shapes[2], dt), _draw(xp, rng, shapes[3], dt)
    local, _, _ = _repeat(c, xp, lambda: xp.matmul(x, y), warmup, repeat)
    flops = 2.0 * N * M * d
    med, med_local = statistics.median(times), statistics.median(local)
    return [dict(t, P=c.size, status="ok", times_s=times, time_s=med, flops=flops,
                 gflops=flops / med / 1e9, gflops_per_rank=flops / med / 1e9 / c.size,
                 local_gemm_times_s=local, local_gemm_time_s=med_local,
                 frac_local_gemm=med_local / med, bytes_sent_per_rank=_max_over_ranks(c, sent),
                 peak_bytes=max(c.allgather_obj(mem.peak())))]


def _baseline_task(c: Any, xp: Any, t: dict, cfg: dict, mem: MemoryMeter) -> list[dict]:
    """Resident size after imports, MPI start-up and a tiny attention call (the memory floor)."""
    tiny = dict(t, impl="ring", N=64 * c.size, M=64 * c.size)
    fwd, bwd = _mpiattn_impl(c, tiny)
    q, k, v = _local_qkv(xp, tiny, c.rank, c.size, 1)
    res = fwd(q, k, v)
    bwd(_dout_for(xp, q, tiny, c.rank, 1), q, k, v, res)
    return [dict(t, P=c.size, status="ok", baseline_bytes=_max_over_ranks(c, mem.now()),
                 peak_bytes=_max_over_ranks(c, mem.peak()))]


def run_task(c: Any, xp: Any, task: dict, cfg: dict, mem: MemoryMeter) -> list[dict]:
    """Run one task on every rank of ``c``; the same records come back on every rank.

    Parameters
    ----------
    c : mpiattn.comm.Comm
    xp : module
        numpy or cupy: where the inputs live.
    task : dict
        See the module docstring.
    cfg : dict
        Run settings: ``seed``, ``max_memory`` (bytes per rank, or None),
        ``torch_threads``.
    mem : MemoryMeter

    Returns
    -------
    list of dict
        JSON-ready records.
    """
    kind = task["workload"]
    if kind == "attention":
        return _attention_task(c, xp, task, cfg, mem)
    if kind == "gemm_square":
        return _gemm_square_task(c, xp, task, cfg)
    if kind == "gemm_tile":
        return _gemm_tile_task(c, xp, task, cfg)
    if kind == "product":
        return _product_task(c, xp, task, cfg, mem)
    if kind == "baseline":
        return _baseline_task(c, xp, task, cfg, mem)
    raise ValueError(f"unknown benchmark workload {kind!r}")
