"""The library's one dense reference: softmax attention that materialises the scores.

Plain array code on *global* arrays of one process, short enough to trust
(in the spirit of FlashAttention's ``attention_ref``): no online softmax, no
folded heads, no MPI. ``--check`` compares a distributed run with it in
float64; the benchmark times it (in the accumulation dtype) as the
materialising peer. The tests keep a reference of their own.

Conventions (those of :func:`mpiattn.attention`): query head ``h`` uses
key/value head ``h // (H // Hkv)``; the mask rules are
:mod:`mpiattn.masks.spec`'s; a query that sees no key gets ``out = 0``,
``lse = -inf`` and zero gradients.

Math, per batch entry and query head (``s`` the scale)::

    S = s Q K^T (hidden -> -inf);  lse = log sum_j exp S;  P = exp(S - lse)
    O = P V
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dP * P))
    dQ = s dS K;  dK = s dS^T Q
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from ..masks import MaskSpec, visible

__all__ = ["Exact", "dense_attention", "dense_nbytes"]


class Exact(NamedTuple):
    """The results of :func:`dense_attention`, in its compute dtype.

    Attributes
    ----------
    out : (B, H, N, Ev)
    lse : (B, H, N)
    dq, dk, dv : (B, H, N, E), (B, Hkv, M, E), (B, Hkv, M, Ev), or None without ``dout``
    """

    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any


def dense_nbytes(q_shape: tuple, k_shape: tuple, v_shape: tuple, block_rows: int | None = 256,
                 itemsize: int = 8) -> int:
    """Rough peak memory (bytes) of :func:`dense_attention` for global shapes ``q``, ``k``, ``v``.

    Counts the copies of the inputs in the compute dtype (keys and values
    repeated per query head), the outputs with gradients, and a few score
    blocks of ``block_rows`` (None: all ``N``) query rows.
    """
    B, H, N, E = q_shape
    _, hkv, M, Ev = v_shape
    rows = N if block_rows is None else min(N, block_rows)
    words = 3 * B * H * N * (E + Ev) + 3 * B * max(H, hkv) * M * (E + Ev) + 6 * B * H * rows * M
    return itemsize * int(words)


def dense_attention(q: Any, k: Any, v: Any, dout: Any = None, *, mask: MaskSpec | None = None,
                    scale: float | None = None, key_padding_mask: Any = None,
                    segment_ids: Any = None, kv_segment_ids: Any = None, dtype: Any = np.float64,
                    block_rows: int | None = 256) -> Exact:
    """Exact attention (and, with ``dout``, its gradients) on global arrays, one process.

    Parameters
    ----------
    q : array, shape (B, H, N, E)
    k : array, shape (B, Hkv, M, E)
    v : array, shape (B, Hkv, M, Ev)
    dout : array, shape (B, H, N, Ev), optional
        Gradient of the loss with respect to ``out``: the gradients are
        computed too.
    mask : MaskSpec, optional
        The causal and window rules (the presence flags are read from the
        arrays given here); default none.
    scale : float, optional
        Softmax scale ``s``; default ``1/sqrt(E)``.
    key_padding_mask : bool array, shape (B, M), optional
        True marks a key to ignore.
    segment_ids, kv_segment_ids : integer arrays, shapes (B, N), (B, M), optional
        Document ids (the keys take the query ids when ``kv_segment_ids`` is None).
    dtype : dtype
        Compute dtype (float64 for checks; the benchmark passes its
        accumulation dtype).
    block_rows : int or None
        Query rows per materialised score block (bounds memory); None: all
        rows at once.

    Returns
    -------
    Exact
        On the arrays' device (NumPy or CuPy), in ``dtype``.
    """
    xp = backend.array_module(q, k, v)
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    B, H, N, E = q.shape
    hkv, M, Ev = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (B, hkv, M, E) or v.shape[:3] != (B, hkv, M) or H % max(hkv, 1):
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    s = 1.0 / math.sqrt(E) if scale is None else float(scale)
    G = H // hkv if hkv else 1
    kk = k if G == 1 else xp.repeat(k, G, axis=1)
    vv = v if G == 1 else xp.repeat(v, G, axis=1)
    rules = mask if mask is not None else MaskSpec()
    seg_q = None if segment_ids is None else backend.to_host(segment_ids)
    seg_k = seg_q if kv_segment_ids is None else backend.to_host(kv_segment_ids)
    pad = None if key_padding_mask is None else backend.to_host(key_padding_mask)
    grads = dout is not None
    do = dout.astype(dtype, copy=False) if grads else None
    out = xp.zeros((B, H, N, Ev), dtype=dtype)
    lse = xp.full((B, H, N), -np.inf, dtype=dtype)
    dq = xp.zeros_like(q) if grads else None
    dkk = xp.zeros_like(kk) if grads else None
    dvv = xp.zeros_like(vv) if grads else None
    step = N if block_rows is None else max(1, int(block_rows))
    for i0 in range(0, N, max(step, 1)):
        i1 = min(N, i0 + step)
        vis = visible(rules, np.arange(i0, i1), np.arange(M),
                      None if seg_q is None else seg_q[:, i0:i1], seg_k, pad)  # (Bs, r, M)
        hidden = backend.to_device(~vis, xp)[:, None]
        S = xp.matmul(q[:, :, i0:i1], kk.swapaxes(-1, -2))
        S *= s
        S = xp.where(hidden, -np.inf, S)
        mx = S.max(axis=-1, keepdims=True)
        seen = xp.isfinite(mx)
        P = xp.exp(S - xp.where(seen, mx, 0))
        total = P.sum(axis=-1, keepdims=True)
        P /= xp.where(total > 0, total, 1)
        lse[:, :, i0:i1] = xp.where(seen, mx + xp.log(xp.where(total > 0, total, 1)), -np.inf)[..., 0]
        out[:, :, i0:i1] = xp.matmul(P, vv)
        if grads:
            dO = do[:, :, i0:i1]
            dvv += xp.matmul(P.swapaxes(-1, -2), dO)
            dP = xp.matmul(dO, vv.swapaxes(-1, -2))
            dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
            dq[:, :, i0:i1] = s * xp.matmul(dS, kk)
            dkk += s * xp.matmul(dS.swapaxes(-1, -2), q[:, :, i0:i1])
    if grads and G > 1:
        dkk = dkk.reshape(B, hkv, G, M, E).sum(axis=2)
        dvv = dvv.reshape(B, hkv, G, M, Ev).sum(axis=2)
    return Exact(out, lse, dq, dkk, dvv)
