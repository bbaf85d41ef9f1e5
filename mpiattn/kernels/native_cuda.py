"""The native engine on CuPy: GEMMs on tensor cores, no host synchronisation in the tile loop.

The math is :mod:`mpiattn.kernels.native`'s (online softmax forward,
``lse``-based backward); what differs on a GPU is how a tile runs:

* **GEMMs** through :func:`mpiattn.gemm.matmul` (cuBLAS
  ``GemmStridedBatchedEx``): float16 queries, keys and values are the GEMM
  operands as they are (no upcast copies, views of the caller's arrays when
  ``G = 1``), accumulated in float32; the softmax scale rides in the GEMM's
  ``alpha``; ``P`` and ``dS`` are rounded to the input dtype for their
  GEMMs, as FlashAttention does; ``O``, ``dQ``, ``dK``, ``dV`` accumulate in
  place (``beta = 1``). No padding columns: leading dimensions stay
  multiples of 16 bytes (tile buffers are padded to 8 columns), which keeps
  cuBLAS on its aligned kernels.
* **No host synchronisation**: the exact running maximum is kept on the
  device (no data-dependent branch, no boolean indexing); which tiles to
  compute and how to mask them is decided on the host from positions
  (:class:`mpiattn.masks.BlockMask`); causal and window tiles whose
  positions are consecutive are masked on the device from two integers
  (:meth:`~mpiattn.masks.BlockMask.band`); only other partly visible tiles
  (documents, a tile straddling a layout segment) upload a host mask.
* **Launches per tile** (fully visible, no padding; padding adds none with
  fused kernels): forward 3 with the fused kernels (GEMM, one kernel, GEMM),
  16 without; backward 6 with (two GEMMs, one kernel, three GEMMs),
  14 without (counted on the fake CuPy). See :mod:`mpiattn.kernels.fused`.

:func:`device_tile` sizes the tile from the device (SM count, clock,
compute capability, free memory) so that one tile's two forward GEMMs carry
about :data:`TILE_SECONDS` of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend, gemm
from ..masks import BlockMask
from . import fused
from .tiling import Workspace, fold_queries, key_tiles

__all__ = ["DeviceForward", "DeviceBackward", "forward_block", "backward_block", "device_tile",
           "TILE_SECONDS"]

#: GEMM work one forward tile should carry (seconds at the device's estimated rate).
TILE_SECONDS = 100e-6

#: Dense FLOP per clock per SM, by compute capability major (minor) and operand kind.
_RATES = {"tensor16": {7: 1024, 8: 2048, 86: 1024, 89: 1024, 9: 4096, 10: 8192},
          "float32": {7: 128, 8: 128, 86: 256, 89: 256, 9: 256, 10: 256},
          "float64": {7: 64, 8: 64, 86: 4, 89: 4, 9: 128, 10: 128}}


def _rate(kind: str, major: int, minor: int) -> int:
    table = _RATES[kind]
    return table.get(10 * major + minor, table.get(major, min(table.values())))


def device_tile(spec: Any) -> int:
    """Rows of the score tile for the call ``spec`` on the current CuPy device (local).

    About :data:`TILE_SECONDS` of forward GEMM work per tile at the device's
    estimated dense rate (SMs x clock x FLOP per clock per SM for the operand
    dtype), at most what an eighth of the free memory holds (scores, ``dP``
    and ``P``), a multiple of 128 in ``[256, 8192]``.
    """
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    sms, clock_hz = int(props["multiProcessorCount"]), 1e3 * float(props["clockRate"])
    major, minor = int(props["major"]), int(props["minor"])
    name = np.dtype(spec.dtype).name
    kind = "tensor16" if name in ("float16", "bfloat16") else name
    rate = sms * clock_hz * _rate(kind, major, minor)
    heads = spec.B * spec.H
    t = math.sqrt(rate * TILE_SECONDS / (2.0 * heads * (spec.E + spec.Ev)))
    free = int(cupy.cuda.runtime.memGetInfo()[0])
    acc = backend.accum_dtype(spec.dtype).itemsize
    t = min(t, math.sqrt(free / 8 / (heads * (2 * acc + np.dtype(spec.dtype).itemsize))))
    return int(min(8192, max(256, 128 * int(t // 128))))


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _tile_buf(ws: Workspace, name: str, lead: tuple, rows: int, cols: int, dtype: Any) -> Any:
    """A ``(*lead, rows, cols)`` view of a buffer whose rows are padded to 8 columns (aligned)."""
    return ws.get(name, lead + (rows, _pad8(cols)), dtype)[..., :cols]


def _fold(x: Any, hkv: int, dtype: Any) -> Any:
    """``(B, H, n, F)`` -> ``(B, Hkv, n*G, F)`` in ``dtype``: a view when nothing needs a copy."""
    B, H = x.shape[:2]
    if H == hkv and x.dtype == dtype:
        return x
    return fold_queries(x, hkv, None, dtype)


def _rows(x: Any) -> Any:
    """``(B, Hkv, R, ...)`` -> ``(B*Hkv, R, ...)`` (a view)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


class _Masking:
    """How one tile is masked on the device: padding bias, band, or an uploaded host mask."""

    def __init__(self, xp: Any, mask: BlockMask, j0: int, j1: int, acc: Any):
        self.xp, self.mask, self.j0, self.j1, self.acc = xp, mask, j0, j1, np.dtype(acc)
        pad = mask.padding(xp, j0, j1, acc)  # (B, 1, 1, k) or None
        self.pad = None if pad is None else pad[:, 0, 0, :]

    def tile(self, i0: int, i1: int, vis: str, group: int) -> tuple[Any, Any, Any]:
        """``(pad, band, host)`` for queries ``i0:i1``: the padding bias ``(B, k)``, the band
        ``(q0, k0, lo, hi, group)``, or a host-made bias ``(Bs, 1 or Hkv, R, k)`` uploaded (the
        rules and every score modifier: :meth:`~mpiattn.masks.BlockMask.host_bias`)."""
        if self.mask.mods is not None:
            host = self.mask.host_bias(i0, i1, self.j0, self.j1, self.acc, group, vis)
            return self.pad, None, None if host is None else backend.to_device(host, self.xp)
        if vis != "some":
            return self.pad, None, None
        b = self.mask.band(i0, i1, self.j0, self.j1)
        if b is not None:
            lo = -fused.BIG if b[2] == -math.inf else int(b[2])
            hi = fused.BIG if b[3] == math.inf else int(b[3])
            return self.pad, (b[0], b[1], lo, hi, group), None
        ok = self.mask.visible_pairs(i0, i1, self.j0, self.j1)
        if group > 1:
            ok = np.repeat(ok, group, axis=1)
        host = np.where(ok, self.acc.type(0), self.acc.type(-np.inf))[:, None]
        return self.pad, None, backend.to_device(host, self.xp)


def _apply_generic(S: Any, pad: Any, band: Any, host: Any, hkv: int) -> Any:
    """``S`` (B, Hkv, R, k) masked in place by the generic array code."""
    xp = backend.array_module(S)
    if pad is not None:
        S += pad[:, None, None, :]
    if band is not None:
        S[...] = xp.where(fused._band_mask(xp, band, S.shape[2], S.shape[3]), S, S.dtype.type(-np.inf))
    if host is not None:
        S += host
    return S


# ------------------------------------------------------------------- forward
@dataclass
class DeviceForward:
    """Folded queries (GEMM operand dtype, unscaled) and the online-softmax state.

    Attributes
    ----------
    q : (B, Hkv, n*G, E)
    m, l : (B, Hkv, n*G) accumulation dtype
        Running maximum (``-inf`` before any key) and sum of ``exp(S - m)``.
    o : (B, Hkv, n*G, Ev) accumulation dtype
        Running ``sum exp(S - m) V``.
    scale : float
    fused : bool
        Run the fused kernels of :mod:`mpiattn.kernels.fused`.
    ws : Workspace
    xmax : (B, Hkv, n*G) accumulation dtype or None
        Running maximum of ``x = s q . k`` over the visible pairs (``max_logit``).
    """

    q: Any
    m: Any
    l: Any
    o: Any
    scale: float
    fused: bool
    ws: Workspace
    xmax: Any = None

    @classmethod
    def start(cls, q: Any, hkv: int, scale: float, acc: Any, ev: int, fused_kernels: bool,
              max_logit: bool = False) -> "DeviceForward":
        xp = backend.array_module(q)
        qf = _fold(q, hkv, gemm.operand_dtype(xp, q.dtype))
        lead = qf.shape[:-1]
        return cls(qf, xp.full(lead, -np.inf, dtype=acc), xp.zeros(lead, dtype=acc),
                   xp.zeros(lead + (ev,), dtype=acc), float(scale), bool(fused_kernels), Workspace(xp),
                   xp.full(lead, -np.inf, dtype=acc) if max_logit else None)


def _formed(xmax: Any, S: Any, mask: BlockMask, i0: int, i1: int, j0: int, j1: int, group: int,
            vis: str, pad: Any, host: Any, keep: bool = False) -> Any:
    """``S = x`` -> the scores (in place, generic array code): the running ``max_logit`` (into
    ``xmax``, the forward's, None in the backward), the transform (softcap), then the padding and
    the host bias. Returns ``(S, (t, at))``: with ``keep`` (the backward) ``t`` what the
    transform's chain rule needs (else None), ``at`` the tile's indices (None without one)."""
    xp = backend.array_module(S)
    if xmax is not None:
        hidden = mask.hidden(xp, i0, i1, j0, j1, S.dtype, group, vis)
        top = (S if hidden is None else S + hidden).max(axis=-1)
        xp.maximum(xmax[..., i0 * group:i1 * group], top, out=xmax[..., i0 * group:i1 * group])
    t, f = None, mask.transform
    at = None if f is None else mask.at(i0, i1, j0, j1, group, xp)
    if f is not None and keep:  # the backward: S <- f(x), t keeps f's chain rule
        t = S.copy()
        f.saving_(t, S, at)
    elif f is not None:
        f.forward_(S, at)
    return _apply_generic(S, pad, None, host, S.shape[1]), (t, at)


def forward_block(st: DeviceForward, group: int, k: Any, v: Any, mask: BlockMask, tile: int) -> None:
    """Fold one key/value block ``k (B, Hkv, k, E)``, ``v (B, Hkv, k, Ev)`` into ``st`` (in place)."""
    xp = backend.array_module(st.q)
    acc, op = st.o.dtype, st.q.dtype
    B, hkv = st.q.shape[:2]
    k, v = k.astype(op, copy=False), v.astype(op, copy=False)
    for j0, j1, tiles in key_tiles(mask, group, tile):
        kk = j1 - j0
        kt, vt = k[..., j0:j1, :].swapaxes(-1, -2), v[..., j0:j1, :]
        masking = _Masking(xp, mask, j0, j1, acc)
        for i0, i1, r0, r1, vis in tiles:
            R = r1 - r0
            pad, band, host = masking.tile(i0, i1, vis, group)
            S = _tile_buf(st.ws, "S", (B, hkv), R, kk, acc)
            gemm.matmul(st.q[..., r0:r1, :], kt, S, alpha=st.scale)
            P = S if op == acc else _tile_buf(st.ws, "P", (B, hkv), R, kk, op)
            m, l, o = st.m[..., r0:r1], st.l[..., r0:r1], st.o[..., r0:r1, :]
            if mask.mods is not None:  # scores formed by the generic array code
                _formed(st.xmax, S, mask, i0, i1, j0, j1, group, vis, pad, host)
                fused.generic.softmax_fwd_(_rows(S), _rows(P), _rows(m), _rows(l), _rows(o))
            elif st.fused:
                if host is not None:
                    S += host
                fused.softmax_fwd_(_rows(S), _rows(P), _rows(m), _rows(l), _rows(o), pad, band, hkv)
            else:
                _apply_generic(S, pad, band, host, hkv)
                fused.generic.softmax_fwd_(_rows(S), _rows(P), _rows(m), _rows(l), _rows(o))
            gemm.matmul(P, vt, o, beta=1.0)


def finalize(st: DeviceForward) -> tuple[Any, Any]:
    """``O / l`` and ``lse = m + log l`` (rows that saw no key: 0 and -inf)."""
    xp = backend.array_module(st.o)
    seen = st.l > 0
    l_safe = xp.where(seen, st.l, st.l.dtype.type(1))
    return st.o / l_safe[..., None], xp.where(seen, st.m + xp.log(l_safe), st.l.dtype.type(-np.inf))


# ------------------------------------------------------------------ backward
@dataclass
class DeviceBackward:
    """Folded inputs of the backward pass (GEMM operand dtype) and per-row ``lse``, ``D``.

    Attributes
    ----------
    q, do : (B, Hkv, n*G, E), (B, Hkv, n*G, Ev)
    lse, D : (B, Hkv, n*G) accumulation dtype
    scale : float
    fused : bool
    ws : Workspace
    """

    q: Any
    do: Any
    lse: Any
    D: Any
    scale: float
    fused: bool
    ws: Workspace

    @classmethod
    def start(cls, q: Any, dout: Any, lse: Any, D: Any, hkv: int, scale: float, acc: Any,
              fused_kernels: bool) -> "DeviceBackward":
        xp = backend.array_module(q)
        op = gemm.operand_dtype(xp, q.dtype)
        acc = np.dtype(acc)
        rows = lambda x: xp.ascontiguousarray(  # noqa: E731 - unit stride along rows, for the kernel
            _fold(x.astype(acc, copy=False)[..., None], hkv, acc)[..., 0])
        return cls(_fold(q, hkv, op), _fold(dout.astype(op, copy=False), hkv, op), rows(lse), rows(D),
                   float(scale), bool(fused_kernels), Workspace(xp))


def backward_block(bs: DeviceBackward, group: int, k: Any, v: Any, mask: BlockMask, dq: Any,
                   dk: Any, dv: Any, tile: int) -> None:
    """Add one block's gradients into ``dq (B, Hkv, n*G, E)`` (scaled already), ``dk``, ``dv``."""
    xp = backend.array_module(bs.q)
    acc, op = bs.lse.dtype, bs.q.dtype
    B, hkv = bs.q.shape[:2]
    k, v = k.astype(op, copy=False), v.astype(op, copy=False)
    for j0, j1, tiles in key_tiles(mask, group, tile):
        kk = j1 - j0
        kc, vc = k[..., j0:j1, :], v[..., j0:j1, :]
        dk_c, dv_c = dk[..., j0:j1, :], dv[..., j0:j1, :]
        masking = _Masking(xp, mask, j0, j1, acc)
        for i0, i1, r0, r1, vis in tiles:
            R = r1 - r0
            pad, band, host = masking.tile(i0, i1, vis, group)
            q_r, do_r = bs.q[..., r0:r1, :], bs.do[..., r0:r1, :]
            S = _tile_buf(bs.ws, "S", (B, hkv), R, kk, acc)
            dP = _tile_buf(bs.ws, "dP", (B, hkv), R, kk, acc)
            gemm.matmul(q_r, kc.swapaxes(-1, -2), S, alpha=bs.scale)
            gemm.matmul(do_r, vc.swapaxes(-1, -2), dP)
            P = S if op == acc else _tile_buf(bs.ws, "P", (B, hkv), R, kk, op)
            dS = dP if op == acc else _tile_buf(bs.ws, "dS", (B, hkv), R, kk, op)
            lse, D = bs.lse[..., r0:r1], bs.D[..., r0:r1]
            if mask.mods is not None:  # scores formed by the generic array code
                _, (t, at) = _formed(None, S, mask, i0, i1, j0, j1, group, vis, pad, host, keep=True)
                fused.generic.softmax_bwd_(_rows(S), _rows(dP), _rows(P), _rows(dS), _rows(lse), _rows(D))
                if t is not None:  # dS *= dy/dx
                    mask.transform.chain_(dS, t, at)
            elif bs.fused:
                if host is not None:
                    S += host
                fused.softmax_bwd_(_rows(S), _rows(dP), _rows(P), _rows(dS), _rows(lse), _rows(D),
                                   pad, band, hkv)
            else:
                _apply_generic(S, pad, band, host, hkv)
                fused.generic.softmax_bwd_(_rows(S), _rows(dP), _rows(P), _rows(dS), _rows(lse), _rows(D))
            gemm.matmul(P.swapaxes(-1, -2), do_r, dv_c, beta=1.0)
            gemm.matmul(dS, kc, dq[..., r0:r1, :], alpha=bs.scale, beta=1.0)
            gemm.matmul(dS.swapaxes(-1, -2), q_r, dk_c, alpha=bs.scale, beta=1.0)
