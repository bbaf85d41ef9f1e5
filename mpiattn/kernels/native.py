"""The native engine: blocked online-softmax forward, lse-based backward (NumPy or CuPy).

These run on one rank and know nothing of MPI. The distributed strategies in
:mod:`mpiattn.strategies` feed them key/value blocks (from the ring, a gather
or an all-to-all) with their *global* row indices. They are the reference
implementation: every dtype, mask and device.

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

This module's tile loops are the host's (NumPy): the lazy rescale and the
shift columns save passes over the tile on a CPU, where a data-dependent
branch costs nothing. CuPy arrays run :mod:`mpiattn.kernels.native_cuda`
instead (the same math with an exact running maximum, float16 GEMM operands
and no host synchronisation).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .. import backend
from ..masks import BlockMask

__all__ = ["fold_queries", "unfold_rows", "Workspace", "ForwardState", "BackwardInputs",
           "forward_block", "finalize", "backward_block", "DEFAULT_TILE", "TAU"]

#: Default tile edge (rows of queries x rows of keys) for the score block.
DEFAULT_TILE = 512

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


def fold_queries(q: Any, hkv: int, scale: float | None, dtype: Any, pad: int = 0) -> Any:
    """``(B, H, n, F)`` -> ``(B, Hkv, n*G, F + pad)`` in ``dtype``, times ``scale`` if given.

    The ``pad`` extra columns are left uninitialised (the kernels use them to
    fold a per-row shift into a GEMM).
    """
    xp = backend.array_module(q)
    B, H, n, F = q.shape
    if H == hkv and not pad and scale is None and q.dtype == dtype:
        return q  # nothing to fold, scale or cast: the caller's array (read only)
    G = H // hkv
    out = xp.empty((B, hkv, n, G, F + pad), dtype=dtype)
    body = out[..., :F] if pad else out
    body[...] = q.reshape(B, hkv, G, n, F).transpose(0, 1, 3, 2, 4)
    if scale is not None:
        body *= scale
    return out.reshape(B, hkv, n * G, F + pad)


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
        size = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.xp.empty(max(size, 1), dtype=dtype)
            self._bufs[name] = buf
        return buf[:size].reshape(shape)

    def with_ones(self, name: str, x: Any, k0: int, k1: int, dtype: Any) -> Any:
        """``[x[k0:k1], 1]``: ``(B, Hkv, k1-k0, F+1)`` in ``dtype`` (the ones column sums a GEMM's rows)."""
        F = x.shape[-1]
        xo = self.get(name, x.shape[:2] + (k1 - k0, F + 1), dtype)
        xo[..., :F] = x[..., k0:k1, :]
        xo[..., F] = 1
        return xo

    def transposed(self, name: str, x: Any, k0: int, k1: int, dtype: Any) -> Any:
        """``[x[k0:k1]^T ; 1]``: ``(B, Hkv, F+1, k1-k0)`` in ``dtype`` (the ones row carries a GEMM shift)."""
        F = x.shape[-1]
        xt = self.get(name, x.shape[:2] + (F + 1, k1 - k0), dtype)
        xt[..., :F, :] = x[..., k0:k1, :].swapaxes(-1, -2)
        xt[..., F, :] = 1
        return xt


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


def _tiles(n: int, t: int) -> range:
    return range(0, n, max(1, t))


def _query_tiles(mask: BlockMask, j0: int, j1: int, group: int,
                 tile: int) -> Iterator[tuple[int, int, int, int, str]]:
    """Query tiles that see at least one key of ``j0:j1``: ``(i0, i1, r0, r1, visibility)``.

    ``i0:i1`` are query rows, ``r0:r1`` the same as folded rows (``group`` per query).
    """
    n = mask.q_pos.size
    for i0 in _tiles(n, tile):
        i1 = min(i0 + tile, n)
        vis = mask.visibility(i0, i1, j0, j1)
        if vis != "none":
            yield i0, i1, i0 * group, i1 * group, vis


def _key_tiles(mask: BlockMask, group: int, tile: int) -> Iterator[tuple[int, int, Iterator]]:
    """Key tiles ``j0:j1`` that some query sees, each with its :func:`_query_tiles`.

    A key tile's operands are prepared only for these, so a key tile (or a
    whole block) with no visible pair costs host checks only.
    """
    n, nk = mask.q_pos.size, mask.k_pos.size
    for j0 in _tiles(nk, tile):
        j1 = min(j0 + tile, nk)
        if mask.visibility(0, n, j0, j1) == "none":
            continue
        tiles = _query_tiles(mask, j0, j1, group, tile)
        first = next(tiles, None)
        if first is not None:
            yield j0, j1, itertools.chain((first,), tiles)


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
    for j0, j1, tiles in _key_tiles(mask, group, tile):
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
        mask.transform.forward_(S)
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


@dataclass
class BackwardInputs:
    """Folded inputs of the backward pass, with the shift columns of its GEMMs.

    Attributes
    ----------
    qa : (B, Hkv, n*G, E+1)
        Scaled queries, last column ``-lse`` (a huge negative finite number
        where ``lse = -inf``, so that such rows get probabilities 0).
    doa : (B, Hkv, n*G, Ev+1)
        Output gradient, last column ``-D`` with ``D = rowsum(dO * O)``.
    ws : Workspace
    """

    qa: Any
    doa: Any
    ws: Workspace

    @classmethod
    def start(cls, q: Any, dout: Any, lse: Any, D: Any, hkv: int, scale: float,
              dtype: Any) -> "BackwardInputs":
        """Fold ``q (B,H,n,E)``, ``dout (B,H,n,Ev)``, ``lse, D (B,H,n)``."""
        xp = backend.array_module(q)
        dt = np.dtype(dtype)
        qa = fold_queries(q, hkv, scale, dt, pad=1)
        lse_f = fold_queries(lse[..., None], hkv, None, dt)[..., 0]
        qa[..., -1] = xp.where(xp.isneginf(lse_f), dt.type(-np.finfo(dt).max / 4), -lse_f)
        doa = fold_queries(dout, hkv, None, dt, pad=1)
        doa[..., -1] = -fold_queries(D[..., None], hkv, None, dt)[..., 0]
        return cls(qa, doa, Workspace(xp))


def backward_block(bi: BackwardInputs, group: int, k: Any, v: Any, mask: BlockMask,
                   dq: Any, dk: Any, dv: Any, tile: int = DEFAULT_TILE) -> None:
    """Accumulate the gradients of one key/value block (in place).

    Parameters
    ----------
    bi : BackwardInputs
        Folded queries, output gradient, ``lse`` and ``D``.
    group, k, v, mask, tile
        As in :func:`forward_block`.
    dq : (B, Hkv, n*G, E)
        Accumulates ``dS K`` (multiply by the scale once at the end).
    dk, dv : (B, Hkv, k, E), (B, Hkv, k, Ev)
        Accumulate ``dS^T qs`` and ``P^T dO`` for this block.

    Notes
    -----
    FLOPs: ``10 * B * H * n * k * E`` for visible tiles (five GEMMs).
    """
    xp = backend.array_module(bi.qa)
    qa, doa, ws = bi.qa, bi.doa, bi.ws
    dt = qa.dtype
    lead = qa.shape[:2]
    E, Ev = qa.shape[-1] - 1, doa.shape[-1] - 1
    for j0, j1, tiles in _key_tiles(mask, group, tile):
        kk = j1 - j0
        kc = xp.ascontiguousarray(k[..., j0:j1, :], dtype=dt)
        kt = ws.transposed("kt", k, j0, j1, dt)
        vt = ws.transposed("vt", v, j0, j1, dt)
        dk_c, dv_c = dk[..., j0:j1, :], dv[..., j0:j1, :]
        f = mask.transform
        for i0, i1, r0, r1, vis in tiles:
            rows = lead + (r1 - r0,)
            bias = mask.bias(xp, i0, i1, j0, j1, dt, group, vis)
            if f is None:
                P = xp.matmul(qa[..., r0:r1, :], kt, out=ws.get("P", rows + (kk,), dt))  # S - lse
            else:  # P = exp(f(x) + bias - lse); T keeps what f's chain rule needs
                T = xp.matmul(qa[..., r0:r1, :E], kt[..., :E, :], out=ws.get("T", rows + (kk,), dt))
                P = f.saving_(T, out=ws.get("P", rows + (kk,), dt))
                P += qa[..., r0:r1, E, None]
            if bias is not None:
                P += bias
            xp.exp(P, out=P)
            dv_c += _rows_product(xp, ws, "dv", P, doa[..., r0:r1, :Ev], group)
            dS = xp.matmul(doa[..., r0:r1, :], vt, out=ws.get("dS", rows + (kk,), dt))  # dP - D
            dS *= P
            if f is not None:  # dS *= dy/dx
                f.chain_(dS, T)
            dq[..., r0:r1, :] += xp.matmul(dS, kc, out=ws.get("dq", rows + (E,), dt))
            dk_c += _rows_product(xp, ws, "dk", dS, qa[..., r0:r1, :E], group)


def _rows_product(xp: Any, ws: Workspace, name: str, A: Any, F: Any, group: int) -> Any:
    """``A^T F`` summed over folded rows: ``(B, Hkv, r*G, k)``, ``(B, Hkv, r*G, f)`` -> ``(B, Hkv, k, f)``.

    With a head group (``G > 1``) each query head's product is formed on its
    own and the ``G`` of them are summed after, as autograd through
    ``repeat_interleave`` does: one GEMM over all ``r*G`` folded rows sums
    them in another order, a few rounding steps less accurate for long
    groups (the contract suite's rule, float64 MQA).
    """
    lead, k, f = A.shape[:2], A.shape[-1], F.shape[-1]
    if group == 1:
        return xp.matmul(A.swapaxes(-1, -2), F, out=ws.get(name, lead + (k, f), A.dtype))
    r = A.shape[-2] // group
    per_head = xp.matmul(A.reshape(lead + (r, group, k)).transpose(0, 1, 3, 4, 2),
                         F.reshape(lead + (r, group, f)).transpose(0, 1, 3, 2, 4),
                         out=ws.get(name + "-heads", lead + (group, k, f), A.dtype))
    return per_head.sum(axis=2, out=ws.get(name, lead + (k, f), A.dtype))
