"""The native engine's host backward: the gradients of one key/value block, recomputing the
probabilities from ``lse`` (NumPy).

The formulas are :mod:`mpiattn.kernels.native`'s (its docstring, "Backward"): ``P`` from
``qs K^T - lse`` (``- lse`` and ``- D`` folded into their GEMMs by an extra column), five
GEMMs per visible tile, ``dQ`` scaled once at the end by the caller. Rows are folded
(:mod:`mpiattn.kernels.tiling`); tiles no query sees are never formed. CuPy arrays run
:func:`mpiattn.kernels.native_cuda.backward_block` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend
from ..masks import BlockMask
from .tiling import DEFAULT_TILE, Workspace, fold_queries, key_tiles

__all__ = ["BackwardInputs", "backward_block"]


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
    for j0, j1, tiles in key_tiles(mask, group, tile):
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
                at = mask.at(i0, i1, j0, j1, group, xp)
                T = xp.matmul(qa[..., r0:r1, :E], kt[..., :E, :], out=ws.get("T", rows + (kk,), dt))
                P = f.saving_(T, ws.get("P", rows + (kk,), dt), at)
                P += qa[..., r0:r1, E, None]
            if bias is not None:
                P += bias
            xp.exp(P, out=P)
            dv_c += _rows_product(xp, ws, "dv", P, doa[..., r0:r1, :Ev], group)
            dS = xp.matmul(doa[..., r0:r1, :], vt, out=ws.get("dS", rows + (kk,), dt))  # dP - D
            dS *= P
            if f is not None:  # dS *= dy/dx
                f.chain_(dS, T, at)
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
