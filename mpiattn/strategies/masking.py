"""The mask keywords of a call: sliding window, document ids, the key layout.

Checked locally on every rank (inside the validation allgather of
:mod:`mpiattn.strategies.problem`, so a bad argument raises the same error
everywhere), then completed collectively: the document ids of every rank are
gathered once, as host int64 arrays in global order, so that every key/value
block, wherever it comes from (ring, all-gather, all-to-all), finds its ids
by its global positions, and tiles can be classified on the host without
touching the device. Memory: ``B (N + M)`` int64 words per rank, small
beside the ``B Hkv M (E + Ev)`` words of the keys and values.

Rules (global positions, top-left aligned like ``causal``)::

    window (left, right):  i - left <= j <= i + right   (None: unbounded side)
    documents:             segment_ids[b, i] == kv_segment_ids[b, j]
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend, kernels
from ..balancing import check_window
from ..comm.core import Comm
from ..layouts import Layout, check_layout, describe, layout_key, local_lengths, to_global_order

__all__ = ["check_window", "rules_of", "local_meta", "key_layout", "complete", "block_mask",
           "dense_visible"]


def rules_of(causal: bool, window: Any, segment_ids: Any, key_padding_mask: Any) -> tuple[str, ...]:
    """The active mask rules of a call, in :data:`mpiattn.kernels.masks.RULES` order."""
    on = {"causal": bool(causal), "window": window is not None and tuple(window) != (None, None),
          "segments": segment_ids is not None, "padding": key_padding_mask is not None}
    return tuple(r for r in kernels.masks.RULES if on[r])


def _host_ids(name: str, ids: Any, shape: tuple[int, int], xp: Any) -> np.ndarray:
    try:
        mod = backend.array_module(ids)
    except TypeError:
        raise TypeError(f"{name} must be an integer array of shape (B, rows) = {shape}, got "
                        f"{type(ids).__name__}") from None
    if mod is not np and mod is not xp:
        raise TypeError(f"{name} is a {mod.__name__} array but q, k, v are {xp.__name__} arrays")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (document ids), got dtype {ids.dtype}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape (B, rows) = {shape}, got {tuple(ids.shape)}")
    return np.ascontiguousarray(backend.to_host(ids)).astype(np.int64, copy=False)


def local_meta(window: Any, segment_ids: Any, kv_segment_ids: Any, kv_layout: Any,
               B: int, n: int, m: int, xp: Any, ids_out: dict) -> tuple:
    """This rank's checks of the mask keywords; the part of the metadata every rank must share.

    ``ids_out`` receives host int64 copies ``"q"`` ``(B, n)`` and ``"k"``
    ``(B, m)`` of the given ids. Returns ``(window, kv_layout key, has
    segment_ids, has kv_segment_ids)``.
    """
    w = check_window(window)
    if kv_layout is not None:
        check_layout(kv_layout)
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' document ids)")
    if segment_ids is not None:
        ids_out["q"] = _host_ids("segment_ids", segment_ids, (B, n), xp)
    if kv_segment_ids is not None:
        ids_out["k"] = _host_ids("kv_segment_ids", kv_segment_ids, (B, m), xp)
    return (w, None if kv_layout is None else layout_key(kv_layout), segment_ids is not None,
            kv_segment_ids is not None)


def _global_ids(c: Comm, ids: np.ndarray, n: int, layout: Any) -> np.ndarray:
    """Every rank's ``(B, n_r)`` ids -> the global ``(B, n)`` ids on every rank (host)."""
    rows = c.allgatherv_rows(np.ascontiguousarray(ids.T), local_lengths(n, c.size, layout))
    return np.ascontiguousarray(to_global_order(rows, n, c.size, layout).T)


def key_layout(pb: Any, layout: Any, kv_layout: Any) -> Any:
    """The keys' layout (``kv_layout``, default ``layout``), checked against M (same error everywhere)."""
    if kv_layout is not None:
        return kv_layout
    if isinstance(layout, Layout) and layout.n != pb.M:
        raise ValueError(f"the layout is an explicit Layout of {layout.n} rows, but the keys have "
                         f"M = {pb.M} rows; pass kv_layout= for the keys")
    return layout


def complete(c: Comm, pb: Any, metas: list, ids: dict, kv_layout: Any) -> Any:
    """The Problem with its mask fields; gathers the document ids (a collective).

    ``metas`` are every rank's :func:`local_meta` tuples (already compared:
    the same on every rank), ``ids`` this rank's host copies, ``kv_layout``
    the keys' layout (see :func:`key_layout`).
    """
    window, _, has_seg, has_kv = metas[0]
    if has_seg and not has_kv and (pb.N != pb.M or layout_key(pb.layout) != layout_key(kv_layout)):
        raise ValueError(
            "kv_segment_ids omitted: the keys take the queries' document ids, which needs N == M "
            f"and one layout for queries and keys (here N = {pb.N}, M = {pb.M}, layouts "
            f"{describe(pb.layout)} and {describe(kv_layout)}); pass kv_segment_ids")
    seg_q = seg_k = None
    if has_seg:
        seg_q = _global_ids(c, ids["q"], pb.N, pb.layout)
        seg_k = _global_ids(c, ids["k"], pb.M, kv_layout) if has_kv else seg_q
    return replace(pb, kv_layout=kv_layout, window=window, seg_q=seg_q, seg_k=seg_k)


def block_mask(pb: Any, q_pos: np.ndarray, k_pos: np.ndarray, pad: Any) -> kernels.BlockMask:
    """The :class:`~mpiattn.kernels.masks.BlockMask` of queries ``q_pos`` against keys ``k_pos``.

    Parameters
    ----------
    pb : Problem
    q_pos, k_pos : (n,), (k,) int64
        Global positions of the queries and of the block's keys.
    pad : (B, k) bool array or None
        The block's key padding (on the keys' device).
    """
    q_seg, summaries = _query_side(pb, q_pos)
    k_seg = None if pb.seg_k is None else pb.seg_k[:, k_pos]
    return kernels.BlockMask(q_pos, k_pos, pb.causal, pad, pb.window, q_seg, k_seg, summaries)


#: The query side of the last :func:`block_mask`: (weak refs to q_pos and the
#: global ids, the queries' ids, their tile summaries). The blocks of one call
#: share them (the same q_pos object); weak references, so nothing is kept alive.
_LAST_QUERIES: list = [None]


def _query_side(pb: Any, q_pos: np.ndarray) -> tuple[np.ndarray | None, dict]:
    last = _LAST_QUERIES[0]
    if last is not None and last[0]() is q_pos and (last[1] is None) == (pb.seg_q is None) \
            and (last[1] is None or last[1]() is pb.seg_q):
        return last[2], last[3]
    q_seg = None if pb.seg_q is None else pb.seg_q[:, q_pos]
    summaries: dict = {}
    _LAST_QUERIES[0] = (weakref.ref(q_pos), None if pb.seg_q is None else weakref.ref(pb.seg_q),
                        q_seg, summaries)
    return q_seg, summaries


def dense_visible(pb: Any, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray | None:
    """Host bool ``(Bs, n, k)`` of the causal, window and document rules, or None when none is active.

    ``Bs`` is ``B`` with document ids, else 1. Padding is not included.
    """
    bm = block_mask(pb, q_pos, k_pos, None)
    if not bm.positional:
        return None
    return bm.visible_pairs(0, q_pos.size, 0, k_pos.size)
