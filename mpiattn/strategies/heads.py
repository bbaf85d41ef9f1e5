"""Inside a group of ranks: rows of every head to heads of every row, and back (all-to-all).

Each member ``i`` of a group holds its rows (``n_i`` of them) of every head;
member ``j`` is to hold some heads (``heads[j]``) of the group's rows, in
member order (member 0's rows, then member 1's, ...). :func:`to_heads` does
that in one all-to-all; :func:`to_rows` undoes it, adding up what two members
held of one head (a key/value head replicated in a group: its gradients).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import backend

__all__ = ["to_heads", "to_rows"]


def to_heads(g: Any, x: Any, heads: Sequence[Sequence[int]], rows: Sequence[int]) -> Any:
    """``(B, Hx, n_me, F)`` this member's rows -> ``(B, len(heads[me]), sum(rows), F)``.

    Parameters
    ----------
    g : Comm
        The group.
    x : array, shape (B, Hx, rows[me], F)
    heads : one index list per member
        The heads (of ``Hx``) each member is to hold; all of one length.
    rows : one int per member
        Every member's row count.
    """
    xp = backend.array_module(x)
    B, _, n, F = x.shape
    h = len(heads[g.rank])
    parts = [xp.ascontiguousarray(x[:, list(hs)]).reshape(-1, F) for hs in heads]
    send = xp.concatenate(parts, axis=0) if parts else xp.empty((0, F), dtype=x.dtype)
    got = g.alltoallv_rows(send, [B * len(hs) * n for hs in heads], [B * h * r for r in rows])
    blocks, pos = [], 0
    for r in rows:
        blocks.append(got[pos:pos + B * h * r].reshape(B, h, r, F))
        pos += B * h * r
    return xp.concatenate(blocks, axis=2) if blocks else xp.empty((B, h, 0, F), dtype=x.dtype)


def to_rows(g: Any, y: Any, heads: Sequence[Sequence[int]], rows: Sequence[int], Hx: int) -> Any:
    """Inverse of :func:`to_heads`: ``(B, len(heads[me]), sum(rows), F)`` -> ``(B, Hx, rows[me], F)``.

    A head that several members held comes back as the sum of their parts.
    """
    xp = backend.array_module(y)
    B, h, _, F = y.shape
    me = g.rank
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(int)
    parts = [xp.ascontiguousarray(y[:, :, starts[i]:starts[i + 1]]).reshape(-1, F)
             for i in range(len(rows))]
    send = xp.concatenate(parts, axis=0) if parts else xp.empty((0, F), dtype=y.dtype)
    n = rows[me]
    got = g.alltoallv_rows(send, [B * h * r for r in rows], [B * len(hs) * n for hs in heads])
    out = xp.zeros((B, Hx, n, F), dtype=y.dtype)
    pos = 0
    for hs in heads:
        block = got[pos:pos + B * len(hs) * n].reshape(B, len(hs), n, F)
        pos += B * len(hs) * n
        for a, head in enumerate(hs):
            out[:, head] += block[:, a]
    return out
