"""Which (query, key) pairs a block of attention may use, decided per tile.

The rules are those of :mod:`mpiattn.masks.spec`, in global positions.
A :class:`BlockMask` describes one query shard against one key/value block.
Engines ask it, tile by tile, whether a tile of queries ``i0:i1`` and keys
``j0:j1`` has no visible pair (skip it), only visible pairs (no mask needed
except padding), or some (apply :meth:`BlockMask.bias`, or read
:meth:`BlockMask.visible_pairs`). Causal, window and document rules are decided on
the host, from positions and host copies of the document ids (no device
work, no synchronisation); padding, which lives on the device with the
keys, is always applied as a bias and never makes a tile "none".

How a tile is classified (cheap first, exact where it matters):

* Causal and the window say that ``j - i`` must lie in ``[lo, hi]`` with
  ``lo = d - left`` and ``hi = d + min(right, 0 if causal)`` (``d`` the
  diagonal: 0 top-left, ``M - N`` bottom-right). The tile's position
  hulls ``[min, max]`` bound ``j - i``: outside ``[lo, hi]`` -> "none",
  inside -> "all".
* Documents: per batch entry, each id's position hull on both sides
  (sorted once per tile and cached). The tile is "none" when no batch entry
  has an id on both sides whose hulls meet the band; "all" needs one and
  the same id on both sides in every batch entry, and the band "all".
* The hulls are exact when every id (or, without documents, the tile)
  occupies consecutive positions, the usual case (contiguous runs of
  documents, tiles inside a layout segment). Otherwise, for tiles of at most
  :data:`REFINE_LIMIT` pairs, the visible pairs are materialised on the host
  (they are needed for the bias anyway, and kept for it), so a tile with no
  visible pair is never computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from .modifiers import Modifiers, fold_tile
from .scoremod import TileIndex
from .spec import RULES, MaskSpec

__all__ = ["BlockMask", "QuerySide", "block_mask", "padding_bias", "REFINE_LIMIT"]

#: Tiles of at most this many (query, key) pairs per batch entry are checked
#: exactly (on the host) when the position hulls cannot decide them.
REFINE_LIMIT = 1 << 20

#: Regions of at most this many (query, key, head, batch) entries are checked against a bool
#: ``attn_mask`` or a ``mask_mod`` when classified (larger ones, e.g. a whole block of a
#: head-sharded call, are "some" and decided tile by tile).
MOD_LIMIT = 1 << 24


def padding_bias(pad: Any, dtype: Any) -> Any:
    """``(B, k)`` bool padding (True = ignore) -> additive bias ``(B, 1, 1, k)``: 0 or -inf.

    One elementwise pass on the padding's device (no boolean indexing: no host sync on CuPy).
    """
    xp = backend.array_module(pad)
    dt = np.dtype(dtype)
    return xp.ascontiguousarray(xp.where(pad, dt.type(-np.inf), dt.type(0)))[:, None, None, :]


class _Side(NamedTuple):
    """Summary of the rows ``a:b`` of one side (queries or keys) of a tile."""

    pmin: int
    pmax: int
    run: bool            # the positions are consecutive integers (the hull is exact)
    ids: list | None     # per batch entry: (unique ids, hull min, hull max) of each id
    ids_run: bool        # every id occupies consecutive positions


def _summary(pos: np.ndarray, seg: np.ndarray | None) -> _Side:
    pmin, pmax = int(pos.min()), int(pos.max())
    run = pmax - pmin + 1 == pos.size
    if seg is None:
        return _Side(pmin, pmax, run, None, run)
    rising = pos.size < 2 or bool(np.all(pos[1:] > pos[:-1]))
    ids, ids_run = [], True
    for row in seg:
        if row.size < 2 or bool(np.all(row[1:] >= row[:-1])):  # the usual case: sorted already
            sid, p = row, pos
        else:
            order = np.argsort(row, kind="stable")
            sid, p = row[order], pos[order]
        starts = np.flatnonzero(np.concatenate(([True], sid[1:] != sid[:-1])))
        ends = np.append(starts[1:], sid.size)
        if rising and p is pos:  # positions increase within every id: the hull ends are the run ends
            mn, mx = p[starts], p[ends - 1]
        else:
            mn, mx = np.minimum.reduceat(p, starts), np.maximum.reduceat(p, starts)
        ids_run = ids_run and bool(np.all(mx - mn + 1 == ends - starts))
        ids.append((sid[starts], mn, mx))
    return _Side(pmin, pmax, run, ids, ids_run)


@dataclass
class BlockMask:
    """The visibility rules of one query shard against one key/value block.

    Attributes
    ----------
    q_pos : (n,) int64 numpy array
        Global positions of the queries (local order).
    k_pos : (k,) int64 numpy array
        Global positions of the block's keys.
    causal : bool
        Hide key ``j`` from query ``i`` when ``j > i``.
    pad : (B, k) bool array or None
        Key padding of the block (True = hidden), on the keys' device.
    window : (left, right) or None
        Key ``j`` is visible to query ``i`` only if ``i - left <= j <= i + right``;
        each bound an int >= 0 or None (unbounded on that side).
    q_seg, k_seg : (B, n) and (B, k) integer numpy arrays, or None
        Document ids of the queries and of the block's keys (host copies;
        both or neither): query ``i`` sees key ``j`` only when the ids are
        equal in the same batch entry.
    q_summaries : dict, optional
        A cache of the query side's tile summaries, shared by the masks of
        one call that have the same ``q_pos`` and ``q_seg`` (every key block
        of a ring); private to this mask when None.
    diagonal : int
        Query ``i`` is aligned with key ``i + diagonal`` (bottom-right causal:
        ``M - N``); causal and the window are measured from it.
    mods : Modifiers or None
        The call's score modifiers (:mod:`mpiattn.masks.modifiers`).
    heads : (h,) int64 numpy array or None
        The global query head of each head the engine gets (None: ``0..h-1``; a
        head-sharded call passes its share). Needed with ``mods``.
    rows : (n,) int64 numpy array or None
        Each query's row of ``mods.attn_mask`` (None: ``0..n-1``).
    """

    q_pos: np.ndarray
    k_pos: np.ndarray
    causal: bool = False
    pad: Any = None
    window: tuple | None = None
    q_seg: np.ndarray | None = None
    k_seg: np.ndarray | None = None
    q_summaries: dict | None = None
    diagonal: int = 0
    mods: Modifiers | None = None
    heads: np.ndarray | None = None
    rows: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.q_seg is None) != (self.k_seg is None):
            raise ValueError("BlockMask needs document ids for both queries and keys, or neither")
        if self.window is not None and tuple(self.window) == (None, None):
            self.window = None
        left, right = self.window if self.window is not None else (None, None)
        d = int(self.diagonal)
        self._lo = -math.inf if left is None else d - int(left)
        hi = math.inf if right is None else int(right)
        self._hi = (min(hi, 0) if self.causal else hi) + d
        self._pad_bias: dict = {}
        self._sides: dict = {}
        self._pairs: tuple | None = None  # ((i0, i1, j0, j1), host bool) of the last tile
        self._mod: tuple | None = None    # ((i0, i1, j0, j1), host bool) of the modifiers' last region
        if self.mods is not None and self.heads is None:
            raise ValueError("BlockMask with modifiers needs the global query heads (heads=)")
        if self.rows is None:
            self.rows = np.arange(self.q_pos.size, dtype=np.int64)

    @property
    def transform(self) -> Any:
        """The call's elementwise score transform ``y = f(x)`` (:attr:`Modifiers.transform`: the
        softcap), or None."""
        return None if self.mods is None else self.mods.transform

    def at(self, i0: int, i1: int, j0: int, j1: int, group: int, xp: Any = np) -> TileIndex:
        """The global indices of the tile of queries ``i0:i1`` (folded: ``group`` rows each) and
        keys ``j0:j1``, for the call's score transform (:mod:`mpiattn.masks.scoremod`)."""
        B = 1 if self.mods is None else max(self.mods.B, 1)
        heads = np.arange(group) if self.heads is None else self.heads
        return TileIndex.folded(B, heads, group, self.q_pos[i0:i1], self.k_pos[j0:j1], xp)

    @property
    def formed(self) -> bool:
        """Scores are more than ``x`` plus a 0 / -inf bias: a transform or something added."""
        return self.mods is not None and (self.mods.transform is not None or self.mods.adds)

    # ------------------------------------------------------------ what is active
    @property
    def rules(self) -> tuple[str, ...]:
        """The active rules, a sub-tuple of :data:`RULES` (e.g. ``("causal", "padding")``)."""
        on = {"causal": self.causal, "window": self.window is not None,
              "segments": self.q_seg is not None, "padding": self.pad is not None}
        return tuple(r for r in RULES if on[r])

    @property
    def positional(self) -> bool:
        """True when a rule other than padding is active (so tiles may be skipped)."""
        return self.causal or self.window is not None or self.q_seg is not None

    # ---------------------------------------------------------- classification
    def _side(self, name: str, a: int, b: int) -> _Side:
        cache = self._sides if name == "k" or self.q_summaries is None else self.q_summaries
        got = cache.get((name, a, b))
        if got is None:
            pos, seg = (self.q_pos, self.q_seg) if name == "q" else (self.k_pos, self.k_seg)
            got = cache[(name, a, b)] = _summary(pos[a:b], None if seg is None else seg[:, a:b])
        return got

    def _meets(self, lo: Any, hi: Any) -> Any:
        """Whether ``j - i`` ranging over ``[lo, hi]`` meets the band ``[self._lo, self._hi]``."""
        return (hi >= self._lo) & (lo <= self._hi)

    def visibility(self, i0: int, i1: int, j0: int, j1: int) -> str:
        """``"none"``, ``"all"`` or ``"some"`` pairs visible in queries ``i0:i1`` x keys ``j0:j1``.

        "none" only when no batch entry has a visible pair (sound: such a
        tile may be skipped); "all" only when every pair of every batch
        entry is visible. Padding is not counted here (it is applied to every
        tile as a bias). An empty range is "none". A bool ``attn_mask`` and a
        ``mask_mod`` count for regions of at most :data:`MOD_LIMIT` entries.
        """
        vis = self._positional_visibility(i0, i1, j0, j1)
        if vis == "none" or self.mods is None or not self.mods.hides:
            return vis
        if self.mods.rule is not None:  # a named rule tells whole tiles from their hulls
            qs, ks = self._side("q", i0, i1), self._side("k", j0, j1)
            told = self.mods.hull(qs.pmin, qs.pmax, ks.pmin, ks.pmax)
            if told is not None:
                return "none" if told == "none" else vis
        ok = self.mod_visible(i0, i1, j0, j1)
        if ok is None:
            return "some"
        if not ok.any():
            return "none"
        if vis == "all":
            return "all" if ok.all() else "some"
        nb = 1 if self.q_seg is None else self.q_seg.shape[0]
        if (i1 - i0) * (j1 - j0) * nb <= REFINE_LIMIT and not (
                self.visible_pairs(i0, i1, j0, j1)[:, None] & ok).any():
            return "none"
        return "some"

    def mod_visible(self, i0: int, i1: int, j0: int, j1: int,
                    bounded: bool = True) -> np.ndarray | None:
        """Host bool ``(Bx, Hx, i1-i0, j1-j0)`` of the ``attn_mask`` and ``mask_mod`` (True =
        visible), or None when nothing hides or (``bounded``) the region is larger than
        :data:`MOD_LIMIT`. The last region asked for is kept, and regions inside it are sliced
        from it; an unbounded answer is not kept."""
        if self.mods is None or not self.mods.hides:
            return None
        if self._mod is not None:
            (a0, a1, b0, b1), ok = self._mod
            if a0 <= i0 and i1 <= a1 and b0 <= j0 and j1 <= b1:
                return ok[:, :, i0 - a0:i1 - a0, j0 - b0:j1 - b0]
        large = self.mods.cost((i1 - i0) * (j1 - j0), len(self.heads)) > MOD_LIMIT
        if large and bounded:
            return None
        ok = self.mods.visible(self.heads, self.rows[i0:i1], self.q_pos[i0:i1], self.k_pos[j0:j1])
        if not large:
            self._mod = ((i0, i1, j0, j1), ok)
        return ok

    def _positional_visibility(self, i0: int, i1: int, j0: int, j1: int) -> str:
        if i1 <= i0 or j1 <= j0:
            return "none"
        if not self.positional:
            return "all"
        qs, ks = self._side("q", i0, i1), self._side("k", j0, j1)
        dmin, dmax = ks.pmin - qs.pmax, ks.pmax - qs.pmin  # the range of j - i
        if not self._meets(dmin, dmax):
            return "none"
        band_all = dmin >= self._lo and dmax <= self._hi
        exact = qs.run and ks.run
        if qs.ids is not None:
            seen, same = False, True
            for (qu, qmn, qmx), (ku, kmn, kmx) in zip(qs.ids, ks.ids):
                same = same and qu.size == 1 and ku.size == 1 and qu[0] == ku[0]
                if not seen:
                    _, iq, ik = np.intersect1d(qu, ku, assume_unique=True, return_indices=True)
                    seen = bool(np.any(self._meets(kmn[ik] - qmx[iq], kmx[ik] - qmn[iq])))
            if not seen:
                return "none"
            if band_all and same:
                return "all"
            exact = qs.ids_run and ks.ids_run
        elif band_all:
            return "all"
        nb = 1 if self.q_seg is None else self.q_seg.shape[0]
        if not exact and (i1 - i0) * (j1 - j0) * nb <= REFINE_LIMIT:
            ok = self.visible_pairs(i0, i1, j0, j1)
            if not ok.any():
                return "none"
            if ok.all():
                return "all"
        return "some"

    def visible_pairs(self, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """Host bool ``(Bs, i1-i0, j1-j0)`` of the positional and document rules (True = visible).

        ``Bs`` is the batch size with document ids, else 1 (the same for
        every batch entry); padding is excluded. The last tile asked for is
        kept, so :meth:`bias` after :meth:`visibility` builds it once.
        """
        key = (i0, i1, j0, j1)
        if self._pairs is not None and self._pairs[0] == key:
            return self._pairs[1]
        q, k = self.q_pos[i0:i1, None], self.k_pos[None, j0:j1]
        ok = None  # visible iff q + lo <= k <= q + hi
        if self._lo > -math.inf:
            ok = k >= q + int(self._lo)
        if self._hi < math.inf:
            hi = k <= q + int(self._hi)
            ok = hi if ok is None else np.logical_and(ok, hi, out=ok)
        if ok is None:
            ok = np.ones((q.shape[0], k.shape[1]), dtype=bool)
        ok = ok[None]
        if self.q_seg is not None:
            ok = ok & (self.q_seg[:, i0:i1, None] == self.k_seg[:, None, j0:j1])
        self._pairs = (key, ok)
        return ok

    def band(self, i0: int, i1: int, j0: int, j1: int) -> tuple[int, int, float, float] | None:
        """``(q0, k0, lo, hi)`` when the tile's positional rule is the band alone.

        That is: no documents, and queries ``i0:i1`` and keys ``j0:j1`` at
        consecutive increasing positions from ``q0`` and ``k0``; then key
        ``k0 + j`` is visible to query ``q0 + i`` iff ``lo <= (k0 + j) - (q0 + i) <= hi``
        (``lo``, ``hi`` may be infinite). None otherwise (use :meth:`visible_pairs`).
        A device can then mask the tile itself, with no host data to upload.
        """
        if self.q_seg is not None or i1 <= i0 or j1 <= j0:
            return None
        for pos, a, b in ((self.q_pos, i0, i1), (self.k_pos, j0, j1)):
            if int(pos[b - 1]) - int(pos[a]) != b - a - 1 or (b - a > 2 and not bool(np.all(np.diff(pos[a:b]) == 1))):
                return None
        return int(self.q_pos[i0]), int(self.k_pos[j0]), self._lo, self._hi

    # ------------------------------------------------------------------ masks
    def padding(self, xp: Any, j0: int, j1: int, dtype: Any) -> Any:
        """Additive padding bias ``(B, 1, 1, j1-j0)`` of keys ``j0:j1``, or None without padding."""
        if self.pad is None:
            return None
        key = np.dtype(dtype).str
        full = self._pad_bias.get(key)
        if full is None:
            full = self._pad_bias[key] = padding_bias(self.pad, dtype)
        return full[..., j0:j1]

    def host_bias(self, i0: int, i1: int, j0: int, j1: int, dtype: Any, group: int = 1,
                  vis: str | None = None, added: bool = True) -> np.ndarray | None:
        """Host ``(Bx, 1 or Hkv, (i1-i0)*group, j1-j0)`` bias of the rules and modifiers (padding
        excluded): -inf where hidden (only on a "some" tile), plus what the modifiers add (unless
        ``added=False``); None when it would be all 0."""
        vis = self.visibility(i0, i1, j0, j1) if vis is None else vis
        dt = np.dtype(dtype)
        out = None
        if vis == "some":
            ok = self.visible_pairs(i0, i1, j0, j1)[:, None]
            mv = self.mod_visible(i0, i1, j0, j1, bounded=False)
            if mv is not None:
                ok = ok & mv
            hkv = max(len(self.heads) // group, 1) if self.heads is not None else 1
            out = fold_tile(np.where(ok, dt.type(0), dt.type(-np.inf)), hkv, group)
        if added and self.mods is not None and self.mods.adds:
            add = self.mods.added(self.heads, self.rows[i0:i1], self.q_pos[i0:i1],
                                  self.k_pos[j0:j1], self.diagonal, group, dt)
            out = add if out is None else out + add
        return out

    def hidden(self, xp: Any, i0: int, i1: int, j0: int, j1: int, dtype: Any, group: int = 1,
               vis: str | None = None) -> Any:
        """The 0 / -inf bias alone (padding, rules, the modifiers that hide), or None: the visible
        pairs of a tile, for its maximum score (``max_logit``)."""
        return self.bias(xp, i0, i1, j0, j1, dtype, group, vis, added=False)

    def bias(self, xp: Any, i0: int, i1: int, j0: int, j1: int, dtype: Any, group: int = 1,
             vis: str | None = None, added: bool = True) -> Any:
        """Additive bias for queries ``i0:i1`` x keys ``j0:j1`` on ``xp``'s device, or None when
        nothing is hidden or added: -inf where hidden, plus ALiBi and a float ``attn_mask``.

        Broadcastable to ``(B, Hkv, (i1-i0)*group, j1-j0)``: with ``group``
        each query row is repeated ``group`` times (the folded rows of
        :mod:`mpiattn.kernels.native`, row ``i*group + g``).
        """
        out = self.padding(xp, j0, j1, dtype)
        host = self.host_bias(i0, i1, j0, j1, dtype, group, vis, added)
        if host is not None:
            dev = backend.to_device(host, xp)
            out = dev if out is None else out + dev
        return out


@dataclass
class QuerySide:
    """This rank's queries as every key block of one call sees them.

    Attributes
    ----------
    q_pos : (n,) int64 numpy array
        Global positions of the queries (local order).
    q_seg : (B, n) int64 numpy array or None
        Their document ids.
    summaries : dict
        The tile summaries of the queries, filled as the blocks ask (one
        call's cache: it lives as long as this object).
    mods : Modifiers or None
        The call's score modifiers.
    heads : (h,) int64 numpy array or None
        The global query heads the engine gets (needed with ``mods``).
    rows : (n,) int64 numpy array or None
        Each query's row of ``mods.attn_mask`` (None: ``0..n-1``).
    """

    q_pos: np.ndarray
    q_seg: np.ndarray | None = None
    summaries: dict = field(default_factory=dict)
    mods: Modifiers | None = None
    heads: np.ndarray | None = None
    rows: np.ndarray | None = None

    @classmethod
    def of(cls, q_pos: np.ndarray, seg_q: np.ndarray | None, mods: Modifiers | None = None,
           heads: Any = None) -> "QuerySide":
        """The queries at global positions ``q_pos``, their ids taken from the global ``seg_q``;
        ``heads``: the global query heads the engine gets."""
        return cls(q_pos, None if seg_q is None else seg_q[:, q_pos], mods=mods,
                   heads=None if heads is None else np.asarray(heads, dtype=np.int64))


def block_mask(mask: MaskSpec, queries: QuerySide, k_pos: np.ndarray, seg_k: np.ndarray | None,
               pad: Any) -> BlockMask:
    """The :class:`BlockMask` of ``queries`` against the keys at global positions ``k_pos``.

    Parameters
    ----------
    mask : MaskSpec
    queries : QuerySide
    k_pos : (k,) int64
    seg_k : (B, M) int64 or None
        The global document ids of the keys.
    pad : (B, k) bool array or None
        The block's key padding (on the keys' device).
    """
    k_seg = None if seg_k is None or queries.q_seg is None else seg_k[:, k_pos]
    return BlockMask(queries.q_pos, k_pos, mask.causal, pad, mask.window, queries.q_seg, k_seg,
                     queries.summaries, mask.diagonal, queries.mods, queries.heads, queries.rows)
