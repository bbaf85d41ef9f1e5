"""Exact merge of partial attention results, and its tree reduction over the ranks.

A rank that attended a subset of the keys holds, per query row, a partial
``(o, lse)``: ``o`` normalised over those keys, ``lse`` the log of their
softmax denominator (``-inf`` when it saw none). Two partials over disjoint
key sets combine exactly (``docs/architecture.md``, the math; FlashAttention's
block merge)::

    lse = max(lse_a, lse_b) + log(exp(lse_a - max) + exp(lse_b - max))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b      (both -inf: o = 0, lse = -inf)

A partial that is NaN (or +inf: a key of infinite score, allowed only with
``check_finite=False``) makes the merge NaN, as one process attending every
key gives: the result does not depend on how the keys were split.

:func:`merge` is symmetric bit for bit (``merge(a, b) == merge(b, a)``) but,
rounded, not associative, so :func:`tree_merge` fixes the association: a
binomial tree to rank 0 (rank ``r`` merges what ``r + d`` sends, ``d = 1, 2,
4, ...``), then a binomial broadcast of rank 0's bytes. Each rank sends one
message of ``rows x (Ev + 1)`` words (``o`` and ``lse`` packed in one
buffer) and receives one copy of the result: ``2 ceil(log2 P)`` steps, never
a ring (tree attention, Zyphra 2024). The result is bitwise identical on
every rank and from run to run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..comm.core import Comm

__all__ = ["merge", "pack", "unpack", "tree_merge", "REDUCE_TAG", "BCAST_TAG"]

#: Message tags of the tree (on mpiattn's own duplicated communicator).
REDUCE_TAG, BCAST_TAG = 7411, 7412


def merge(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """The exact merge of two partials over disjoint key sets (arrays of one backend).

    Parameters
    ----------
    o_a, o_b : arrays, shape (..., Ev)
    lse_a, lse_b : arrays, shape (...)
        Same dtype (the accumulation dtype).

    Returns
    -------
    (o, lse) : new arrays, shapes (..., Ev) and (...)
    """
    xp = backend.array_module(o_a, o_b)
    m = xp.maximum(lse_a, lse_b)  # (NaN where either is NaN)
    seen = xp.isfinite(m)
    base = xp.where(seen, m, 0)
    wa, wb = xp.exp(lse_a - base), xp.exp(lse_b - base)
    total = wa + wb
    safe = xp.where(seen, total, 1)
    empty = xp.where(m == -np.inf, 0, np.nan)  # no key on either side, or a NaN / +inf partial
    lse = xp.where(seen, base + xp.log(safe), xp.where(m == -np.inf, -np.inf, np.nan))
    lse = lse.astype(lse_a.dtype, copy=False)
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / safe[..., None]
    o = xp.where(seen[..., None], o, empty[..., None]).astype(o_a.dtype, copy=False)
    return o, lse


def pack(o: Any, lse: Any) -> Any:
    """``o (..., Ev)`` and ``lse (...)`` as one contiguous ``(rows, Ev + 1)`` buffer, ``lse`` first."""
    xp = backend.array_module(o)
    Ev = o.shape[-1]
    buf = xp.empty((int(np.prod(lse.shape, dtype=np.int64)), Ev + 1), dtype=o.dtype)
    buf[:, 0] = lse.reshape(-1)
    buf[:, 1:] = o.reshape(-1, Ev)
    return buf


def unpack(buf: Any, shape: tuple) -> tuple[Any, Any]:
    """Inverse of :func:`pack`: ``(o (*shape, Ev), lse shape)`` (views of ``buf``)."""
    Ev = buf.shape[1] - 1
    return buf[:, 1:].reshape(tuple(shape) + (Ev,)), buf[:, 0].reshape(tuple(shape))


def tree_merge(c: Comm, o: Any, lse: Any) -> tuple[Any, Any]:
    """Merge every rank's partial ``(o, lse)`` (the same shapes everywhere) into the whole result.

    Collective: every rank of ``c`` calls it with its partial over its own
    keys. Returns ``(o, lse)`` in the partials' dtype, bitwise identical on
    every rank (see the module docstring for the tree and its messages).
    """
    shape = tuple(lse.shape)
    if c.size == 1:
        return o, lse
    c.point("tree_merge")
    xp = backend.array_module(o)
    buf = pack(o, lse)
    spare = xp.empty_like(buf)
    P, r = c.size, c.rank
    d = 1
    while d < P:  # reduce: the lowest rank of each pair of subtrees keeps the merge
        if r % (2 * d):
            c.isend(buf, r - d, REDUCE_TAG).wait()
            break
        if r + d < P:
            c.irecv(spare, r + d, REDUCE_TAG).wait()
            mo, ml = merge(*unpack(buf, shape), *unpack(spare, shape))
            buf = pack(mo, ml)
        d *= 2
    top = 1
    while top < P:
        top *= 2
    d = top // 2
    while d >= 1:  # broadcast rank 0's bytes down the same tree
        if r % (2 * d) == 0 and r + d < P:
            c.isend(buf, r + d, BCAST_TAG).wait()
        elif r % (2 * d) == d:
            c.irecv(buf, r - d, BCAST_TAG).wait()
        d //= 2
    o_out, lse_out = unpack(buf, shape)
    return xp.ascontiguousarray(o_out), xp.ascontiguousarray(lse_out)
