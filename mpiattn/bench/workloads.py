"""Attention workloads: mpiattn's strategies and engines beside a dense and a torch peer.

Implementations of an ``attention`` :class:`~mpiattn.bench.tasks.Task`:

* an mpiattn strategy (any name of :data:`mpiattn.strategies.registry.NAMES`)
  through :func:`mpiattn.strategies.attention` and
  :func:`~mpiattn.strategies.attention_backward`, with the task's
  :class:`~mpiattn.strategies.spec.Options`;
* ``dense``: the library's dense reference,
  :func:`mpiattn.kernels.reference.dense_attention`, on one process with
  every row at once (the ``(B, H, N, M)`` scores materialised) in the
  accumulation dtype: what one writes without mpiattn;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the
  same memory (``torch.from_numpy``; DLPack for CuPy).

:func:`attention_task` times them with the package's one timer
(:class:`mpiattn.timing.Timer`) and returns JSON-ready records: times (every
repeat and the median, wall and CPU), nominal FLOPs, bytes sent per rank
(:attr:`mpiattn.comm.Comm.bytes_sent` before and after) beside the
strategy's cost model, peak memory beside its memory model, what the
library chose, the seconds spent making the inputs (``inputs_s``), and
optionally the GEMM ceilings.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import backend
from ..io import datagen
from ..kernels import engines
from ..kernels.reference import dense_attention
from ..layouts import segments
from ..strategies.model import predict
from ..timing import Measurement, Timer
from . import ceilings
from .memory import MemoryMeter, estimate_bytes, machine_for, plan_call, shard_bytes
from .tasks import DENSE, PASSES, SDPA, MiB, Settings, Task, attention_flops

__all__ = ["Impl", "Unavailable", "implementation", "torch_impl", "local_rows", "attention_task",
           "baseline_task"]


class Unavailable(Exception):
    """This implementation cannot run here (its records say ``skipped`` and why)."""


@dataclass
class Impl:
    """One attention implementation on this rank's ``q (B, H, n, E)``, ``k, v (B, Hkv, m, E/Ev)``.

    Attributes
    ----------
    forward : callable(q, k, v) -> result
        The forward pass (``result`` is what ``backward`` needs).
    backward : callable(dout, q, k, v, result) -> (dq, dk, dv), optional
        A backward reusing the forward's result (mpiattn: its ``out, lse``).
    both : callable(dout, q, k, v) -> object, optional
        Forward and backward in one call (the peers: torch's autograd, the
        dense reference with ``dout``); used when there is no ``backward``.
    used : dict
        What the last mpiattn call used (``details=``: strategy, engine, block size).
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    both: Callable[..., Any] | None = None
    used: dict | None = None

    def forward_backward(self, dout: Any, q: Any, k: Any, v: Any) -> Any:
        """Forward and backward, one after the other."""
        if self.both is not None:
            return self.both(dout, q, k, v)
        return self.backward(dout, q, k, v, self.forward(q, k, v))


def _mpiattn_impl(c: Any, t: Task) -> Impl:
    from .. import strategies

    options = t.options()
    used: dict = {}

    def forward(q: Any, k: Any, v: Any) -> Any:
        return strategies.attention(q, k, v, c, options=options, details=used)

    def backward(dout: Any, q: Any, k: Any, v: Any, res: Any) -> Any:
        return strategies.attention_backward(dout, q, k, v, res[0], res[1], c, options=options)

    return Impl(forward, backward, used=used)


def _dense_impl(t: Task) -> Impl:
    spec = t.spec()

    def call(dout: Any, q: Any, k: Any, v: Any) -> Any:
        return dense_attention(q, k, v, dout, mask=spec.mask, scale=spec.scale, dtype=spec.acc_dtype,
                               block_rows=None)

    return Impl(lambda q, k, v: call(None, q, k, v), both=call)


def torch_impl(t: Task, threads: int = 1) -> Impl:
    """``scaled_dot_product_attention`` on the same memory (raises :class:`Unavailable` without torch).

    ``forward`` runs under ``no_grad``; ``both`` is an autograd forward and
    its backward, returning the gradients ``(dq, dk, dv)`` as tensors.
    """
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:
        raise Unavailable(f"torch not importable: {exc}") from None

    torch.set_num_threads(max(1, int(threads)))
    kw: dict[str, Any] = dict(is_causal=t.causal)
    if t.H != t.Hkv:
        kw["enable_gqa"] = True  # (a keyword older torch lacks)

    def tensor(x: Any) -> Any:
        return torch.from_dlpack(x) if backend.is_cupy_array(x) else torch.from_numpy(x)

    def sync(x: Any) -> Any:
        if x.is_cuda:
            torch.cuda.synchronize()
        return x

    def forward(q: Any, k: Any, v: Any) -> Any:
        with torch.no_grad():
            return sync(F.scaled_dot_product_attention(tensor(q), tensor(k), tensor(v), **kw))

    def both(dout: Any, q: Any, k: Any, v: Any) -> Any:
        leaves = [tensor(x).detach().requires_grad_(True) for x in (q, k, v)]
        sync(F.scaled_dot_product_attention(*leaves, **kw)).backward(tensor(dout))
        return tuple(sync(x.grad) for x in leaves)

    return Impl(forward, both=both)


def implementation(c: Any, t: Task, threads: int = 1) -> Impl:
    """The :class:`Impl` of attention task ``t`` (raises :class:`Unavailable` when it cannot run)."""
    if t.impl == SDPA:
        return torch_impl(t, threads)
    if t.impl == DENSE:
        return _dense_impl(t)
    return _mpiattn_impl(c, t)


# ----------------------------------------------------------------- the attention task
def _max(c: Any, value: Any) -> Any:
    return max(c.allgather_obj(value))


def local_rows(xp: Any, t: Task, rank: int, P: int, seed: int, *names: str) -> list:
    """This rank's rows of ``names`` (of ``q``, ``k``, ``v``, ``dout``) of task ``t`` (a peer: all of them),
    by :mod:`mpiattn.io.datagen` (the same numbers whatever ``P``; no rank draws another's rows)."""
    spec = datagen.Spec(batch=t.B, heads=t.H, kv_heads=t.Hkv, seq=t.N, kv_seq=t.M, dim=t.E, value_dim=t.Ev,
                        dtype=t.dtype, with_dout=True, seed=seed)
    rank, P = (0, 1) if t.single_process else (rank, P)
    return [backend.to_device(datagen.local_rows(spec, name, segments(t.M if name in "kv" else t.N, rank, P,
                                                                      t.layout)), xp) for name in names]


def _timed_record(timer: Timer, common: dict, pass_: str, m: Measurement, flops: float, sent: float,
                  peak: int, est: int, mem: MemoryMeter, **extra: Any) -> dict:
    c, P = timer.comm, common["P"]
    peaks = c.allgather_obj(int(peak))
    return dict(common, **{"pass": pass_}, times_s=m.times, time_s=m.median, time_min_s=m.best, flops=flops,
                cpu_wall_ratio=timer.cpu_wall_ratio(),
                loadavg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                gflops=flops / m.median / 1e9, gflops_per_rank=flops / m.median / 1e9 / P,
                times_cpu_s=m.cpus, time_cpu_s=m.cpu_median, gflops_per_rank_cpu=flops / m.cpu_median / 1e9 / P,
                bytes_sent_per_rank=_max(c, float(sent)), peak_bytes=max(peaks), peak_bytes_per_rank=peaks,
                est_bytes=est, memory_kind=mem.kind, **extra)


def _warm_up(c: Any, xp: Any, t: Task, impl: Impl) -> None:
    """A small problem in the same process first: code paths, BLAS buffers, MPI connections."""
    small = t.replace(N=min(t.N, 256 * c.size), M=min(t.M, 256 * c.size))
    q, k, v, dout = local_rows(xp, small, c.rank, c.size, 7, "q", "k", "v", "dout")
    if "fwdbwd" in t.passes:
        impl.forward_backward(dout, q, k, v)
    else:
        impl.forward(q, k, v)


def _model(t: Task, c: Any) -> dict:
    """The library's models of the call: estimated bytes per pass (``est``) and, per pass, the
    cost model's prediction on the Comm's topology (``model``: seconds, bytes sent in all and
    between nodes by the busiest rank; :mod:`mpiattn.strategies.model`)."""
    P = 1 if t.single_process else c.size
    est = {p: estimate_bytes(t, P, p) for p in PASSES}
    if t.single_process:
        return dict(est=est)
    strategy, block = plan_call(t, P, c.topology)
    spec, machine = t.spec(), machine_for(t)
    pred = predict(strategy, spec, c.topology, block, machine)
    fwd = [strategy.traffic(spec, c.topology, block, backward=False)]
    both = fwd + [strategy.traffic(spec, c.topology, block, backward=True)]
    sums = {p: (sum(x.inside + x.between for ph in phs for x in ph), sum(x.between for ph in phs for x in ph))
            for p, phs in (("fwd", fwd), ("fwdbwd", both))}
    model = {p: dict(model_s=pred.forward_s if p == "fwd" else pred.fwdbwd_s, model_bytes_sent=sums[p][0],
                     model_bytes_between=sums[p][1], model_machine=machine.name) for p in PASSES}
    return dict(est=est, model=model)


def _engine_refusal(t: Task) -> str | None:
    """Why the task's engine cannot run here (None: it can), as the library will find it on this rank."""
    name, why = engines.local_choice(t.options().engine, t.spec())
    return None if name else why


def attention_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """Time attention task ``t`` on every rank of ``c``; the same records come back on every rank.

    Passes: ``fwd`` (the forward alone; torch without autograd) and
    ``fwdbwd``: for mpiattn the median forward plus each backward (the
    backward reusing the last forward's ``out, lse``), for the peers one
    call doing both per repeat.
    """
    P, rank = c.size, c.rank
    base = dict(t.to_dict(), P=1 if t.single_process else P)
    passes = list(t.passes)

    def skipped(reason: str, **extra: Any) -> list[dict]:
        return [dict(base, **{"pass": p}, status="skipped", reason=reason, **extra) for p in passes]

    if t.single_process and P > 1:
        return skipped(f"{t.impl} is single-process; run it at P=1")
    try:
        model = _model(t, c)  # ValueError: the strategy refuses the call (global sizes: alike everywhere)
        impl = implementation(c, t, settings.threads)
    except (ValueError, Unavailable) as exc:
        return skipped(str(exc))
    why = next(filter(None, c.allgather_obj(None if t.single_process else _engine_refusal(t))), None)
    if why is not None:
        return skipped(why)
    _warm_up(c, xp, t, impl)
    mem.reset()
    timer = Timer(c, xp)
    baseline = _max(c, mem.now())
    est, per_pass = model.pop("est"), model.pop("model", {})
    limit = settings.max_memory
    over = {p: (f"estimated {(baseline + est[p]) / MiB:.0f} MiB per rank (baseline {baseline / MiB:.0f} + "
                f"{est[p] / MiB:.0f}) > --max-memory {limit / MiB:.0f} MiB")
            for p in passes if limit and baseline + est[p] > limit}
    if len(over) == len(passes):
        return [dict(base, **{"pass": p}, status="skipped", reason=over[p], est_bytes=est[p],
                     baseline_bytes=baseline) for p in passes]

    t0 = time.perf_counter()
    q, k, v = local_rows(xp, t, rank, P, settings.seed, "q", "k", "v")
    inputs_s = time.perf_counter() - t0
    common = dict(base, baseline_bytes=baseline, shard_bytes=_max(c, shard_bytes(t, P, rank)),
                  shard_bytes_grads=_max(c, shard_bytes(t, P, rank, grads=True)), status="ok", **model)
    calls = t.warmup + t.repeat
    records = []
    sent0, between0 = c.bytes_sent, c.bytes_between
    fwd = timer.measure(lambda: impl.forward(q, k, v), t.warmup, t.repeat, keep_last=impl.backward is not None)
    fwd_sent = (c.bytes_sent - sent0) / calls
    fwd_between = (c.bytes_between - between0) / calls
    if "fwd" in passes:
        records.append(_timed_record(timer, common, "fwd", fwd, attention_flops(t, "fwd"), fwd_sent,
                                     mem.peak(), est["fwd"], mem, bytes_between_per_rank=_max(c, fwd_between),
                                     **per_pass.get("fwd", {})))
    if "fwdbwd" in over:
        records.append(dict(common, **{"pass": "fwdbwd"}, status="skipped", reason=over["fwdbwd"]))
    elif "fwdbwd" in passes:
        t0 = time.perf_counter()
        (dout,) = local_rows(xp, t, rank, P, settings.seed, "dout")
        inputs_s += time.perf_counter() - t0
        sent0, between0 = c.bytes_sent, c.bytes_between
        if impl.backward is not None:
            res = fwd.result
            bwd = timer.measure(lambda: impl.backward(dout, q, k, v, res), t.warmup, t.repeat)
            both = Measurement([fwd.median + b for b in bwd.times], [fwd.cpu_median + b for b in bwd.cpus])
            extra = dict(times_bwd_s=bwd.times, note="fwd+bwd = median forward + each backward (backward "
                                                     "reuses the forward's out, lse)")
            sent = fwd_sent + (c.bytes_sent - sent0) / calls
            between = fwd_between + (c.bytes_between - between0) / calls
        else:
            both = timer.measure(lambda: impl.forward_backward(dout, q, k, v), t.warmup, t.repeat)
            extra = dict(note="fwd+bwd: one call computing the output and the gradients per repeat")
            sent = (c.bytes_sent - sent0) / calls
            between = (c.bytes_between - between0) / calls
        records.append(_timed_record(timer, common, "fwdbwd", both, attention_flops(t, "fwdbwd"), sent,
                                     mem.peak(), est["fwdbwd"], mem, bytes_between_per_rank=_max(c, between),
                                     **per_pass.get("fwdbwd", {}), **extra))
    q = k = v = fwd.result = None  # the inputs are freed before the ceilings run
    used = {f"{key}_used": value for key, value in (impl.used or {}).items()
            if key in ("strategy", "engine", "block_size")}
    inputs_s = _max(c, inputs_s)
    for r in records:
        r.update(used, inputs_s=inputs_s)
    if t.ceilings:
        records += ceilings.attach(timer, t, records)
    return records


def baseline_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """Resident size after imports, MPI start-up and a tiny call with ``t.engine`` (the memory floor)."""
    tiny = Task(engine=t.engine, B=t.B, H=t.H, Hkv=t.Hkv, N=64 * c.size, E=t.E, Ev=t.Ev, dtype=t.dtype,
                layout=t.layout, block=t.block, device=t.device)
    q, k, v, dout = local_rows(xp, tiny, c.rank, c.size, 1, "q", "k", "v", "dout")
    _mpiattn_impl(c, tiny).forward_backward(dout, q, k, v)
    return [dict(t.to_dict(), P=c.size, status="ok", baseline_bytes=_max(c, mem.now()),
                 peak_bytes=_max(c, mem.peak()))]
