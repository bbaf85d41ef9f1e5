"""User score functions: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied tile by tile.

A *score transform* is an elementwise ``y = f(x, b, h, i, j)`` of a pair's raw score
``x = s q_i . k_j`` (after the scale), before the additive terms (ALiBi, a float
``attn_mask``) and the rules' ``-inf``; its backward multiplies ``dS`` by ``dy/dx``
(``docs/scores.md``). The kernels ask :attr:`mpiattn.masks.Modifiers.transform` for one
object and call its three methods on each score tile, in place:

``forward_(S, at)``
    ``S <- f(S)`` (a forward that keeps nothing);
``saving_(S, out, at)``
    ``out <- f(S)``, ``S`` left holding what the chain rule needs;
``chain_(dS, saved, at)``
    ``dS <- dS * dy/dx`` from what ``saving_`` left.

``at`` is a :class:`TileIndex`: the tile's global batch entries, query heads, query and key
positions as integer arrays that broadcast against ``S`` (made on first use, so a transform
that reads none, as :class:`~mpiattn.masks.softcap.Softcap`, costs nothing for them). Their
shapes follow the engine's layout of the tile (e.g. ``(B, Hkv, rows x G, keys)`` with the
query heads of a key/value head folded into the rows), so a ``score_mod`` must be
elementwise: it may index tables with them (``bias[h, q_idx - kv_idx]``), never reshape.
Where the kernels know the tile's layout, ``at.grid`` also describes it (a :class:`TileGrid`:
the heads, the rows' and the keys' positions as short host vectors), for a transform that
works on whole runs of positions instead of index arrays
(:class:`~mpiattn.masks.relbias.RelativeBias`); else it is None.

:class:`ScoreMod` is a user's transform on NumPy or CuPy arrays: the function and its
derivative with respect to the score (``mpiattn.torch`` differentiates a function written
with torch ops by autograd instead). The same function gives the same result on every
strategy, engine and rank count, since the indices are global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import backend

__all__ = ["ScoreMod", "TileIndex", "TileGrid", "check_score_mod", "shift_score_mod", "PIECE"]

#: Scores of a tile a :class:`ScoreMod`'s function is given at once on the host: the function
#: is elementwise, so a tile in row pieces gives the same answer, and its temporaries stay in
#: the core's cache instead of streaming whole tiles through memory (measured in
#: benchmarks/score_modifiers).
PIECE = 1 << 15


@dataclass(frozen=True, eq=False)
class TileGrid:
    """The layout of one score tile in the engine's memory, for transforms that read positions
    as runs (no index arrays are made).

    Attributes
    ----------
    heads : (Hkv, G) int64 host array
        The global query head of each key/value head's ``g``-th member.
    q_pos, k_pos : 1-D int64 host arrays
        The global positions of the tile's query rows and keys.
    folded : bool
        The tile is ``(B, Hkv, r * G, k)`` with row ``i * G + g`` holding query ``q_pos[i]`` of
        head ``heads[kv, g]`` (the native engine); else ``(B, Hkv, G, r, k)`` (materialized).
    """

    heads: np.ndarray
    q_pos: np.ndarray
    k_pos: np.ndarray
    folded: bool = True

    def split(self, S: Any) -> Any:
        """``S`` (NumPy) as a ``(B, Hkv, G, r, k)`` view of the same memory (writes reach ``S``), or
        None when its shape is not this grid's."""
        Hkv, G = self.heads.shape
        r, k = self.q_pos.size, self.k_pos.size
        if not self.folded:
            return S if S.ndim == 5 and S.shape[1:] == (Hkv, G, r, k) else None
        if S.ndim != 4 or S.shape[1:] != (Hkv, r * G, k):
            return None
        sb, sh, sr, sk = S.strides
        return as_strided(S, (S.shape[0], Hkv, G, r, k), (sb, sh, sr, G * sr, sk))


class TileIndex:
    """The global indices of one score tile, as arrays broadcasting against it (made once, on
    first use, on the tile's device).

    Parameters
    ----------
    make : callable
        ``make() -> (b, h, q_idx, kv_idx)``, host int64 arrays that broadcast against the tile.
    xp : module
        The tile's array module (NumPy or CuPy): the arrays are moved there.
    grid : TileGrid, optional
        The tile's layout, where the caller knows it (:attr:`grid`).
    """

    __slots__ = ("_make", "_xp", "_arrays", "grid")

    def __init__(self, make: Callable[[], tuple], xp: Any = np, grid: TileGrid | None = None):
        self._make, self._xp, self._arrays, self.grid = make, xp, None, grid

    def arrays(self) -> tuple:
        """``(b, h, q_idx, kv_idx)`` on the tile's device."""
        if self._arrays is None:
            self._arrays = tuple(backend.to_device(np.asarray(a, dtype=np.int64), self._xp)
                                 for a in self._make())
        return self._arrays

    @classmethod
    def folded(cls, B: int, heads: np.ndarray, group: int, q_pos: np.ndarray, k_pos: np.ndarray,
               xp: Any = np) -> "TileIndex":
        """The indices of a tile in the native engine's folded rows: ``(B, Hkv, r * G, k)``, row
        ``i * G + g`` holding query ``q_pos[i]`` of the query head ``heads[kv * G + g]``."""
        hk = np.asarray(heads, dtype=np.int64).reshape(-1, group)  # (Hkv, G)
        q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)

        def make() -> tuple:
            r = q_pos.size
            h = np.broadcast_to(hk[None, :, None, :], (1, hk.shape[0], r, group)).reshape(
                1, hk.shape[0], r * group, 1)
            q = np.repeat(q_pos, group).reshape(1, 1, r * group, 1)
            return (np.arange(B).reshape(B, 1, 1, 1), h, q, k_pos.reshape(1, 1, 1, -1))
        return cls(make, xp, TileGrid(hk, q_pos, k_pos, folded=True))

    @classmethod
    def grouped(cls, B: int, heads: np.ndarray, group: int, q_pos: np.ndarray, k_pos: np.ndarray,
                xp: Any = np) -> "TileIndex":
        """The indices of a tile ``(B, Hkv, G, r, k)``: ``[:, kv, g, i]`` holding query
        ``q_pos[i]`` of the query head ``heads[kv * G + g]`` (the materialized strategy)."""
        hk = np.asarray(heads, dtype=np.int64).reshape(-1, group)
        q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
        return cls(lambda: (np.arange(B).reshape(B, 1, 1, 1, 1), hk.reshape(1, -1, group, 1, 1),
                            q_pos.reshape(1, 1, 1, -1, 1), k_pos.reshape(1, 1, 1, 1, -1)),
                   xp, TileGrid(hk, q_pos, k_pos, folded=False))


def check_score_mod(fn: Any, H: int | None = None) -> "ScoreMod":
    """``fn`` as a :class:`ScoreMod` (a callable without a derivative: a forward only), else
    TypeError; a library transform with a ``check_heads(H)`` (its tables' heads) is checked
    against the call's ``H`` query heads when it is given."""
    if isinstance(fn, ScoreMod) or hasattr(fn, "saving_"):
        if H is not None and hasattr(fn, "check_heads"):
            fn.check_heads(H)
        return fn
    if not callable(fn):
        raise TypeError(f"score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx) -> score "
                        f"or a mpiattn.ScoreMod(fn, grad), got {fn!r}")
    return ScoreMod(fn)


@dataclass(frozen=True)
class ScoreMod:
    """A user's score transform on NumPy or CuPy arrays (the module docstring).

    Parameters
    ----------
    fn : callable
        ``fn(score, b, h, q_idx, kv_idx) -> score``, elementwise on broadcasting arrays: ``score``
        the raw scores ``s q . k`` of a tile (float32, float64 for float64 inputs), the others
        their global batch entries, query heads, query and key positions (int64).
    grad : callable, optional
        ``grad(score, b, h, q_idx, kv_idx) -> d fn / d score`` at ``score`` (the same
        broadcasting); needed for a backward.

    Notes
    -----
    On CuPy the arguments are device arrays, so tables the functions capture must live on
    the device too (``cupy.asarray(bias)`` once, outside the function). On NumPy the function
    runs once per piece of a tile, each operation a pass over the piece: a table read is its
    main cost, and ``np.take(table.ravel(), h * width + col)`` costs about half of
    ``table[h, col]`` (``benchmarks/score_modifiers/README.md``). A relative-position bias read
    from a table, ``s + table[h, q - kv + offset]``, is :class:`mpiattn.RelativeBias` (the same
    numbers with no per-score gather: on a tile whose positions run consecutively, its bias is
    a Toeplitz block, a strided view of the table added in one pass); it gives no gradient for
    the table: under ``mpiattn.torch`` a function of torch ops reading a tensor table trains it.

    Examples
    --------
    A per-head temperature and a relative-position bias (``bias`` an ``(H, 2 N)`` table the
    function captures):

    >>> import numpy as np
    >>> from mpiattn import ScoreMod
    >>> temp = np.array([1.0, 0.5])
    >>> mod = ScoreMod(lambda s, b, h, q, kv: s * temp[h], lambda s, b, h, q, kv: temp[h] + 0 * s)
    """

    fn: Callable
    grad: Callable | None = None

    @property
    def differentiable(self) -> bool:
        """A backward can run (the derivative is given)."""
        return self.grad is not None

    def _pieces(self, S: Any, at: TileIndex) -> Any:
        """``(rows, index arrays)`` of the tile in pieces of about :data:`PIECE` scores (one piece
        on a device, where a call per piece costs more than the cache saves)."""
        idx = at.arrays()
        R = S.shape[-2] if S.ndim >= 2 else 1
        step = max(1, PIECE // max(S.size // max(R, 1), 1))
        if step >= R or backend.is_cupy_array(S):
            yield slice(None), idx
            return
        for r0 in range(0, R, step):
            rows = slice(r0, min(R, r0 + step))
            yield rows, tuple(a[..., rows, :] if a.shape[-2] == R else a for a in idx)

    def forward_(self, S: Any, at: TileIndex) -> Any:
        """``S <- fn(S)`` in place; returns ``S``."""
        return self.saving_(S, S, at)

    def saving_(self, S: Any, out: Any, at: TileIndex) -> Any:
        """``out <- fn(S)``; ``S`` keeps the raw scores (what :meth:`chain_` needs); returns ``out``
        (``out`` may be ``S``: each piece is read before it is written)."""
        for rows, idx in self._pieces(S, at):
            out[..., rows, :] = self.fn(S[..., rows, :], *idx)
        return out

    def chain_(self, dS: Any, saved: Any, at: TileIndex) -> Any:
        """``dS <- dS * grad(saved)`` in place; returns ``dS``."""
        if self.grad is None:
            raise ValueError("score_mod has no derivative: pass mpiattn.ScoreMod(fn, grad) for a "
                             "backward")
        for rows, idx in self._pieces(saved, at):
            dS[..., rows, :] *= self.grad(saved[..., rows, :], *idx)
        return dS


def shift_score_mod(fn: Any, offset: int) -> Any:
    """``fn`` (a :class:`ScoreMod` or a plain function) given query positions ``q_idx + offset``;
    a library transform with a ``shifted(offset)`` of its own (which keeps its fast path) is
    asked for it."""
    if hasattr(fn, "shifted"):
        return fn.shifted(offset)
    def shifted(f: Callable | None) -> Callable | None:
        if f is None:
            return None
        return lambda s, b, h, q_idx, kv_idx: f(s, b, h, q_idx + offset, kv_idx)
    if isinstance(fn, ScoreMod):
        return ScoreMod(shifted(fn.fn), shifted(fn.grad))
    return shifted(fn)
