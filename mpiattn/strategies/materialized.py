"""The thesis' formulation: attention through the distributed products.

``S = s nt(Q, K)``, ``P = softmax(S)``, ``O = nn(P, V)``, and the backward
through the products' closure. Memory ``n M`` scores per head and rank: a
reproduction and a cross-check of the blocked strategies, never chosen by
``auto``. The mask rules are applied as a dense mask
(:func:`mpiattn.masks.visible`). The products take one layout for every
operand: when queries and keys are laid out differently, both are moved to
the contiguous layout first (one all-to-all each way,
:func:`mpiattn.sharding.relayout_rows`), an ``attn_mask``'s rows with the queries.

Costs per rank: FLOPs as the ring's; words sent (accumulation dtype):
``(P-1) m B Hkv (E+Ev)`` forward (``K`` and ``V`` round two rings),
``(P-1) m B Hkv (2E + Ev + G(E+Ev))`` backward (three rings and the two
reduce-scatters of ``dK``, ``dV`` per query head); memory: a few ``B H n M`` score arrays in the
accumulation dtype.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import Comm
from ..layouts import layout_key, local_lengths
from ..masks import padding_bias, visible
from ..masks.ids import global_rows
from ..masks.scoremod import TileIndex
from ..products import matmul_nn, matmul_nt, matmul_tn
from ..sharding import relayout_rows
from .base import Phase, Progress, Strategy, report, ring_phase

__all__ = ["Materialized"]


def _scores(c: Comm, pb: Any, q: Any, k: Any, mask: Any) -> tuple[Any, Any, Any]:
    """``S`` (the scores ``y``: softcap, ALiBi, ``attn_mask`` and every rule applied), shape
    ``(B, Hkv, G, n_r, M)`` (accumulation dtype); what the transform's chain rule needs (the raw
    scores and the tile's indices), else None;
    the largest visible ``x`` per query head (host float64 ``(H,)``) with ``max_logit``, else None."""
    xp = backend.array_module(q)
    s = pb.spec
    B, _, n, E = q.shape
    acc = s.acc_dtype
    q5 = q.astype(acc).reshape(B, s.Hkv, s.G, n, E) * s.scale
    S = matmul_nt(q5, k.astype(acc)[:, :, None], c, layout=s.layout, block_size=pb.block)
    q_pos, k_pos = pb.q_pos(), np.arange(s.M)
    heads = pb.query_heads()
    hidden = None  # (Bx, 1 or H, n, M) host bool: True = hidden
    if s.mask.positional:
        vis = visible(s.mask, q_pos, k_pos, None if pb.seg_q is None else pb.seg_q[:, q_pos], pb.seg_k)
        hidden = ~vis[:, None]
    mods = pb.mods
    if mods is not None and mods.hides:
        seen = mods.visible(heads, np.arange(n), q_pos, k_pos)
        hidden = ~seen if hidden is None else hidden | ~seen
    pad = None
    if s.mask.padding:
        pad = padding_bias(global_rows(c, mask, s.M, s.kv_layout), acc)[:, :, :, None, :]
    unfold = lambda a: a.reshape((a.shape[0], s.Hkv if a.shape[1] > 1 else 1,  # noqa: E731
                                  s.G if a.shape[1] > 1 else 1) + a.shape[2:])
    top = None
    if s.mask.max_logit:
        x = S if hidden is None else xp.where(backend.to_device(unfold(hidden), xp), acc.type(-np.inf), S)
        x = x if pad is None else x + pad
        top = backend.to_host(x.reshape(B, s.H, n, s.M).max(axis=(0, 2, 3), initial=-np.inf))
    t = None
    if mods is not None and mods.transform is not None:  # t: (raw x, the indices) for its chain rule
        at = TileIndex.grouped(B, heads, s.G, q_pos, k_pos, xp)
        t, S = (S, at), mods.transform.saving_(S, xp.empty_like(S), at)
    if mods is not None and mods.adds:
        S = S + backend.to_device(unfold(mods.added(heads, np.arange(n), q_pos, k_pos,
                                                    s.mask.diagonal).astype(acc)), xp)
    if hidden is not None:  # assigned, not added: a hidden NaN score stays hidden
        S = xp.where(backend.to_device(unfold(hidden), xp), acc.type(-np.inf), S)
    if pad is not None:
        S += pad
    return S, t, top


def _forward(c: Comm, pb: Any, q: Any, k: Any, v: Any, mask: Any,
             progress: Progress) -> tuple[Any, Any]:
    xp = backend.array_module(q)
    s = pb.spec
    acc = s.acc_dtype
    S, _, top = _scores(c, pb, q, k, mask)
    if top is not None and pb.tally is not None:
        pb.tally.add(pb.query_heads(), top)
    m = S.max(axis=-1) if S.shape[-1] else xp.full(S.shape[:-1], -np.inf, dtype=acc)
    shift = xp.where(xp.isneginf(m), acc.type(0), m)
    Pm = xp.exp(S - shift[..., None])
    l = Pm.sum(axis=-1)
    seen = l > 0
    Pm /= xp.where(seen, l, acc.type(1))[..., None]
    o = matmul_nn(Pm, v.astype(acc)[:, :, None], c, layout=s.layout, block_size=pb.block)
    lse = xp.where(seen, shift + xp.log(xp.where(seen, l, acc.type(1))), acc.type(-np.inf))
    report(progress, 1, 1)
    B, _, n, _ = q.shape
    return o.reshape(B, s.H, n, s.Ev), lse.reshape(B, s.H, n)


def _backward(c: Comm, pb: Any, dout: Any, q: Any, k: Any, v: Any, lse: Any, D: Any, mask: Any,
              progress: Progress) -> tuple[Any, Any, Any]:
    xp = backend.array_module(q)
    s = pb.spec
    acc = s.acc_dtype
    B, _, n, E = q.shape
    kw = dict(layout=s.layout, block_size=pb.block)
    S, t, _ = _scores(c, pb, q, k, mask)
    lse5 = lse.astype(acc).reshape(B, s.Hkv, s.G, n)
    lse5 = xp.where(xp.isneginf(lse5), acc.type(np.inf), lse5)
    Pm = xp.exp(S - lse5[..., None])
    do5 = dout.astype(acc).reshape(B, s.Hkv, s.G, n, s.Ev)
    v5 = v.astype(acc)[:, :, None]
    k5 = k.astype(acc)[:, :, None]
    q5 = q.astype(acc).reshape(B, s.Hkv, s.G, n, E)
    dv = matmul_tn(Pm, do5, c, **kw).sum(axis=2)
    dP = matmul_nt(do5, v5, c, **kw)
    dS = Pm * (dP - D.astype(acc).reshape(B, s.Hkv, s.G, n)[..., None])  # D = rowsum(dO * O)
    if t is not None:  # dS *= dy/dx (the transform's)
        pb.mods.transform.chain_(dS, *t)
    dq = s.scale * matmul_nn(dS, k5, c, **kw)
    dk = s.scale * matmul_tn(dS, q5, c, **kw).sum(axis=2)
    report(progress, 1, 1)
    return dq.reshape(B, s.H, n, E), dk, dv


def _mixed(pb: Any) -> bool:
    return layout_key(pb.spec.layout) != layout_key(pb.spec.kv_layout)


def _moved(c: Comm, pb: Any, rows: dict[str, Any], back: bool = False) -> dict[str, Any]:
    """Arrays (row axis -2) between the call's layouts and the contiguous one (None passes)."""
    s = pb.spec
    out = {}
    for name, x in rows.items():
        n, lay = (s.M, s.kv_layout) if name in ("k", "v", "mask", "dk", "dv") else (s.N, s.layout)
        src, dst = ("contiguous", lay) if back else (lay, "contiguous")
        out[name] = None if x is None else relayout_rows(c, x, n, src, dst)
    return out


def _contiguous(c: Comm, pb: Any) -> Any:
    """``pb`` relaid to the contiguous layout, the modifiers' per-row data moved with the queries."""
    out = pb.relaid("contiguous")
    mods = pb.mods
    if mods is None or not mods.has_rows:
        return out
    return replace(out, mods=mods.with_rows(
        lambda m: relayout_rows(c, m, pb.spec.N, pb.spec.layout, "contiguous"), mods.mask_head0))


class Materialized(Strategy):
    """The thesis' products (see the module docstring); never chosen by ``auto``."""

    name = "materialized"
    auto = False
    uses_engine = False

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        m = spec.M / P
        a = spec.acc_dtype.itemsize
        # forward: K round the ring (nt), then V (nn); backward: K (nt), V (nt), K (nn), and
        # the two tn reduce-scatters of dV and dK, G query heads each before their sum
        E, Ev, G = spec.E, spec.Ev, spec.G
        per_row = 2 * E + Ev + G * (E + Ev) if backward else E + Ev
        words = spec.B * spec.Hkv * per_row * m
        return [ring_phase(topology, range(P), words * a, P - 1, 5 if backward else 2)]

    def work(self, spec: Any, topology: Any, row_pairs: Any) -> float:
        """Every score is computed, visible or not: the share of the rows."""
        return max(local_lengths(spec.N, topology.P, spec.layout)) / max(spec.N, 1)

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        a = np.dtype(spec.acc_dtype).itemsize
        n, m = -(-spec.N // P), -(-spec.M // P)
        q_row, o_row = spec.B * spec.H * spec.E, spec.B * spec.H * spec.Ev
        kv_row = spec.B * spec.Hkv * (spec.E + spec.Ev)
        inputs = spec.itemsize * (n * q_row + m * kv_row)
        out_lse = spec.itemsize * n * o_row + a * spec.B * spec.H * n
        scores = a * spec.B * spec.H * n * spec.M
        if not backward:
            return int(inputs + out_lse + 3 * scores + a * n * (q_row + o_row))
        return int(inputs + out_lse + spec.itemsize * n * o_row + 4 * scores
                   + a * (2 * n * q_row + 2 * m * kv_row * spec.G))

    def forward(self, c: Comm, pb: Any, q: Any, k: Any, v: Any, mask: Any,
                progress: Progress) -> tuple[Any, Any]:
        """Forward through the products: ``out (B, H, n_r, Ev)``, ``lse (B, H, n_r)``."""
        if not _mixed(pb):
            return _forward(c, pb, q, k, v, mask, progress)
        m = _moved(c, pb, {"q": q, "k": k, "v": v, "mask": None if mask is None else mask[:, :, None]})
        mask_c = None if mask is None else m["mask"][..., 0]
        o, lse = _forward(c, _contiguous(c, pb), m["q"], m["k"], m["v"], mask_c, progress)
        back = _moved(c, pb, {"out": o, "lse": lse[..., None]}, back=True)
        return back["out"], back["lse"][..., 0]

    def backward(self, c: Comm, pb: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
        """Gradients through the products' closure: ``dq``, ``dk``, ``dv``."""
        if not _mixed(pb):
            return _backward(c, pb, dout, q, k, v, lse, D, mask, progress)
        m = _moved(c, pb, {"dout": dout, "q": q, "k": k, "v": v, "lse": lse[..., None],
                           "D": D[..., None], "mask": None if mask is None else mask[:, :, None]})
        mask_c = None if mask is None else m["mask"][..., 0]
        dq, dk, dv = _backward(c, _contiguous(c, pb), m["dout"], m["q"], m["k"], m["v"],
                               m["lse"][..., 0], m["D"][..., 0], mask_c, progress)
        back = _moved(c, pb, {"dq": dq, "dk": dk, "dv": dv}, back=True)
        return back["dq"], back["dk"], back["dv"]
