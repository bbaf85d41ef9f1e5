"""Ulysses attention: all-to-all from sequence-sharded to head-sharded and back.

Each rank attends its ``H/P`` heads over the whole sequence with the local
blocked kernels (Jacobs et al. 2023, DeepSpeed-Ulysses). Four all-to-alls of
``n H E``-sized words forward; needs ``H`` and ``Hkv`` divisible by ``P``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend
from ..kernels import engines
from ..comm.core import Comm
from ..layouts import all_segments, local_lengths
from . import masking
from .problem import Problem, Progress, full_mask, report

__all__ = ["ulysses_forward", "ulysses_backward"]


def _seq_to_heads(c: Comm, x: Any, n_total: int, layout: Any) -> Any:
    """``(B, Hx, n_r, F)`` sequence-sharded -> ``(B, Hx/P, n_total, F)`` head-sharded, global order."""
    xp = backend.array_module(x)
    P = c.size
    B, Hx, n, F = x.shape
    hp = Hx // P
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    send = xp.ascontiguousarray(x.reshape(B, P, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(-1, F)
    got = c.alltoallv_rows(send, [B * hp * n] * P, [B * hp * ln for ln in lengths])
    out = xp.empty((B, hp, n_total, F), dtype=x.dtype)
    pos = 0
    for s in range(P):
        block = got[pos:pos + B * hp * lengths[s]].reshape(B, hp, lengths[s], F)
        pos += B * hp * lengths[s]
        local = 0
        for g, ln in segs[s]:
            out[:, :, g:g + ln] = block[:, :, local:local + ln]
            local += ln
    return out


def _heads_to_seq(c: Comm, y: Any, n_total: int, layout: Any) -> Any:
    """Inverse of :func:`_seq_to_heads`: ``(B, Hx/P, N, F)`` -> ``(B, Hx, n_r, F)``."""
    xp = backend.array_module(y)
    P = c.size
    B, hp, _, F = y.shape
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    parts = []
    for d in range(P):
        rows = [y[:, :, g:g + ln] for g, ln in segs[d]]
        blk = xp.concatenate(rows, axis=2) if rows else xp.empty((B, hp, 0, F), dtype=y.dtype)
        parts.append(xp.ascontiguousarray(blk).reshape(-1, F))
    send = xp.concatenate(parts, axis=0) if parts else xp.empty((0, F), dtype=y.dtype)
    n = lengths[c.rank]
    got = c.alltoallv_rows(send, [B * hp * ln for ln in lengths], [B * hp * n] * P)
    return xp.ascontiguousarray(got.reshape(P, B, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(B, P * hp, n, F)


def _ulysses_local(pb: Problem) -> Problem:
    return replace(pb, H=pb.H // pb.P, Hkv=pb.Hkv // pb.P)


def ulysses_forward(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any,
                    progress: Progress) -> tuple[Any, Any]:
    """Forward through head-sharded attention over the whole sequence."""
    qh = _seq_to_heads(c, q, pb.N, pb.layout)
    kh = _seq_to_heads(c, k, pb.M, pb.kv_layout)
    vh = _seq_to_heads(c, v, pb.M, pb.kv_layout)
    bm = masking.block_mask(pb, np.arange(pb.N), np.arange(pb.M),
                            full_mask(c, pb, mask) if pb.masked else None)
    lp = _ulysses_local(pb)
    f = engines.get(pb.engine).forward(qh, lp.Hkv, pb.scale, pb.acc_dtype, pb.Ev, pb.finite)
    f.add(kh, vh, bm, pb.tile)
    report(progress, 1, 1)
    o, lse = f.result()
    o = o.astype(pb.dtype, copy=False)
    return _heads_to_seq(c, o, pb.N, pb.layout), _heads_to_seq(c, lse[..., None], pb.N, pb.layout)[..., 0]


def ulysses_backward(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                     D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    """Gradients through head-sharded attention over the whole sequence."""
    xp = backend.array_module(q)
    qh = _seq_to_heads(c, q, pb.N, pb.layout)
    kh = _seq_to_heads(c, k, pb.M, pb.kv_layout)
    vh = _seq_to_heads(c, v, pb.M, pb.kv_layout)
    doh = _seq_to_heads(c, dout, pb.N, pb.layout)
    stats = _seq_to_heads(c, xp.stack([lse.astype(pb.acc_dtype), D], axis=-1), pb.N, pb.layout)
    oh = _seq_to_heads(c, out, pb.N, pb.layout) if pb.engine == "torch" else None
    bm = masking.block_mask(pb, np.arange(pb.N), np.arange(pb.M),
                            full_mask(c, pb, mask) if pb.masked else None)
    lp = _ulysses_local(pb)
    bwd = engines.get(pb.engine).backward(qh, doh, oh, stats[..., 0], stats[..., 1], lp.Hkv,
                                          pb.scale, pb.acc_dtype)
    dk = xp.zeros(kh.shape, dtype=pb.acc_dtype)
    dv = xp.zeros(vh.shape, dtype=pb.acc_dtype)
    bwd.add(kh, vh, bm, dk, dv, pb.tile)
    report(progress, 1, 1)
    dq = bwd.result()
    return (_heads_to_seq(c, dq, pb.N, pb.layout), _heads_to_seq(c, dk, pb.M, pb.kv_layout),
            _heads_to_seq(c, dv, pb.M, pb.kv_layout))
