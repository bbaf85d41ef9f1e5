"""The thesis' formulation: attention through the distributed products.

``S = s nt(Q, K)``, ``P = softmax(S)``, ``O = nn(P, V)``, and the backward
through the products' closure. Memory ``n M`` scores per head and rank: a
reproduction and a cross-check of the blocked strategies, never chosen by
``auto``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend, kernels
from ..comm.core import Comm
from ..products import matmul_nn, matmul_nt, matmul_tn
from .problem import Problem, Progress, full_mask, report

__all__ = ["materialized_forward", "materialized_backward"]


def _scores(c: Comm, pb: Problem, q: Any, k: Any, mask: Any) -> Any:
    """``S = s Q K^T`` with masks, shape ``(B, Hkv, G, n_r, M)`` (accumulation dtype)."""
    xp = backend.array_module(q)
    B, _, n, E = q.shape
    q5 = q.astype(pb.acc_dtype).reshape(B, pb.Hkv, pb.G, n, E) * pb.scale
    S = matmul_nt(q5, k.astype(pb.acc_dtype)[:, :, None], c, layout=pb.layout, block_size=pb.block)
    if pb.causal:
        hidden = np.arange(pb.M)[None, :] > pb.q_pos()[:, None]
        S[..., backend.to_device(hidden, xp)] = -np.inf
    if pb.masked:
        full = full_mask(c, pb, mask)
        S += kernels.padding_bias(full, pb.acc_dtype)[:, :, :, None, :]
    return S


def materialized_forward(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any,
                          progress: Progress) -> tuple[Any, Any]:
    xp = backend.array_module(q)
    S = _scores(c, pb, q, k, mask)
    m = S.max(axis=-1) if S.shape[-1] else xp.full(S.shape[:-1], -np.inf, dtype=pb.acc_dtype)
    shift = xp.where(xp.isneginf(m), pb.acc_dtype.type(0), m)
    Pm = xp.exp(S - shift[..., None])
    l = Pm.sum(axis=-1)
    seen = l > 0
    Pm /= xp.where(seen, l, pb.acc_dtype.type(1))[..., None]
    o = matmul_nn(Pm, v.astype(pb.acc_dtype)[:, :, None], c, layout=pb.layout, block_size=pb.block)
    lse = xp.where(seen, shift + xp.log(xp.where(seen, l, pb.acc_dtype.type(1))), pb.acc_dtype.type(-np.inf))
    report(progress, 1, 1)
    B, _, n, _ = q.shape
    return o.reshape(B, pb.H, n, pb.Ev), lse.reshape(B, pb.H, n)


def materialized_backward(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, lse: Any,
                           D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    xp = backend.array_module(q)
    B, _, n, E = q.shape
    kw = dict(layout=pb.layout, block_size=pb.block)
    S = _scores(c, pb, q, k, mask)
    lse5 = lse.astype(pb.acc_dtype).reshape(B, pb.Hkv, pb.G, n)
    lse5 = xp.where(xp.isneginf(lse5), pb.acc_dtype.type(np.inf), lse5)
    Pm = xp.exp(S - lse5[..., None])
    do5 = dout.astype(pb.acc_dtype).reshape(B, pb.Hkv, pb.G, n, pb.Ev)
    v5 = v.astype(pb.acc_dtype)[:, :, None]
    k5 = k.astype(pb.acc_dtype)[:, :, None]
    q5 = q.astype(pb.acc_dtype).reshape(B, pb.Hkv, pb.G, n, E)
    dv = matmul_tn(Pm, do5, c, **kw).sum(axis=2)
    dP = matmul_nt(do5, v5, c, **kw)
    dS = Pm * (dP - (dP * Pm).sum(axis=-1, keepdims=True))  # rowsum(dP * P) = D
    dq = pb.scale * matmul_nn(dS, k5, c, **kw)
    dk = pb.scale * matmul_tn(dS, q5, c, **kw).sum(axis=2)
    report(progress, 1, 1)
    return dq.reshape(B, pb.H, n, E), dk, dv


