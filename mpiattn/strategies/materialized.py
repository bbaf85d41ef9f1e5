"""The thesis' formulation: attention through the distributed products.

``S = s nt(Q, K)``, ``P = softmax(S)``, ``O = nn(P, V)``, and the backward
through the products' closure. Memory ``n M`` scores per head and rank: a
reproduction and a cross-check of the blocked strategies, never chosen by
``auto``. The causal, window and document rules are applied as a dense
mask (:func:`mpiattn.strategies.masking.dense_visible`). The products take
one layout for every operand: when queries and keys are laid out
differently, both are moved to the contiguous layout first (one all-to-all
each way, :func:`mpiattn.sharding.relayout_rows`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend, kernels
from ..comm.core import Comm
from ..layouts import layout_key
from ..products import matmul_nn, matmul_nt, matmul_tn
from ..sharding import relayout_rows
from . import masking
from .problem import Problem, Progress, full_mask, report

__all__ = ["materialized_forward", "materialized_backward"]


def _scores(c: Comm, pb: Problem, q: Any, k: Any, mask: Any) -> Any:
    """``S = s Q K^T`` with masks, shape ``(B, Hkv, G, n_r, M)`` (accumulation dtype)."""
    xp = backend.array_module(q)
    B, _, n, E = q.shape
    q5 = q.astype(pb.acc_dtype).reshape(B, pb.Hkv, pb.G, n, E) * pb.scale
    S = matmul_nt(q5, k.astype(pb.acc_dtype)[:, :, None], c, layout=pb.layout, block_size=pb.block)
    visible = masking.dense_visible(pb, pb.q_pos(), np.arange(pb.M))  # (Bs, n_r, M) or None
    if visible is not None:  # assigned, not added: a hidden NaN score stays hidden
        S = xp.where(backend.to_device(visible, xp)[:, None, None], S, pb.acc_dtype.type(-np.inf))
    if pb.masked:
        full = full_mask(c, pb, mask)
        S += kernels.padding_bias(full, pb.acc_dtype)[:, :, :, None, :]
    return S


def _forward(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any,
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


def _backward(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, lse: Any, mask: Any,
              progress: Progress) -> tuple[Any, Any, Any]:
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


def _mixed(pb: Problem) -> bool:
    return layout_key(pb.layout) != layout_key(pb.kv_layout)


def _moved(c: Comm, pb: Problem, rows: dict[str, Any], back: bool = False) -> dict[str, Any]:
    """Arrays (row axis -2) between the call's layouts and the contiguous one (None passes)."""
    out = {}
    for name, x in rows.items():
        n, lay = (pb.M, pb.kv_layout) if name in ("k", "v", "mask", "dk", "dv") else (pb.N, pb.layout)
        src, dst = ("contiguous", lay) if back else (lay, "contiguous")
        out[name] = None if x is None else relayout_rows(c, x, n, src, dst)
    return out


def materialized_forward(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any,
                         progress: Progress) -> tuple[Any, Any]:
    """Forward through the products: ``out (B, H, n_r, Ev)``, ``lse (B, H, n_r)``."""
    if not _mixed(pb):
        return _forward(c, pb, q, k, v, mask, progress)
    m = _moved(c, pb, {"q": q, "k": k, "v": v, "mask": None if mask is None else mask[:, :, None]})
    mask_c = None if mask is None else m["mask"][..., 0]
    o, lse = _forward(c, replace(pb, layout="contiguous", kv_layout="contiguous"), m["q"], m["k"],
                      m["v"], mask_c, progress)
    back = _moved(c, pb, {"out": o, "lse": lse[..., None]}, back=True)
    return back["out"], back["lse"][..., 0]


def materialized_backward(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, out: Any,
                          lse: Any, D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    """Gradients through the products' closure: ``dq``, ``dk``, ``dv``."""
    if not _mixed(pb):
        return _backward(c, pb, dout, q, k, v, lse, mask, progress)
    m = _moved(c, pb, {"dout": dout, "q": q, "k": k, "v": v, "lse": lse[..., None],
                       "mask": None if mask is None else mask[:, :, None]})
    mask_c = None if mask is None else m["mask"][..., 0]
    dq, dk, dv = _backward(c, replace(pb, layout="contiguous", kv_layout="contiguous"), m["dout"],
                           m["q"], m["k"], m["v"], m["lse"][..., 0], mask_c, progress)
    back = _moved(c, pb, {"dq": dq, "dk": dk, "dv": dv}, back=True)
    return back["dq"], back["dk"], back["dv"]
