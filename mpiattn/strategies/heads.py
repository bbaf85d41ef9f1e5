"""Inside a group of ranks: rows of every head to heads of every row, and back (all-to-all).

Each member ``i`` of a group holds its rows (``n_i`` of them) of every head;
member ``j`` is to hold some heads (``heads[j]``) of the group's rows, in
member order (member 0's rows, then member 1's, ...). :func:`to_heads` does
that in one all-to-all; :func:`to_rows` undoes it, adding up what two members
held of one head (a key/value head replicated in a group: its gradients).

:func:`shares` splits ``H`` query heads over ``u`` members for any ``H >= u`` and any
``Hkv`` (DeepSpeed-Ulysses with uneven heads; LoongTrain's replicated key/value heads):
member ``j`` gets query heads ``[j H // u, (j + 1) H // u)`` (the counts differ by at most
one) and every key/value head they use (``h // (H / Hkv)``), so a key/value head used by
two members goes to both. Where a member's query heads do not use its key/value heads in
the engine's uniform grouping (query head ``i`` with key/value head ``i // G``), it gives
its engine one key/value head per query head (:meth:`Share.expand`, a local copy) and sums
their gradients back (:meth:`Share.fold`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import backend

__all__ = ["to_heads", "to_rows", "Share", "shares"]


@dataclass(frozen=True)
class Share:
    """One member's heads (:func:`shares`).

    Attributes
    ----------
    q : range
        Its query heads (global indices, consecutive).
    kv : range
        The key/value heads they use (global, consecutive): what it receives.
    G : int
        Query heads per key/value head (``H / Hkv``).
    """

    q: range
    kv: range
    G: int

    @property
    def uses(self) -> list[int]:
        """For each of its query heads, the index in ``kv`` of the key/value head it uses."""
        return [h // self.G - self.kv.start for h in self.q]

    @property
    def grouped(self) -> bool:
        """Its query heads use ``kv`` in the engine's grouping (local query head ``i`` with
        local key/value head ``i // (len(q) / len(kv))``): each of its key/value heads serves
        as many of its query heads (decided from the first and last one's counts: the others
        serve ``G``)."""
        first = min(len(self.q), self.G - self.q.start % self.G)
        last = len(self.q) - first - self.G * max(len(self.kv) - 2, 0) if len(self.kv) > 1 else first
        return first == last and (len(self.kv) <= 2 or first == self.G)

    @property
    def kv_width(self) -> int:
        """Key/value heads its engine sees: ``len(kv)``, or one per query head when not grouped."""
        return len(self.kv) if self.grouped else len(self.q)

    def expand(self, x: Any) -> Any:
        """``(B, len(kv), L, F)`` -> what its engine reads: itself when grouped, else one
        key/value head per query head ``(B, len(q), L, F)`` (a copy)."""
        return x if self.grouped else x[:, self.uses]

    def fold(self, dx: Any) -> Any:
        """Inverse of :meth:`expand` for gradients: ``(B, kv_width, L, F)`` -> ``(B, len(kv), L, F)``,
        the parts of one key/value head summed."""
        if self.grouped:
            return dx
        xp = backend.array_module(dx)
        out = xp.zeros((dx.shape[0], len(self.kv)) + tuple(dx.shape[2:]), dtype=dx.dtype)
        for i, u in enumerate(self.uses):
            out[:, u] += dx[:, i]
        return out


def shares(H: int, Hkv: int, u: int) -> tuple[Share, ...]:
    """The heads of each of ``u`` members (module docstring); ValueError when ``H < u`` (a member
    would hold no head). ``O(u)``, whatever ``H``."""
    if H < u:
        raise ValueError(f"{H} query heads cannot be split over {u} ranks (each needs one)")
    G = H // Hkv
    out = []
    for j in range(u):
        q = range(j * H // u, (j + 1) * H // u)
        out.append(Share(q, range(q[0] // G, q[-1] // G + 1), G))
    return tuple(out)


def to_heads(g: Any, x: Any, heads: Sequence[Sequence[int]], rows: Sequence[int]) -> Any:
    """``(B, Hx, n_me, F)`` this member's rows -> ``(B, len(heads[me]), sum(rows), F)``.

    Parameters
    ----------
    g : Comm
        The group.
    x : array, shape (B, Hx, rows[me], F)
    heads : one index list per member
        The heads (of ``Hx``) each member is to hold (their counts may differ).
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
