"""Local blocked attention kernels: online-softmax forward, lse-based backward.

These run on one rank, on NumPy or CuPy arrays, and know nothing of MPI. The
distributed drivers in :mod:`mpiattn.strategies` feed them key/value blocks
(from the ring, a gather or an all-to-all) with their *global* row indices.

Row layout
----------
Queries are kept "folded": ``q`` of shape ``(B, H, n, E)`` with
``H = G * Hkv`` query heads per key/value head becomes ``qs`` of shape
``(B, Hkv, n*G, E)``, row ``i*G + g`` holding query position ``i`` of query
head ``kv*G + g`` (torch's ``repeat_interleave`` convention), multiplied by the
softmax scale ``s`` and cast to the accumulation dtype. One GEMM then serves
all ``G`` query heads of a key/value head, and blocks of consecutive rows are
blocks of consecutive query positions (what causal skipping needs).

Math (per query block, over key blocks ``c``; Milakov & Gimelshein 2018,
Dao et al. 2022/2023)::

    S   = qs K_c^T  (+ mask: causal j > i, padding -> -inf)
    m'  = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
    l   = a l + rowsum P;    O = a O + P V_c;  m = m'
    end: O = O / l;  lse = m + log l      (no visible key: O = 0, lse = -inf)

Backward, recomputing ``P`` from ``lse``::

    D = rowsum(dO * O);  P = exp(qs K_c^T - lse)
    dV_c += P^T dO;  dP = dO V_c^T;  dS = P * (dP - D)
    dQ += s dS K_c;  dK_c += dS^T qs

(``qs`` already carries ``s``, so ``dK_c`` needs no extra factor and ``dQ``
is multiplied by ``s`` once at the end.)

On CuPy with ``MPIATTN_FUSED_KERNELS=1`` the elementwise steps run as fused
kernels from :mod:`mpiattn.gpu_kernels` (same arithmetic, fewer passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import backend
from . import gpu_kernels as gk

__all__ = ["fold_queries", "unfold_rows", "Workspace", "ForwardState", "forward_block", "finalize",
           "backward_block", "padding_bias", "DEFAULT_TILE"]

#: Default tile edge (rows of queries x rows of keys) for the score block.
DEFAULT_TILE = 512


def fold_queries(q: Any, hkv: int, scale: float | None, dtype: Any) -> Any:
    """``(B, H, n, F)`` -> ``(B, Hkv, n*G, F)`` in ``dtype``, times ``scale`` if given."""
    xp = backend.array_module(q)
    B, H, n, F = q.shape
    G = H // hkv
    out = xp.empty((B, hkv, n, G, F), dtype=dtype)
    out[...] = q.reshape(B, hkv, G, n, F).transpose(0, 1, 3, 2, 4)
    if scale is not None:
        out *= scale
    return out.reshape(B, hkv, n * G, F)


def unfold_rows(x: Any, h: int) -> Any:
    """Inverse of :func:`fold_queries` for ``(B, Hkv, n*G, ...)`` -> ``(B, H, n, ...)`` (a copy)."""
    xp = backend.array_module(x)
    B, hkv, nG = x.shape[:3]
    rest = x.shape[3:]
    G = h // hkv
    n = nG // G if G else 0
    y = x.reshape((B, hkv, n, G) + rest)
    y = xp.moveaxis(y, 3, 2)
    return xp.ascontiguousarray(y).reshape((B, h, n) + rest)


def padding_bias(pad: Any, dtype: Any) -> Any:
    """``(B, k)`` bool padding (True = ignore) -> additive bias ``(B, 1, 1, k)``: 0 or -inf."""
    xp = backend.array_module(pad)
    bias = xp.zeros(pad.shape, dtype=dtype)
    bias[pad] = -np.inf
    return bias[:, None, None, :]


class Workspace:
    """Reusable scratch buffers, so the tile loop allocates nothing.

    ``get(name, shape, dtype)`` returns a C-contiguous array of ``shape``
    carved from a grow-only flat buffer kept under ``name`` (its contents are
    whatever was there before).
    """

    def __init__(self, xp: Any):
        self.xp = xp
        self._bufs: dict[str, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        size = int(np.prod(shape, dtype=np.int64))
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.xp.empty(max(size, 1), dtype=dtype)
            self._bufs[name] = buf
        return buf[:size].reshape(shape)


@dataclass
class ForwardState:
    """Running statistics of the online softmax for folded queries.

    Attributes
    ----------
    m : (B, Hkv, n*G) running row maximum (-inf before any visible key)
    l : (B, Hkv, n*G) running sum of ``exp(S - m)``
    o : (B, Hkv, n*G, Ev) running ``sum exp(S - m) V`` (unnormalised)
    ws : Workspace for the score tiles
    """

    m: Any
    l: Any
    o: Any
    ws: Workspace

    @classmethod
    def empty(cls, qs: Any, ev: int) -> "ForwardState":
        xp = backend.array_module(qs)
        lead = qs.shape[:-1]
        return cls(xp.full(lead, -np.inf, dtype=qs.dtype), xp.zeros(lead, dtype=qs.dtype),
                   xp.zeros(lead + (ev,), dtype=qs.dtype), Workspace(xp))


def _visibility(q_rows: np.ndarray, k_idx: np.ndarray, causal: bool) -> str:
    """'none', 'all' or 'some' keys of the block visible to the query block (causal only)."""
    if not causal or q_rows.size == 0 or k_idx.size == 0:
        return "all"
    if q_rows.max() < k_idx.min():
        return "none"
    if q_rows.min() >= k_idx.max():
        return "all"
    return "some"


def _causal_bias(xp: Any, q_rows: np.ndarray, k_idx: np.ndarray, dtype: Any) -> Any:
    hidden = k_idx[None, :] > q_rows[:, None]
    bias = np.zeros(hidden.shape, dtype=dtype)
    bias[hidden] = -np.inf
    return backend.to_device(bias, xp)


def _tiles(n: int, t: int) -> range:
    return range(0, n, max(1, t))


def forward_block(st: ForwardState, qs: Any, q_pos: np.ndarray, group: int,
                  k: Any, v: Any, k_idx: np.ndarray, bias: Any = None,
                  causal: bool = False, tile: int = DEFAULT_TILE) -> None:
    """Fold one block of keys/values into the running state (in place).

    Parameters
    ----------
    st : ForwardState
        Running statistics for ``qs``.
    qs : (B, Hkv, n*G, E)
        Folded, scaled queries (accumulation dtype).
    q_pos : (n,) int
        Global positions of the queries (any order).
    group : int
        ``G = H // Hkv``.
    k, v : (B, Hkv, k, E), (B, Hkv, k, Ev)
        Key/value block (any float dtype; cast to ``qs.dtype`` per tile).
    k_idx : (k,) int
        Global positions of the keys (any order).
    bias : (B, 1, 1, k) or None
        Additive padding bias from :func:`padding_bias`.
    causal : bool
        Hide key ``j`` from query ``i`` when ``j > i``.
    tile : int
        Edge of the score tile: at most ``tile*G x tile`` scores per (B, Hkv) at once.

    Notes
    -----
    FLOPs: ``4 * B * H * n * k * E`` (E = Ev) for visible tiles; memory: one
    score tile of ``B * Hkv * tile*G * tile`` accumulation words.
    """
    xp = backend.array_module(qs)
    dt = qs.dtype
    n = q_pos.size
    lead = qs.shape[:2]
    ws = st.ws
    fused = gk.use_fused(xp)
    for k0 in _tiles(k_idx.size, tile):
        k1 = min(k0 + tile, k_idx.size)
        kc = xp.ascontiguousarray(k[..., k0:k1, :], dtype=dt)
        vc = xp.ascontiguousarray(v[..., k0:k1, :], dtype=dt)
        kT = kc.swapaxes(-1, -2)
        kb = None if bias is None else bias[..., k0:k1]
        for i0 in _tiles(n, tile):
            i1 = min(i0 + tile, n)
            vis = _visibility(q_pos[i0:i1], k_idx[k0:k1], causal)
            if vis == "none":
                continue
            r0, r1 = i0 * group, i1 * group
            rows = lead + (r1 - r0,)
            S = xp.matmul(qs[..., r0:r1, :], kT, out=ws.get("S", rows + (k1 - k0,), dt))
            if kb is not None:
                S += kb
            if vis == "some":
                S += _causal_bias(xp, np.repeat(q_pos[i0:i1], group), k_idx[k0:k1], dt)
            if fused:
                alpha = gk.softmax_step_(S, st.m[..., r0:r1], st.l[..., r0:r1])
                gk.rescale_add_(st.o[..., r0:r1, :], alpha,
                                xp.matmul(S, vc, out=ws.get("pv", rows + (vc.shape[-1],), dt)))
                continue
            m_old = st.m[..., r0:r1]
            m_new = S.max(axis=-1, out=ws.get("m_new", rows, dt))
            xp.maximum(m_new, m_old, out=m_new)
            shift = ws.get("shift", rows, dt)
            shift[...] = m_new
            shift[xp.isneginf(m_new)] = 0  # no visible key yet: exp(-inf - 0) = 0
            S -= shift[..., None]
            xp.exp(S, out=S)
            alpha = ws.get("alpha", rows, dt)
            xp.subtract(m_old, shift, out=alpha)
            xp.exp(alpha, out=alpha)
            l = st.l[..., r0:r1]
            l *= alpha
            l += S.sum(axis=-1, out=ws.get("rowsum", rows, dt))
            o = st.o[..., r0:r1, :]
            o *= alpha[..., None]
            o += xp.matmul(S, vc, out=ws.get("pv", rows + (vc.shape[-1],), dt))
            m_old[...] = m_new


def finalize(st: ForwardState) -> tuple[Any, Any]:
    """Normalise: ``O / l`` and ``lse = m + log l``; rows that saw no key get 0 and -inf."""
    xp = backend.array_module(st.o)
    seen = st.l > 0
    l_safe = xp.where(seen, st.l, st.l.dtype.type(1))
    o = st.o / l_safe[..., None]
    lse = xp.where(seen, st.m + xp.log(l_safe), st.l.dtype.type(-np.inf))
    return o, lse


def backward_block(qs: Any, do: Any, lse: Any, D: Any, q_pos: np.ndarray, group: int,
                   k: Any, v: Any, k_idx: np.ndarray, dq: Any, dk: Any, dv: Any,
                   bias: Any = None, causal: bool = False, tile: int = DEFAULT_TILE,
                   ws: Workspace | None = None) -> None:
    """Accumulate the gradients of one key/value block (in place).

    Parameters
    ----------
    qs : (B, Hkv, n*G, E)
        Folded, scaled queries.
    do : (B, Hkv, n*G, Ev)
        Folded output gradient (accumulation dtype).
    lse : (B, Hkv, n*G)
        Folded log-sum-exp from the forward pass, with ``+inf`` in rows that
        saw no key (so that their probabilities are exactly zero).
    D : (B, Hkv, n*G)
        ``rowsum(dO * O)``.
    q_pos, group, k, v, k_idx, bias, causal, tile
        As in :func:`forward_block`.
    dq : (B, Hkv, n*G, E)
        Accumulates ``dS K`` (multiply by the scale once at the end).
    dk, dv : (B, Hkv, k, E), (B, Hkv, k, Ev)
        Accumulate ``dS^T qs`` and ``P^T dO`` for this block.
    ws : Workspace, optional
        Scratch buffers to reuse across calls.

    Notes
    -----
    FLOPs: ``10 * B * H * n * k * E`` for visible tiles (five GEMMs).
    """
    xp = backend.array_module(qs)
    ws = Workspace(xp) if ws is None else ws
    dt = qs.dtype
    n = q_pos.size
    lead = qs.shape[:2]
    E, Ev = qs.shape[-1], do.shape[-1]
    fused = gk.use_fused(xp)
    for k0 in _tiles(k_idx.size, tile):
        k1 = min(k0 + tile, k_idx.size)
        kc = xp.ascontiguousarray(k[..., k0:k1, :], dtype=dt)
        vc = xp.ascontiguousarray(v[..., k0:k1, :], dtype=dt)
        kT, vT = kc.swapaxes(-1, -2), vc.swapaxes(-1, -2)
        kb = None if bias is None else bias[..., k0:k1]
        dk_c, dv_c = dk[..., k0:k1, :], dv[..., k0:k1, :]
        kk = k1 - k0
        for i0 in _tiles(n, tile):
            i1 = min(i0 + tile, n)
            vis = _visibility(q_pos[i0:i1], k_idx[k0:k1], causal)
            if vis == "none":
                continue
            r0, r1 = i0 * group, i1 * group
            rows = lead + (r1 - r0,)
            q_t, do_t = qs[..., r0:r1, :], do[..., r0:r1, :]
            P = xp.matmul(q_t, kT, out=ws.get("P", rows + (kk,), dt))
            if kb is not None:
                P += kb
            if vis == "some":
                P += _causal_bias(xp, np.repeat(q_pos[i0:i1], group), k_idx[k0:k1], dt)
            if fused:
                gk.exp_sub_(P, lse[..., r0:r1])
            else:
                P -= lse[..., r0:r1, None]
                xp.exp(P, out=P)
            PT = P.swapaxes(-1, -2)
            dv_c += xp.matmul(PT, do_t, out=ws.get("dv", lead + (kk, Ev), dt))
            dS = xp.matmul(do_t, vT, out=ws.get("dS", rows + (kk,), dt))
            if fused:
                gk.softmax_grad_(dS, P, D[..., r0:r1])
            else:
                dS -= D[..., r0:r1, None]
                dS *= P
            dq[..., r0:r1, :] += xp.matmul(dS, kc, out=ws.get("dq", rows + (E,), dt))
            dk_c += xp.matmul(dS.swapaxes(-1, -2), q_t, out=ws.get("dk", lead + (kk, E), dt))
