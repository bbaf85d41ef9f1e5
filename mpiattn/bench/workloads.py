"""Attention workloads: mpiattn's strategies and engines beside a dense and a torch peer.

Implementations of an ``attention`` :class:`~mpiattn.bench.tasks.Task`:

* an mpiattn strategy (``ring``, ``allgather``, ``ulysses``,
  ``materialized``, ``auto``) through :func:`mpiattn.strategies.attention`
  and :func:`~mpiattn.strategies.attention_backward`, with ``engine=`` passed
  only when the task names one;
* ``dense``: attention written the plain way on one process, materialising
  the ``(B, H, N, M)`` probabilities (what one writes without mpiattn);
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the
  same memory (``torch.from_numpy``; DLPack for CuPy), forward under
  ``no_grad`` and forward + backward through autograd.

:func:`attention_task` times them with the bench's one harness
(:class:`~mpiattn.timing.Timer`) and returns JSON-ready records:
times (every repeat and the median, wall and CPU), nominal FLOPs, bytes
sent per rank (read from :attr:`mpiattn.comm.Comm.bytes_sent` before and
after), peak memory beside the model, and optionally the GEMM ceilings.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import backend
from . import ceilings
from .inputs import local_dout, local_qkv
from .memory import MemoryMeter, estimate_bytes, shard_bytes
from .tasks import ENGINE_IMPLS, Settings, Task, attention_flops
from ..timing import Measurement, Timer

__all__ = ["Impl", "Unavailable", "engines_supported", "implementation", "dense_impl", "torch_impl",
           "attention_task", "baseline_task"]

MiB = 2**20


class Unavailable(Exception):
    """This implementation cannot run here (its records say ``skipped`` and why)."""


@dataclass
class Impl:
    """One attention implementation.

    Attributes
    ----------
    forward : callable(q, k, v) -> result
        The forward pass (``result`` is what ``backward`` needs).
    backward : callable(dout, q, k, v, result) -> (dq, dk, dv)
    autograd_forward : callable(q, k, v) -> result, optional
        A forward that records what ``backward`` needs (torch): then each
        timed backward is preceded by one timed call of it.
    used : dict, optional
        What the last forward used, as mpiattn reports it (``details=``:
        strategy, engine, block size).
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    autograd_forward: Callable[..., Any] | None = None
    used: dict | None = None


def _takes(fn: Callable[..., Any], keyword: str) -> bool:
    params = inspect.signature(fn).parameters
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def engines_supported() -> bool:
    """True when :func:`mpiattn.strategies.attention` and its backward take ``engine=`` (issue 11)."""
    from ..strategies import attention, attention_backward

    return _takes(attention, "engine") and _takes(attention_backward, "engine")


def _mpiattn_impl(c: Any, t: Task) -> Impl:
    from .. import strategies

    kw: dict[str, Any] = dict(causal=t.causal, layout=t.layout, strategy=t.impl, block_size=t.block,
                              check_finite=t.check_finite)
    if t.engine is not None:
        if t.impl not in ENGINE_IMPLS:
            raise Unavailable(f"engines apply to {', '.join(ENGINE_IMPLS)}, not {t.impl}")
        if not engines_supported():
            raise Unavailable("this mpiattn's attention() takes no engine= keyword (issue 11 not merged)")
        kw["engine"] = t.engine
    used: dict | None = {} if "details" in inspect.signature(strategies.attention).parameters else None
    fwd_kw = dict(kw, details=used) if used is not None else kw

    def forward(q: Any, k: Any, v: Any) -> Any:
        return strategies.attention(q, k, v, c, **fwd_kw)

    def backward(dout: Any, q: Any, k: Any, v: Any, res: Any) -> Any:
        return strategies.attention_backward(dout, q, k, v, res[0], res[1], c, **kw)

    return Impl(forward, backward, used=used)


def dense_impl(t: Task) -> Impl:
    """Plain attention that materialises the ``(B, H, N, M)`` probabilities (one process).

    The forward returns ``(out, lse, probabilities)``; the backward reuses the
    probabilities. float16/float32 compute in float32.
    """
    acc = backend.accum_dtype(t.dtype)
    G = t.H // t.Hkv
    scale = acc.type(1.0 / math.sqrt(t.E))

    def heads(xp: Any, x: Any) -> Any:
        x = x.astype(acc, copy=False)
        return x if G == 1 else xp.repeat(x, G, axis=1)

    def forward(q: Any, k: Any, v: Any) -> Any:
        xp = backend.array_module(q)
        N, M = q.shape[2], k.shape[2]
        S = xp.matmul(q.astype(acc, copy=False), heads(xp, k).swapaxes(-1, -2))
        S *= scale
        if t.causal:
            hidden = backend.to_device(np.triu(np.ones((N, M), dtype=bool), 1), xp)
            for S2 in S.reshape(-1, N, M):      # one (N, M) slice at a time (also on CuPy)
                S2[hidden] = -np.inf
        m = S.max(axis=-1, keepdims=True)
        S -= m
        xp.exp(S, out=S)
        l = S.sum(axis=-1, keepdims=True)
        S /= l
        out = xp.matmul(S, heads(xp, v)).astype(q.dtype, copy=False)
        return out, (m + xp.log(l))[..., 0], S

    def backward(dout: Any, q: Any, k: Any, v: Any, res: Any) -> Any:
        xp = backend.array_module(q)
        out, _, Pm = res
        kk, vv = heads(xp, k), heads(xp, v)
        do = dout.astype(acc, copy=False)
        B, _, _, _ = q.shape
        M = k.shape[2]
        dv = xp.matmul(Pm.swapaxes(-1, -2), do)
        dP = xp.matmul(do, vv.swapaxes(-1, -2))
        dP -= (do * out.astype(acc, copy=False)).sum(axis=-1, keepdims=True)
        dP *= Pm
        dq = xp.matmul(dP, kk) * scale
        dk = xp.matmul(dP.swapaxes(-1, -2), q.astype(acc, copy=False)) * scale
        if G > 1:
            dk = dk.reshape(B, t.Hkv, G, M, -1).sum(axis=2)
            dv = dv.reshape(B, t.Hkv, G, M, -1).sum(axis=2)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return Impl(forward, backward)


def torch_impl(t: Task, threads: int = 1) -> Impl:
    """``scaled_dot_product_attention`` on the same memory (raises :class:`Unavailable` without torch)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:
        raise Unavailable(f"torch not importable: {exc}") from None

    torch.set_num_threads(max(1, int(threads)))
    kw: dict[str, Any] = dict(is_causal=t.causal)
    if t.H != t.Hkv:
        kw["enable_gqa"] = True

    def tensor(x: Any) -> Any:
        return torch.from_dlpack(x) if backend.is_cupy_array(x) else torch.from_numpy(x)

    def sync(x: Any) -> None:
        if x.is_cuda:
            torch.cuda.synchronize()

    def forward(q: Any, k: Any, v: Any) -> Any:
        with torch.no_grad():
            o = F.scaled_dot_product_attention(tensor(q), tensor(k), tensor(v), **kw)
        sync(o)
        return o

    leaves: dict[str, Any] = {}

    def autograd_forward(q: Any, k: Any, v: Any) -> Any:
        for name, x in (("q", q), ("k", k), ("v", v)):
            leaves[name] = tensor(x).detach().requires_grad_(True)
        o = F.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], **kw)
        sync(o)
        return o

    def backward(dout: Any, q: Any, k: Any, v: Any, o: Any) -> Any:
        o.backward(tensor(dout))
        sync(o)
        grads = tuple(leaves[nm].grad for nm in "qkv")
        for nm in "qkv":
            leaves[nm].grad = None
        return grads

    return Impl(forward, backward, autograd_forward)


def implementation(c: Any, t: Task, threads: int = 1) -> Impl:
    """The :class:`Impl` of attention task ``t`` (raises :class:`Unavailable` when it cannot run)."""
    if t.impl == "torch":
        return torch_impl(t, threads)
    if t.impl == "dense":
        return dense_impl(t)
    return _mpiattn_impl(c, t)


# ----------------------------------------------------------------- the attention task
def _max(c: Any, value: Any) -> Any:
    return max(c.allgather_obj(value))


def _timed_record(timer: Timer, common: dict, pass_: str, times: list[float], cpus: list[float], flops: float,
                  sent: float, peak: int, est: int, mem: MemoryMeter) -> dict:
    c = timer.comm
    m = Measurement(times, cpus)
    P = common["P"]
    peaks = c.allgather_obj(int(peak))
    return dict(common, **{"pass": pass_}, times_s=times, time_s=m.median, time_min_s=m.best, flops=flops,
                cpu_wall_ratio=timer.cpu_wall_ratio(),
                loadavg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                gflops=flops / m.median / 1e9, gflops_per_rank=flops / m.median / 1e9 / P,
                times_cpu_s=cpus, time_cpu_s=m.cpu_median, gflops_per_rank_cpu=flops / m.cpu_median / 1e9 / P,
                bytes_sent_per_rank=_max(c, float(sent)), peak_bytes=max(peaks), peak_bytes_per_rank=peaks,
                est_bytes=est, memory_kind=mem.kind)


def _warm_up(c: Any, xp: Any, t: Task, impl: Impl) -> None:
    """A small problem in the same process first: code paths, BLAS buffers, MPI connections."""
    P = c.size
    small = t.replace(N=min(t.N, 256 * P), M=min(t.M, 256 * P))
    q, k, v = local_qkv(xp, small, c.rank, P, 7)
    backward = "fwdbwd" in t.passes
    res = (impl.autograd_forward if backward and impl.autograd_forward else impl.forward)(q, k, v)
    if backward:
        impl.backward(local_dout(xp, q, small, c.rank, 7), q, k, v, res)


def attention_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """Time attention task ``t`` on every rank of ``c``; the same records come back on every rank.

    Passes: ``fwd`` (the forward alone; torch without autograd) and
    ``fwdbwd`` (the median forward plus each backward, the backward reusing
    the last forward's ``out, lse``; torch: an autograd forward plus its
    backward per repeat).
    """
    P, rank = c.size, c.rank
    base = dict(t.to_dict(), P=1 if t.single_process else P)
    passes = list(t.passes)

    def skipped(reason: str, **extra: Any) -> list[dict]:
        return [dict(base, **{"pass": p}, status="skipped", reason=reason, **extra) for p in passes]

    if t.single_process and P > 1:
        return skipped(f"{t.impl} is single-process; run it at P=1")
    try:
        impl = implementation(c, t, settings.threads)
    except Unavailable as exc:
        return skipped(str(exc))
    _warm_up(c, xp, t, impl)
    mem.reset()
    timer = Timer(c, xp)
    baseline = _max(c, mem.now())

    est = {p: estimate_bytes(t, P, p) for p in ("fwd", "fwdbwd")}
    limit = settings.max_memory
    over = {p: (f"estimated {(baseline + est[p]) / MiB:.0f} MiB per rank (baseline {baseline / MiB:.0f} + "
                f"{est[p] / MiB:.0f}) > --max-memory {limit / MiB:.0f} MiB")
            for p in passes if limit and baseline + est[p] > limit}
    if len(over) == len(passes):
        return [dict(base, **{"pass": p}, status="skipped", reason=over[p], est_bytes=est[p],
                     baseline_bytes=baseline) for p in passes]

    q, k, v = local_qkv(xp, t, rank, P, settings.seed)
    common = dict(base, baseline_bytes=baseline, shard_bytes=_max(c, shard_bytes(t, P, rank)),
                  shard_bytes_grads=_max(c, shard_bytes(t, P, rank, grads=True)),
                  warmup=t.warmup, repeat=t.repeat, status="ok")
    calls = t.warmup + t.repeat
    records = []
    # phase 1: the forward alone
    sent0 = c.bytes_sent
    fwd = timer.measure(lambda: impl.forward(q, k, v), t.warmup, t.repeat, keep_last=True)
    fwd_sent = (c.bytes_sent - sent0) / calls
    rec = _timed_record(timer, common, "fwd", fwd.times, fwd.cpus, attention_flops(t, "fwd"), fwd_sent,
                        mem.peak(), est["fwd"], mem)
    if "fwd" in passes:
        records.append(rec)
    # phase 2: the backward on the last forward's results
    if "fwdbwd" in passes and "fwdbwd" in over:
        records.append(dict(common, **{"pass": "fwdbwd"}, status="skipped", reason=over["fwdbwd"]))
    elif "fwdbwd" in passes:
        dout = local_dout(xp, q, t, rank, settings.seed)
        sent0 = c.bytes_sent
        extra: dict[str, Any] = {}
        if impl.autograd_forward is not None:
            res = fwd.result = None
            tfg, tb, total, total_cpu = [], [], [], []
            for i in range(calls):
                o = None
                wall_f, cpu_f, o = timer.once(lambda: impl.autograd_forward(q, k, v))
                wall_b, cpu_b, _ = timer.once(lambda: impl.backward(dout, q, k, v, o))
                if i >= t.warmup:
                    tfg.append(wall_f)
                    tb.append(wall_b)
                    total.append(wall_f + wall_b)
                    total_cpu.append(cpu_f + cpu_b)
            extra = dict(times_bwd_s=tb, times_fwd_grad_s=tfg,
                         note="torch fwd+bwd: autograd forward + backward per repeat")
        else:
            res = fwd.result
            bwd = timer.measure(lambda: impl.backward(dout, q, k, v, res), t.warmup, t.repeat)
            total = [fwd.median + b for b in bwd.times]
            total_cpu = [fwd.cpu_median + b for b in bwd.cpus]
            extra = dict(times_bwd_s=bwd.times,
                         note="fwd+bwd = median forward + each backward (backward reuses the forward's out, lse)")
        sent = fwd_sent + (c.bytes_sent - sent0) / calls
        records.append(dict(_timed_record(timer, common, "fwdbwd", total, total_cpu, attention_flops(t, "fwdbwd"),
                                          sent, mem.peak(), est["fwdbwd"], mem), **extra))
    q = k = v = None                # the inputs are freed before the ceilings run
    fwd.result = None
    if impl.used:                  # what mpiattn chose (auto strategy, engine, block size)
        used = {f"{key}_used": impl.used[key] for key in ("strategy", "engine", "block_size") if key in impl.used}
        for r in records:
            r.update(used)
    if t.ceilings:
        records += ceilings.attach(timer, t, records)
    return records


def baseline_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """Resident size after imports, MPI start-up and a tiny ring call with ``t.engine`` (the memory floor)."""
    tiny = Task(impl="ring", engine=t.engine, B=t.B, H=t.H, Hkv=t.Hkv, N=64 * c.size, E=t.E, Ev=t.Ev,
                dtype=t.dtype, layout=t.layout, block=t.block, device=t.device)
    impl = _mpiattn_impl(c, tiny)
    q, k, v = local_qkv(xp, tiny, c.rank, c.size, 1)
    res = impl.forward(q, k, v)
    impl.backward(local_dout(xp, q, tiny, c.rank, 1), q, k, v, res)
    return [dict(t.to_dict(), P=c.size, status="ok", baseline_bytes=_max(c, mem.now()),
                 peak_bytes=_max(c, mem.peak()))]
