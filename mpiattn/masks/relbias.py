"""A relative-position bias read from a table: the score transform ``y = x + table[h, i - j + offset]``.

Query head ``h`` adds ``table[h, d + offset]`` to the raw score ``x = s q_i . k_j`` of a pair at
distance ``d = i - j`` (global positions), as T5 and many models learn it. Written as a
``score_mod`` the function gathers one table entry per score, which NumPy does at 3-4 ns a
score, about as long as the rest of the attention (``benchmarks/score_modifiers/README.md``).
:class:`RelativeBias` gives the same numbers with no per-score gather. On a tile whose query
positions are a run ``q0 + i`` and key positions a run ``k0 + j``, head ``h``'s bias is the
Toeplitz block

``T[i, j] = table[h, c + i - j]``,  ``c = q0 - k0 + offset``,

which is a strided view of the head's row read backwards: with ``rev[h, m] = table[h, W - 1 - m]``
(kept once per dtype) ``T[i, j] = rev[h, W - 1 - c - i + j]``, strides ``(-1, +1)`` elements, and
the heads of an affine head grid (``h0 + a kv + b g``, every layout here) one more stride each.
Adding it is one pass over the tile, the score's own memory read and written once, no index
array made (:class:`~mpiattn.masks.scoremod.TileGrid` gives the positions as host vectors;
tiles whose positions are not long runs, e.g. an explicit layout out of order, are split into
runs or, for many short ones, read by the gather as a ``score_mod`` would be). On CuPy the
gather runs (one elementwise kernel). Its derivative is ``dy/dx = 1``: the backward's chain rule
costs nothing. No gradient flows to the table (as for ALiBi's slopes); under
``mpiattn.torch`` a ``score_mod`` of torch ops reading a tensor table trains it.

The view reads outside the table for a difference it does not cover, so every tile checks
``q - kv + offset`` against ``[0, W)`` from its positions' extremes and raises IndexError
(where a gather would wrap a negative column silently). A tile is formed whole, pairs the
rules hide included, so the table must cover every difference of the call; the ranks check the
call's extremes when they compare the functions' answers (:func:`~mpiattn.masks.score.agree_answers`),
before any tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import backend
from .scoremod import TileGrid

__all__ = ["RelativeBias", "check_table", "runs", "RUN_AREA"]

#: Scores per pair of position runs below which a tile is read by the gather instead (a run
#: pair costs one NumPy call, about a microsecond; a gathered score 3-4 ns).
RUN_AREA = 256


def check_table(table: Any) -> np.ndarray:
    """``table`` as a read-only host float64 ``(H, W)`` copy of finite real numbers (else
    TypeError/ValueError)."""
    a = backend.to_host(table)
    if a.dtype.kind != "f" and not backend.is_bfloat16(a.dtype):
        raise TypeError(f"RelativeBias's table must hold real floating-point numbers, got dtype {a.dtype}")
    if a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"RelativeBias's table must have shape (H, W) (a row of W columns per "
                         f"query head), got {a.shape}")
    a = np.array(a, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError("RelativeBias's table must hold finite numbers")
    a.setflags(write=False)
    return a


def runs(pos: np.ndarray) -> list[tuple[int, int]]:
    """``[(a, b), ...]``: the index ranges of ``pos`` whose values go up by one (``pos[a:b]`` is
    ``pos[a] + arange(b - a)``), in order, covering ``pos``."""
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *cuts.tolist(), int(pos.size)]
    return list(zip(edges[:-1], edges[1:]))


def _head_blocks(heads: np.ndarray) -> list[tuple[slice, slice, int, int, int]]:
    """``[(kv slice, g slice, h0, a, b)]``: ``heads[kv, g] = h0 + a kv + b g`` on each block (one
    block for an affine grid, else one per head)."""
    Hkv, G = heads.shape
    h0 = int(heads[0, 0])
    a = int(heads[1, 0]) - h0 if Hkv > 1 else 0
    b = int(heads[0, 1]) - h0 if G > 1 else 0
    if np.array_equal(heads, h0 + a * np.arange(Hkv)[:, None] + b * np.arange(G)[None, :]):
        return [(slice(None), slice(None), h0, a, b)]
    return [(slice(kv, kv + 1), slice(g, g + 1), int(heads[kv, g]), 0, 0)
            for kv in range(Hkv) for g in range(G)]


@dataclass(frozen=True, eq=False, repr=False)
class RelativeBias:
    """The score transform ``y = x + table[h, q_idx - kv_idx + offset]`` (the module docstring).

    Parameters
    ----------
    table : array, shape (H, W)
        One row per query head, real and finite (NumPy, CuPy or anything ``numpy.asarray``
        takes; kept as a host float64 copy, cast to the scores' dtype where it is used).
    offset : int
        The column of distance 0: the table covers ``q_idx - kv_idx`` from ``-offset`` to
        ``W - 1 - offset``.

    Notes
    -----
    The same numbers as ``ScoreMod(lambda s, b, h, i, j: s + table[h, i - j + offset],
    lambda s, b, h, i, j: np.ones_like(s))`` (bit for bit in float64; float32 scores add the
    table rounded to float32), with no gather on NumPy. In ``KVCache.prefill`` and decode the
    query positions are absolute, as for any ``score_mod``.

    Examples
    --------
    >>> import numpy as np
    >>> import mpiattn
    >>> N, H = 64, 2
    >>> bias = mpiattn.RelativeBias(0.1 * np.ones((H, 2 * N - 1)), offset=N - 1)  # every i - j
    >>> s = np.zeros((1, H, 2, 3))
    >>> idx = np.ix_(np.arange(1), np.arange(H), np.arange(2), np.arange(3))
    >>> bias(s, *idx).shape
    (1, 2, 2, 3)
    """

    table: Any
    offset: int = 0

    #: The backward needs nothing from the caller (``dy/dx = 1``).
    differentiable = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "table", check_table(self.table))
        if isinstance(self.offset, (bool, np.bool_)) or not isinstance(self.offset, (int, np.integer)):
            raise TypeError(f"RelativeBias's offset must be an integer, got {self.offset!r}")
        object.__setattr__(self, "offset", int(self.offset))
        object.__setattr__(self, "_tables", {})  # (module, dtype[, device]) -> the table there

    def __repr__(self) -> str:
        H, W = self.table.shape
        return f"RelativeBias(table=<{H} x {W}>, offset={self.offset})"

    # ----------------------------------------------------------------- the checks
    def check_heads(self, H: int) -> None:
        """ValueError unless the table has one row per query head of the call (``H``)."""
        if self.table.shape[0] != H:
            raise ValueError(f"RelativeBias's table has {self.table.shape[0]} rows, one per query "
                             f"head: the call has H = {H}")

    def _check_span(self, d_lo: int, d_hi: int) -> None:
        """IndexError unless ``q_idx - kv_idx + offset`` lies in ``[0, W)`` for ``q_idx - kv_idx``
        from ``d_lo`` to ``d_hi``."""
        W = self.table.shape[1]
        lo, hi = d_lo + self.offset, d_hi + self.offset
        if lo < 0 or hi >= W:
            raise IndexError(
                f"RelativeBias reads table[h, q_idx - kv_idx + offset] at columns {lo} to {hi} "
                f"(offset {self.offset}), outside its {W} columns: q_idx - kv_idx runs from "
                f"{d_lo} to {d_hi} here, and every pair's is read (tiles are formed "
                "whole, hidden pairs included): give a table and offset covering every q_idx - "
                "kv_idx of the call (offset >= M - 1 and W >= offset + N; positions are absolute "
                "in prefill and decode)")

    def _check_heads_in(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.table.shape[0]:
            raise IndexError(f"RelativeBias's table has {self.table.shape[0]} rows; the tile asks "
                             f"query heads {lo} to {hi}")

    # ----------------------------------------------------------------- the tables
    def _on(self, xp: Any, dtype: Any) -> Any:
        """The table on ``xp``'s device in ``dtype`` (kept)."""
        dtype = np.dtype(dtype if np.dtype(dtype).kind == "f" else np.float64)
        key = (xp.__name__, dtype.str) + (() if xp is np else (int(xp.cuda.Device().id),))
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = backend.to_device(self.table.astype(dtype), xp)
        return got

    def _reversed(self, dtype: Any) -> np.ndarray:
        """``rev[h, m] = table[h, W - 1 - m]``, host, C-contiguous, in ``dtype`` (kept)."""
        key = ("reversed", np.dtype(dtype).str)
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = np.ascontiguousarray(self.table[:, ::-1], dtype=dtype)
        return got

    # ----------------------------------------------------------------- the formula
    def fn(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``score + table[h, q_idx - kv_idx + offset]`` on broadcasting arrays (NumPy or CuPy):
        the plain formula (the dense reference's, and the ranks' sample), IndexError where a
        column falls outside the table."""
        if not (isinstance(score, np.ndarray) or backend.is_cupy_array(score)):
            raise TypeError(f"RelativeBias works on NumPy or CuPy scores, got {type(score).__name__}: "
                            "under mpiattn.torch write the score_mod with torch ops "
                            "(s + table[h, q_idx - kv_idx + offset] on a tensor table)")
        xp = backend.array_module(score)
        d = q_idx - kv_idx
        if d.size:
            self._check_span(int(d.min()), int(d.max()))
        return score + self._on(xp, score.dtype)[h, d + self.offset]

    __call__ = fn

    def grad(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``d y / d x = 1`` (the score's shape)."""
        return backend.array_module(score).ones_like(score)

    def shifted(self, offset: int) -> "RelativeBias":
        """The bias given query positions ``q_idx + offset``: the same table, ``offset`` more."""
        return RelativeBias(self.table, self.offset + int(offset))

    # ----------------------------------------------------------------- the transform
    def _add(self, S: Any, out: Any, at: Any) -> Any:
        """``out <- S + bias`` (``out`` may be ``S``); returns ``out``."""
        if S.size == 0:
            return out
        grid: TileGrid | None = getattr(at, "grid", None)
        if grid is not None:
            q, k = grid.q_pos, grid.k_pos
            self._check_span(int(q.min()) - int(k.max()), int(q.max()) - int(k.min()))
            self._check_heads_in(int(grid.heads.min()), int(grid.heads.max()))
            if isinstance(S, np.ndarray) and self._strided(S, out, grid):
                return out
        b, h, q_idx, kv_idx = at.arrays()
        d = q_idx - kv_idx
        if grid is None:
            self._check_span(int(d.min()), int(d.max()))
        xp = backend.array_module(S)
        return xp.add(S, self._on(xp, S.dtype)[h, d + self.offset], out=out)

    def _strided(self, S: np.ndarray, out: np.ndarray, grid: TileGrid) -> bool:
        """``out <- S + bias`` by Toeplitz views, run pair by run pair; False (nothing done) when
        the tile's layout is not the grid's or its runs are too short."""
        S5, out5 = grid.split(S), grid.split(out)
        if S5 is None or out5 is None:
            return False
        q, k = grid.q_pos, grid.k_pos
        q_runs, k_runs = runs(q), runs(k)
        if len(q_runs) * len(k_runs) * RUN_AREA > max(q.size * k.size, RUN_AREA):
            return False
        rev = self._reversed(S.dtype)
        W, s = rev.shape[1], rev.itemsize
        flat = rev.reshape(-1)
        blocks = _head_blocks(grid.heads)
        Hkv, G = grid.heads.shape
        for i0, i1 in q_runs:
            for j0, j1 in k_runs:
                c0 = W - 1 - (int(q[i0]) - int(k[j0]) + self.offset)  # rev's column of T[0, 0]
                for kvs, gs, h0, a, bb in blocks:
                    shape = (len(range(Hkv)[kvs]), len(range(G)[gs]), i1 - i0, j1 - j0)
                    T = as_strided(flat[h0 * W + c0:], shape, (a * W * s, bb * W * s, -s, s),
                                   writeable=False)
                    np.add(S5[:, kvs, gs, i0:i1, j0:j1], T, out=out5[:, kvs, gs, i0:i1, j0:j1])
        return True

    def forward_(self, S: Any, at: Any) -> Any:
        """``S <- S + bias`` in place; returns ``S``."""
        return self._add(S, S, at)

    def saving_(self, S: Any, out: Any, at: Any) -> Any:
        """``out <- S + bias`` (nothing to keep: the derivative is 1); returns ``out``."""
        return self._add(S, out, at)

    def chain_(self, dS: Any, saved: Any, at: Any) -> Any:
        """``dS <- dS * 1``: nothing to do; returns ``dS``."""
        return dS
