"""The native engine: blocked online-softmax forward, lse-based backward (NumPy or CuPy).

These run on one rank and know nothing of MPI. The distributed strategies in
:mod:`mpiattn.strategies` feed them key/value blocks (from the ring, a gather
or an all-to-all) with their *global* row indices. They are the reference
implementation: every dtype, mask and device.

Queries are kept "folded" (:mod:`mpiattn.kernels.tiling`): ``qs`` of shape
``(B, Hkv, n*G, E)`` holds the ``G = H // Hkv`` query heads of a key/value
head, multiplied by the softmax scale ``s``, so one GEMM serves them all.

Math (per query block, over key blocks ``c``; Milakov & Gimelshein 2018,
Dao et al. 2022/2023)::

    S   = qs K_c^T  (+ mask: causal j > i, padding -> -inf)
    m'  = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
    l   = a l + rowsum P;    O = a O + P V_c;  m = m'
    end: O = O / l;  lse = m + log l      (no visible key: O = 0, lse = -inf)

The result does not depend on which shift ``m`` is used, as long as
``exp(S - m)`` neither overflows nor loses the row's largest terms (a "lazy
rescale" as in FlashAttention-4). So a row's first tile sets ``m`` from its
maximum, and later tiles use ``m`` as it is, without computing their maxima:
only when a tile's row sums show that its scores grew more than ``GROWTH``
above ``m`` (or overflowed) is the tile redone exactly, moving ``m`` to
within ``TAU`` of the new maximum. The shift is folded into the ``qs K^T``
GEMM (an extra column ``-m`` on the queries, ``1`` on the keys) and
``rowsum P`` into the ``P V`` GEMM (a ones column on ``V``), so most tiles
cost two GEMMs and one elementwise pass (exp) instead of five passes.

Backward, recomputing ``P`` from ``lse``::

    D = rowsum(dO * O);  P = exp(qs K_c^T - lse)
    dV_c += P^T dO;  dP = dO V_c^T;  dS = P * (dP - D)
    dQ += s dS K_c;  dK_c += dS^T qs

(``qs`` already carries ``s``, so ``dK_c`` needs no extra factor and ``dQ``
is multiplied by ``s`` once at the end; ``- lse`` and ``- D`` are folded into
their GEMMs by an extra column, as in the forward pass.)

This module's tile loops are the host's (NumPy) forward: the lazy rescale and
the shift columns save passes over the tile on a CPU, where a data-dependent
branch costs nothing; the host backward is :mod:`mpiattn.kernels.native_backward`
(its names re-exported here). CuPy arrays run :mod:`mpiattn.kernels.native_cuda`
instead (the same math with an exact running maximum, float16 GEMM operands
and no host synchronisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend
from ..masks import BlockMask
from .native_backward import BackwardInputs, backward_block
from .tiling import DEFAULT_TILE, Workspace, fold_queries, key_tiles, unfold_rows

__all__ = ["fold_queries", "unfold_rows", "Workspace", "ForwardState", "BackwardInputs",
           "forward_block", "finalize", "backward_block", "DEFAULT_TILE", "TAU"]

#: Folded query rows (queries x heads per key/value head) up to which a block is read in place,
#: one GEMV-like pass over each key and value tile (:func:`_tile_few`, decode steps).
FEW_ROWS = 16

#: Lazy-rescale threshold (natural-log units): the running shift of a row
#: moves only when a tile's scores exceed it by more than this.
TAU = 8.0

#: How far (natural-log units) a row's scores may grow above its shift before
#: a tile is redone exactly: probabilities stay below ``exp(GROWTH)``, far from
#: overflow in float32 (``exp(88)``) while sums stay exact to rounding.
GROWTH = 30.0
_GROWTH_LIMIT = {"f": np.float32(math.exp(GROWTH)), "d": np.float64(math.exp(GROWTH))}


@dataclass
class ForwardState:
    """Queries and running statistics of the online softmax (folded rows).

    Attributes
    ----------
    qa : (B, Hkv, n*G, E+1)
        Folded, scaled queries; the last column holds each tile's shift.
    m : (B, Hkv, n*G)
        Running shift (-inf before any visible key): at most ``TAU``
        below the running row maximum, never above it.
    l : (B, Hkv, n*G)
        Running sum of ``exp(S - m)`` (>= 1 once a key was seen).
    o : (B, Hkv, n*G, Ev)
        Running ``sum exp(S - m) V`` (unnormalised).
    ws : Workspace
    xmax : (B, Hkv, n*G) or None
        Running maximum of ``x = s q . k`` over the visible pairs (``max_logit``).
    """

    qa: Any
    m: Any
    l: Any
    o: Any
    ws: Workspace
    xmax: Any = None

    @classmethod
    def start(cls, q: Any, hkv: int, scale: float, dtype: Any, ev: int,
              max_logit: bool = False) -> "ForwardState":
        """Fold ``q`` ``(B, H, n, E)`` and set up an empty state."""
        xp = backend.array_module(q)
        qa = fold_queries(q, hkv, scale, dtype, pad=1)
        lead = qa.shape[:-1]
        return cls(qa, xp.full(lead, -np.inf, dtype=qa.dtype), xp.zeros(lead, dtype=qa.dtype),
                   xp.zeros(lead + (ev,), dtype=qa.dtype), Workspace(xp),
                   xp.full(lead, -np.inf, dtype=qa.dtype) if max_logit else None)


def _rebase(xp: Any, st: ForwardState, S: Any, r: Any, r0: int, r1: int) -> None:
    """Move the shift of rows whose scores outgrew it (or that saw their first key).

    ``S`` holds ``scores - c``, ``c`` the current shift (0 where it is
    -inf), and ``r`` its row maxima; afterwards ``S`` holds ``scores - m``
    for the updated shift ``m``, and the running sums are rescaled.
    """
    m = st.m[..., r0:r1]
    need = (r > TAU) | (xp.isneginf(m) & ~xp.isneginf(r))
    count = int(need.sum())
    if count == 0:
        return
    d = xp.where(need, r, r.dtype.type(0))
    if 3 * count >= need.size:
        S -= d[..., None]
    else:
        S[need] -= d[need][:, None]
    m_new = xp.where(xp.isneginf(m), m.dtype.type(0), m) + d
    alpha = xp.ones_like(m)
    alpha[need] = xp.exp(m[need] - m_new[need])
    st.l[..., r0:r1] *= alpha
    st.o[..., r0:r1, :] *= alpha[..., None]
    m[need] = m_new[need]


def forward_block(st: ForwardState, group: int, k: Any, v: Any, mask: BlockMask,
                  tile: int = DEFAULT_TILE) -> None:
    """Fold one block of keys/values into the running state (in place).

    Parameters
    ----------
    st : ForwardState
        Queries and running statistics (:meth:`ForwardState.start`).
    group : int
        ``G = H // Hkv``.
    k, v : (B, Hkv, k, E), (B, Hkv, k, Ev)
        Key/value block (any float dtype; cast to the state's dtype per tile).
    mask : BlockMask
        Global positions of the queries and keys and the rules that hide
        pairs (:mod:`mpiattn.kernels.masks`); tiles with no visible pair are
        skipped.
    tile : int
        Edge of the score tile: at most ``tile*G x tile`` scores per (B, Hkv) at once.

    Notes
    -----
    FLOPs: ``4 * B * H * n * k * E`` (E = Ev) for visible tiles; memory: one
    score tile of ``B * Hkv * tile*G * tile`` accumulation words.
    """
    xp = backend.array_module(st.qa)
    ws, dt = st.ws, st.qa.dtype
    lead = st.qa.shape[:2]
    n = mask.q_pos.size
    few = n * group <= FEW_ROWS  # decode: read each key once, in place (no tile copies)
    for j0, j1, tiles in key_tiles(mask, group, tile):
        if few:
            kv = (k[..., j0:j1, :].astype(dt, copy=False), v[..., j0:j1, :].astype(dt, copy=False))
            for i0, i1, r0, r1, vis in tiles:
                _tile_few(xp, st, r0, r1, *kv, mask, (i0, i1, j0, j1), group, vis)
            continue
        kt = ws.transposed("kt", k, j0, j1, dt)
        vc = ws.with_ones("vc", v, j0, j1, dt)
        exact = mask.transform is not None or st.xmax is not None
        for i0, i1, r0, r1, vis in tiles:
            bias = mask.bias(xp, i0, i1, j0, j1, dt, group, vis)
            if exact:
                raw = _raw_scores(xp, st, r0, r1, lead + (r1 - r0,), kt)
                _formed(xp, st, raw, mask, (i0, i1, j0, j1), r0, r1, group, vis, bias)
                _tile_exact(xp, st, r0, r1, raw, vc)
            elif mask.formed:  # ALiBi, a float mask: scores that grow along a row, every tile exact
                _tile_exact(xp, st, r0, r1, _shifted_scores(xp, st, r0, r1, lead + (r1 - r0,), kt,
                                                            bias), vc, shifted=True)
            else:
                _tile_generic(xp, st, r0, r1, lead + (r1 - r0,), kt, vc, bias)


def _raw_scores(xp: Any, st: ForwardState, r0: int, r1: int, rows: tuple, kt: Any) -> Any:
    """``x = s q . k`` of a tile (the shift column set to 0)."""
    E = st.qa.shape[-1] - 1
    st.qa[..., r0:r1, E] = 0
    return xp.matmul(st.qa[..., r0:r1, :], kt, out=st.ws.get("S", rows + (kt.shape[-1],), st.qa.dtype))


def _formed(xp: Any, st: Any, S: Any, mask: BlockMask, tile: tuple, r0: int, r1: int, group: int,
            vis: str, bias: Any) -> None:
    """``S = x`` -> the scores ``y`` (in place): the running ``max_logit`` of the visible ``x``,
    the transform (softcap), then the bias (hidden pairs -inf, ALiBi, a float ``attn_mask``)."""
    if st.xmax is not None:
        hidden = bias if not mask.formed else mask.hidden(xp, *tile, S.dtype, group, vis)
        top = (S if hidden is None else S + hidden).max(axis=-1)
        xp.maximum(st.xmax[..., r0:r1], top, out=st.xmax[..., r0:r1])
    if mask.transform is not None:
        mask.transform.forward_(S, mask.at(*tile, group, xp))
    if bias is not None:
        S += bias


def _shifted_scores(xp: Any, st: ForwardState, r0: int, r1: int, rows: tuple, kt: Any,
                    bias: Any) -> Any:
    """``y - c`` of a tile, ``c`` the rows' current shift (0 where none yet), the shift folded
    into the GEMM; ``bias`` added."""
    E = st.qa.shape[-1] - 1
    m = st.m[..., r0:r1]
    st.qa[..., r0:r1, E] = xp.where(xp.isneginf(m), m.dtype.type(0), -m)
    S = xp.matmul(st.qa[..., r0:r1, :], kt, out=st.ws.get("S", rows + (kt.shape[-1],), st.qa.dtype))
    if bias is not None:
        S += bias
    return S


def _tile_exact(xp: Any, st: ForwardState, r0: int, r1: int, S: Any, vc: Any,
                shifted: bool = False) -> None:
    """One tile of scores ``S = y`` (any values; ``shifted``: ``y - c`` already), folded in with
    exact row maxima."""
    Ev = vc.shape[-1] - 1
    m = st.m[..., r0:r1]
    if not shifted:
        S -= xp.where(xp.isneginf(m), m.dtype.type(0), m)[..., None]
    _rebase(xp, st, S, S.max(axis=-1, out=st.ws.get("r", S.shape[:-1], S.dtype)), r0, r1)
    xp.exp(S, out=S)
    pv = xp.matmul(S, vc, out=st.ws.get("pv", S.shape[:-1] + (Ev + 1,), S.dtype))
    st.l[..., r0:r1] += pv[..., Ev]
    st.o[..., r0:r1, :] += pv[..., :Ev]


def _tile_generic(xp: Any, st: ForwardState, r0: int, r1: int, rows: tuple, kt: Any, vc: Any,
                  bias: Any) -> None:
    """One score tile, generic array code: exp is the only pass over the tile in most tiles.

    The shift ``-m`` rides in the ``qs K^T`` GEMM and the row sums in the
    ``P [V 1]`` GEMM (``vc`` carries a ones column), so a tile costs two GEMMs
    and one ``exp``, unless a row needs its shift moved: rows seeing their
    first key, or scores that grew more than :data:`GROWTH` above the shift
    (then ``rowsum > exp(GROWTH)``, or it overflowed). Such tiles are redone
    exactly: row maxima, lazy rescale by :func:`_rebase`, exp, GEMM.
    """
    ws, dt = st.ws, st.qa.dtype
    E, Ev = st.qa.shape[-1] - 1, vc.shape[-1] - 1
    m = st.m[..., r0:r1]
    fresh = bool(xp.isneginf(m).any())
    st.qa[..., r0:r1, E] = xp.where(xp.isneginf(m), dt.type(0), -m)  # S = scores - m straight from the GEMM
    S = xp.matmul(st.qa[..., r0:r1, :], kt, out=ws.get("S", rows + (kt.shape[-1],), dt))
    if bias is not None:
        S += bias
    pv = ws.get("pv", rows + (Ev + 1,), dt)
    if not fresh:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught just below
            xp.exp(S, out=S)
            xp.matmul(S, vc, out=pv)
        if bool((pv[..., Ev] <= _GROWTH_LIMIT[dt.char]).all()):  # also False for inf / NaN
            st.l[..., r0:r1] += pv[..., Ev]
            st.o[..., r0:r1, :] += pv[..., :Ev]
            return
        S = xp.matmul(st.qa[..., r0:r1, :], kt, out=S)  # redo this tile exactly
        if bias is not None:
            S += bias
    _rebase(xp, st, S, S.max(axis=-1, out=ws.get("r", rows, dt)), r0, r1)
    xp.exp(S, out=S)
    xp.matmul(S, vc, out=pv)
    st.l[..., r0:r1] += pv[..., Ev]
    st.o[..., r0:r1, :] += pv[..., :Ev]


def _tile_few(xp: Any, st: ForwardState, r0: int, r1: int, kc: Any, vc: Any, mask: BlockMask,
              tile: tuple, group: int, vis: str) -> None:
    """One score tile for a few query rows (decode): the key and value tiles are read in place
    (no transposed copy; BLAS reads ``kc^T``), with the exact running maximum."""
    E = st.qa.shape[-1] - 1
    S = xp.matmul(st.qa[..., r0:r1, :E], kc.swapaxes(-1, -2))
    _formed(xp, st, S, mask, tile, r0, r1, group, vis, mask.bias(xp, *tile, S.dtype, group, vis))
    m_old = st.m[..., r0:r1]
    m_new = xp.maximum(m_old, S.max(axis=-1))
    base = xp.where(xp.isneginf(m_new), m_new.dtype.type(0), m_new)
    alpha = xp.exp(m_old - base)  # 0 where nothing was seen before
    S -= base[..., None]
    xp.exp(S, out=S)
    st.l[..., r0:r1] = alpha * st.l[..., r0:r1] + S.sum(axis=-1)
    st.o[..., r0:r1, :] = alpha[..., None] * st.o[..., r0:r1, :] + xp.matmul(S, vc)
    m_old[...] = m_new


def finalize(st: ForwardState) -> tuple[Any, Any]:
    """Normalise: ``O / l`` and ``lse = m + log l``; rows that saw no key get 0 and -inf."""
    xp = backend.array_module(st.o)
    seen = st.l > 0
    l_safe = xp.where(seen, st.l, st.l.dtype.type(1))
    o = st.o / l_safe[..., None]
    lse = xp.where(seen, st.m + xp.log(l_safe), st.l.dtype.type(-np.inf))
    return o, lse
