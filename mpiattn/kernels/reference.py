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

Math, per batch entry and query head (``s`` the scale; the modifiers of
:mod:`mpiattn.masks.modifiers` and :mod:`mpiattn.masks.sinks`)::

    X = s Q K^T;  S = c tanh(X / c) (softcap) - slope |i + d - j| (ALiBi) + mask (float)
    S -> -inf where hidden (the rules, a bool mask, mask_mod, -inf in a float mask)
    lse = log(exp(sink) + sum_j exp S);  P = exp(S - lse);  O = P V
    dV = P^T dO;  dP = dO V^T;  D = rowsum(dP * P);  dS = P * (dP - D) * (1 - tanh^2)
    dQ = s dS K;  dK = s dS^T Q;  dsink = -sum_i exp(sink - lse) D
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

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
    dsinks : (H,) or None
        With ``sinks`` and ``dout``.
    max_logit : (H,) float64 host array
        The largest ``s q . k`` of a visible pair per head (``-inf``: none).
    """

    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any
    dsinks: Any = None
    max_logit: Any = None


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
                    block_rows: int | None = 256, softcap: float | None = None,
                    alibi_slopes: Any = None, attn_mask: Any = None, mask_mod: Any = None,
                    sinks: Any = None, score_mod: Any = None,
                    progress: Callable[[int, int], None] | None = None) -> Exact:
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
    softcap, alibi_slopes, mask_mod, sinks : optional
        As in :func:`mpiattn.attention`.
    score_mod : ScoreMod, optional
        As in :func:`mpiattn.attention`: its ``fn`` and ``grad`` on the dense scores (every key of
        a block of rows at once).
    attn_mask : array, shape (B or 1, H or 1, N, M), optional
        The whole mask (every query row), bool or float.
    progress : callable, optional
        Called as ``progress(rows_done, N)`` after each block of rows.

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
    d = rules.diagonal
    slopes = None if alibi_slopes is None else backend.to_host(alibi_slopes).astype(np.float64).reshape(-1, H)
    sink = None if sinks is None else xp.asarray(backend.to_host(sinks).astype(dtype))[None, :, None, None]
    top = np.full(H, -np.inf)
    dsinks = xp.zeros(H, dtype=dtype) if grads and sink is not None else None
    whole_mask = None if attn_mask is None else backend.to_host(attn_mask)
    step = N if block_rows is None else max(1, int(block_rows))
    for i0 in range(0, N, max(step, 1)):
        i1 = min(N, i0 + step)
        rows = np.arange(i0, i1)
        vis = visible(rules, rows, np.arange(M), None if seg_q is None else seg_q[:, i0:i1], seg_k,
                      pad)[:, None]  # (Bs, 1, r, M)
        add = None
        if slopes is not None:
            add = -slopes[:, :, None, None] * np.abs(rows[:, None] + d - np.arange(M)[None, :])
        if whole_mask is not None:
            part = whole_mask[:, :, i0:i1]
            if part.dtype == np.bool_:
                vis = vis & part
            else:
                kept = part > -np.inf
                vis = vis & kept
                part = np.where(kept, part, 0.0)
                add = part if add is None else add + part
        if mask_mod is not None:
            b, h, i, j = np.ix_(np.arange(B), np.arange(H), rows, np.arange(M))
            vis = vis & np.asarray(mask_mod(b, h, i, j))
        hidden = backend.to_device(~vis, xp)
        X = xp.matmul(q[:, :, i0:i1], kk.swapaxes(-1, -2))
        X *= s
        top = np.maximum(top, backend.to_host(xp.where(hidden, -np.inf, X).max(axis=(0, 2, 3))))
        T = None if softcap is None else xp.tanh(X / softcap)
        S = X if T is None else softcap * T
        idx = None
        if score_mod is not None:  # its function and derivative on the whole rows, written out here
            idx = [backend.to_device(a, xp) for a in np.ix_(np.arange(B), np.arange(H), rows, np.arange(M))]
            S = score_mod.fn(X, *idx)
        if add is not None:
            S = S + backend.to_device(add.astype(dtype), xp)
        S = xp.where(hidden, -np.inf, S)
        mx = S.max(axis=-1, keepdims=True)
        if sink is not None:
            mx = xp.maximum(mx, sink)
        seen = xp.isfinite(mx)
        P = xp.exp(S - xp.where(seen, mx, 0))
        total = P.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + xp.exp(sink - mx)
        P /= xp.where(total > 0, total, 1)
        lse[:, :, i0:i1] = xp.where(seen, mx + xp.log(xp.where(total > 0, total, 1)), -np.inf)[..., 0]
        out[:, :, i0:i1] = xp.matmul(P, vv)
        if grads:
            dO = do[:, :, i0:i1]
            dvv += xp.matmul(P.swapaxes(-1, -2), dO)
            dP = xp.matmul(dO, vv.swapaxes(-1, -2))
            D = (dP * P).sum(axis=-1, keepdims=True)
            dS = P * (dP - D)
            if T is not None:
                dS *= 1 - T * T
            if idx is not None:
                dS *= score_mod.grad(X, *idx)
            dq[:, :, i0:i1] = s * xp.matmul(dS, kk)
            dkk += s * xp.matmul(dS.swapaxes(-1, -2), q[:, :, i0:i1])
            if dsinks is not None:
                dsinks -= (xp.exp(sink - lse[:, :, i0:i1, None]) * D).sum(axis=(0, 2, 3))
        if progress is not None:
            progress(i1, N)
    if grads and G > 1:
        dkk = dkk.reshape(B, hkv, G, M, E).sum(axis=2)
        dvv = dvv.reshape(B, hkv, G, M, Ev).sum(axis=2)
    return Exact(out, lse, dq, dkk, dvv, dsinks, top)
