"""How many pairs a call computes when an ``attn_mask`` or ``mask_mod`` hides some: counted.

The causal and window rules hide a band, counted by arithmetic
(:meth:`mpiattn.masks.MaskSpec.keys_per_row`); documents by sorting
(:func:`mpiattn.balancing.row_work`). A mask given as an array or a function
has no such shortcut: its visible pairs are counted by evaluating it, rows in
chunks, together with every rule. Two uses:

* :func:`visible_keys`: the visible keys of each query row, the mean over the
  batch entries and heads (the cost model's ``row_pairs``, the balancer's
  work); with ``key_step > 1`` every ``key_step``-th key only, scaled (an
  estimate in ``1/key_step`` of the time, for the planner of a long call);
* :func:`visible_tiles`: how many ``T x T`` tiles of each block of ``T``
  query rows hold a visible pair of some batch entry or head (what the
  kernels compute; a tile with none is skipped).

Host NumPy only; no communication.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .modifiers import Modifiers
from .spec import MaskSpec

__all__ = ["visible_keys", "visible_tiles", "key_step_for", "CHUNK"]

#: Entries (batch x heads x rows x keys) evaluated at once.
CHUNK = 2**22


def key_step_for(rows: int, m: int, mods: Modifiers | None, limit: int) -> int:
    """The smallest key stride that keeps ``rows x m`` pairs (times the mask's batch and head
    extents) at or below ``limit`` evaluations."""
    per_pair = 1 if mods is None else max(mods.cost(1, mods.H), 1)
    return max(1, -(-int(rows) * int(m) * per_pair // max(int(limit), 1)))


def _chunks(mask: MaskSpec, mods: Modifiers | None, q_pos: np.ndarray, rows: np.ndarray, m: int,
            k_pos: np.ndarray, seg_q: Any, seg_k: Any, align: int = 1) -> Iterator[tuple]:
    """``(start, ok)`` for chunks of the queries: ``ok`` bool ``(Bx, Hx, r, k)``, True where every
    rule and modifier lets query ``q_pos[start + a]`` see key ``k_pos[b]``."""
    n = q_pos.size
    if n == 0:
        return
    jlo, jhi = mask.key_ranges(int(q_pos.max()) + 1, m)
    jlo, jhi = jlo[q_pos], jhi[q_pos]
    H = 1 if mods is None else mods.H
    per_row = max(k_pos.size, 1) * (1 if mods is None else max(mods.cost(1, H), 1))
    if seg_q is not None:
        per_row *= seg_q.shape[0]
    step = max(align, (CHUNK // per_row) // align * align)
    for a in range(0, n, step):
        b = min(n, a + step)
        ok = (k_pos[None, :] >= jlo[a:b, None]) & (k_pos[None, :] <= jhi[a:b, None])
        ok = ok[None, None]
        if mods is not None:
            hidden = mods.visible(np.arange(H), rows[a:b], q_pos[a:b], k_pos)
            if hidden is not None:
                ok = ok & hidden
        if seg_q is not None:
            ok = ok & (seg_q[:, None, q_pos[a:b], None] == seg_k[:, None, None, k_pos])
        yield a, ok


def visible_keys(mask: MaskSpec, mods: Modifiers | None, q_pos: Any, m: int, *,
                 rows: Any = None, seg_q: Any = None, seg_k: Any = None,
                 key_step: int = 1) -> np.ndarray:
    """The keys each query sees, the mean over batch entries and heads, float64 ``(n,)``.

    Parameters
    ----------
    mask : MaskSpec
        The rules (causal, window and their diagonal).
    mods : Modifiers or None
        The ``attn_mask`` rows (``rows`` index them) and ``mask_mod`` of these queries.
    q_pos : (n,) int array
        Global positions of the queries.
    m : int
        Keys, ``0 .. m-1``.
    rows : (n,) int array, optional
        Each query's row of ``mods.attn_mask`` (default ``0 .. n-1``).
    seg_q, seg_k : (B, N) and (B, M) int arrays, optional
        Document ids (global), when documents count too.
    key_step : int
        Evaluate every ``key_step``-th key only and scale the count by it (1: exact).
    """
    q_pos = np.asarray(q_pos, dtype=np.int64)
    rows = np.arange(q_pos.size) if rows is None else np.asarray(rows, dtype=np.int64)
    step = max(int(key_step), 1)
    k_pos = np.arange(step // 2 if step > 1 else 0, int(m), step, dtype=np.int64)
    out = np.zeros(q_pos.size, dtype=np.float64)
    for a, ok in _chunks(mask, mods, q_pos, rows, m, k_pos, seg_q, seg_k):
        out[a:a + ok.shape[2]] = ok.sum(axis=3, dtype=np.int64).mean(axis=(0, 1)) * step
    return out


def visible_tiles(mask: MaskSpec, mods: Modifiers | None, n: int, m: int, T: int, *,
                  seg_q: Any = None, seg_k: Any = None) -> np.ndarray:
    """Of every block of ``T`` query rows (global ``0 .. n-1``, ``mods`` holding all ``n`` rows):
    how many ``T x T`` key tiles hold a pair visible to some batch entry and head, int64
    ``(ceil(n / T),)``."""
    q_pos = np.arange(int(n), dtype=np.int64)
    k_pos = np.arange(int(m), dtype=np.int64)
    nb, nkb = -(-int(n) // T), -(-int(m) // T)
    out = np.zeros(nb, dtype=np.int64)
    for a, ok in _chunks(mask, mods, q_pos, q_pos, m, k_pos, seg_q, seg_k, align=T):
        seen = ok.any(axis=(0, 1))
        r = seen.shape[0]
        pad = np.zeros((-(-r // T) * T, nkb * T), dtype=bool)
        pad[:r, :seen.shape[1]] = seen
        tiles = pad.reshape(-1, T, nkb, T).any(axis=(1, 3))
        out[a // T:a // T + tiles.shape[0]] = tiles.sum(axis=1)
    return out
