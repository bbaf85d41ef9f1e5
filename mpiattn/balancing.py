"""Balanced explicit layouts: every rank gets an equal share of the visible pairs.

A rank computes its own queries against every key, so its work is the number
of visible (query, key) pairs of its query rows. Causal masks, sliding windows
and packed documents make that number differ from row to row; a layout that
gives every rank the same rows does not give it the same work (the zigzag
layout fixes plain causal attention only). :func:`balance` returns a
:class:`~mpiattn.layouts.Layout` that does, with a few contiguous ranges per
rank and (nearly) the same number of rows on every rank.

Pure arithmetic on host arrays (NumPy only, no communication): every rank
computes the same layout from the same arguments.

Given the kernels' tile size (``block_size``), :func:`balance` counts work
as the kernels pay it: a tile of ``block_size`` query rows by
``block_size`` key rows costs the same whether one or all of its pairs are
visible, and one with none is skipped. The layout's ranges are then cut at
multiples of ``block_size``, so every rank's tiles are the global tiles.

Also here: :func:`segment_ids_from_cu_seqlens` (FlashAttention-style
cumulative lengths -> document ids), :func:`row_work`, :func:`tile_work`
and :func:`rank_work` (the cost model, for reports and tests). The window
is checked by :func:`mpiattn.masks.check_window`.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import backend
from .layouts import Layout, all_segments, check_block_size, check_layout, positions, split_sizes
from .masks.counts import visible_keys, visible_tiles
from .masks.modifiers import Modifiers, check_attn_mask, check_mask_mod
from .masks.spec import MaskSpec, check_causal, diagonal

__all__ = ["balance", "row_work", "tile_work", "rank_work", "segment_ids_from_cu_seqlens",
           "TARGET", "MIN_CHUNK", "MAX_CHUNKS_PER_RANK", "ROW_SLACK"]

#: A candidate layout whose largest rank work is within this factor of the mean is taken.
TARGET = 1.02

#: Chunks are cut no shorter than this many rows (unless two per rank need shorter).
MIN_CHUNK = 128

#: The most chunks per rank :func:`balance` tries.
MAX_CHUNKS_PER_RANK = 16

#: One range per rank is preferred to more chunks when no rank gets more than
#: this factor of the mean rows.
ROW_SLACK = 1.25


def segment_ids_from_cu_seqlens(cu_seqlens: Any, n: int | None = None) -> np.ndarray:
    """Document ids from FlashAttention-style cumulative sequence lengths.

    Parameters
    ----------
    cu_seqlens : 1-D integer array_like, shape (D + 1,)
        ``[0, l_0, l_0 + l_1, ..., total]``: document ``d`` holds rows
        ``cu_seqlens[d]:cu_seqlens[d + 1]``.
    n : int, optional
        Length of the result (default ``total``). Rows ``total:n`` (padding
        after the last document) form one more document, id ``D``.

    Returns
    -------
    numpy.ndarray, shape (n,), int64
        ``ids[i] = d`` for the document holding row ``i``; for ``(B, N)``
        ids stack one row per batch entry.
    """
    cu = backend.to_host(cu_seqlens)  # a CuPy array is copied explicitly (np.asarray would raise)
    if cu.ndim != 1 or cu.size < 1 or (cu.size and cu.dtype.kind not in "iu"):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., total], got {cu!r}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError("cu_seqlens must start at 0 and never decrease")
    total = int(cu[-1])
    n = total if n is None else operator.index(n)
    if n < total:
        raise ValueError(f"n = {n} is shorter than the documents (cu_seqlens ends at {total})")
    ids = np.repeat(np.arange(cu.size - 1, dtype=np.int64), np.diff(cu))
    return np.concatenate([ids, np.full(n - total, cu.size - 1, dtype=np.int64)])


def _segments_2d(segment_ids: Any, n: int) -> np.ndarray | None:
    if segment_ids is None:
        return None
    seg = backend.to_host(segment_ids)
    if seg.dtype.kind not in "iu":
        raise TypeError(f"segment_ids must hold integers (document ids), got dtype {seg.dtype}")
    if seg.ndim == 1:
        seg = seg[None]
    if seg.ndim != 2 or seg.shape[1] != n:
        raise ValueError(f"segment_ids must have shape (N,) or (B, N) with N = {n}, got {seg.shape}")
    return seg.astype(np.int64, copy=False)


def _scored(n: int, m: int | None, causal: Any, window: Any, seg: np.ndarray | None,
            attn_mask: Any, mask_mod: Any, batch: int, heads: int) -> tuple | None:
    """With an ``attn_mask`` or ``mask_mod``: the rules and modifiers that count the pairs by
    evaluating them (:mod:`mpiattn.masks.counts`), ``(mask, mods, m)``; else None."""
    if attn_mask is None and mask_mod is None:
        return None
    m = n if m is None else operator.index(m)
    if seg is not None and m != n:
        raise ValueError(f"segment_ids describe self-attention (m == n), got n = {n}, m = {m}")
    batch, heads = operator.index(batch), operator.index(heads)
    if batch < 1 or heads < 1:
        raise ValueError(f"batch and heads must be >= 1, got {batch} and {heads}")
    if seg is not None and seg.shape[0] not in (1, batch):
        raise ValueError(f"segment_ids have {seg.shape[0]} batch entries, batch is {batch}")
    am = None
    if attn_mask is not None:
        am = check_attn_mask(attn_mask, batch, heads, n)
        if am.shape[3] != m:
            raise ValueError(f"attn_mask must span every key: its last axis must be m = {m}, "
                             f"got {am.shape[3]}")
    fn = None if mask_mod is None else check_mask_mod(mask_mod, batch, heads)
    causal = check_causal(causal)
    rules = MaskSpec(bool(causal), window, diagonal=diagonal(causal, n, m))
    return rules, Modifiers(attn_mask=am, mask_mod=fn, B=batch, H=heads), m


def row_work(n: int, *, causal: bool | str = False, window: Any = None, segment_ids: Any = None,
             m: int | None = None, attn_mask: Any = None, mask_mod: Any = None, batch: int = 1,
             heads: int = 1) -> np.ndarray:
    """Visible keys of every query row of self-attention over ``n`` rows, summed over the batch.

    Parameters
    ----------
    n : int
    causal, window, segment_ids, m, attn_mask, mask_mod, batch, heads
        As in :func:`balance`.

    Returns
    -------
    numpy.ndarray, shape (n,), int64
        ``w[i]``: the number of (batch entry, key) pairs query ``i`` sees; with an
        ``attn_mask`` or ``mask_mod``, the number of keys it sees in the mean over the
        batch entries and heads, rounded to an integer.

    Notes
    -----
    ``O(B n log n)`` time (a sort and two binary searches per batch entry),
    ``O(B n)`` memory; with an ``attn_mask`` or ``mask_mod`` every pair is evaluated,
    ``O(B H n m)`` time (:func:`mpiattn.masks.counts.visible_keys`).
    """
    n = operator.index(n)
    seg = _segments_2d(segment_ids, n)
    scored = _scored(n, m, causal, window, seg, attn_mask, mask_mod, batch, heads)
    if scored is not None:
        rules, mods, m = scored
        w = visible_keys(rules, mods, np.arange(n), m, seg_q=seg, seg_k=seg)
        return np.rint(w).astype(np.int64)
    jlo, jhi = _band(n, causal, window, m)
    if seg is not None and m is not None and m != n:
        raise ValueError(f"segment_ids describe self-attention (m == n), got n = {n}, m = {m}")
    if seg is None:
        return np.maximum(jhi - jlo + 1, 0)  # (MaskSpec.keys_per_row)
    out = np.zeros(n, dtype=np.int64)
    for row in seg:
        order = np.argsort(row, kind="stable")  # by id, positions increasing within an id
        sid = row[order]
        gid = np.cumsum(np.concatenate(([0], sid[1:] != sid[:-1])))  # group number, sorted order
        code = gid * (n + 1) + order  # increasing
        g = np.empty(n, dtype=np.int64)
        g[order] = gid
        a = np.searchsorted(code, g * (n + 1) + jlo, side="left")
        b = np.searchsorted(code, g * (n + 1) + jhi, side="right")
        out += np.maximum(b - a, 0)
    return out


def _band(n: int, causal: Any, window: Any, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For every query row ``i``: the keys ``jlo[i]..jhi[i]`` (of ``m``, default ``n``) that
    causal (aligned top-left or bottom-right) and the window allow (:meth:`MaskSpec.key_ranges`)."""
    m = n if m is None else operator.index(m)
    if m < 0:
        raise ValueError(f"m must be >= 0 key rows, got {m}")
    causal = check_causal(causal)
    return MaskSpec(bool(causal), window, diagonal=diagonal(causal, n, m)).key_ranges(n, m)


def _new_blocks(qb: np.ndarray, bl: np.ndarray, br: np.ndarray, nb: int, nkb: int | None = None) -> np.ndarray:
    """Per query block: how many distinct key blocks the intervals ``bl[k]..br[k]`` of its rows touch.

    Sorted by (query block, start), an interval adds the blocks past the
    largest end seen so far in its query block (all earlier intervals start
    at or before it, so what they cover from its start on is one run).
    """
    order = np.lexsort((bl, qb))
    qb, bl, br = qb[order], bl[order], br[order]
    shift = qb * (max(nb, nkb or 0) + 1)  # above any end of an earlier query block: the max restarts
    run = np.maximum.accumulate(br + shift) - shift
    prev = np.full(qb.size, -1, dtype=np.int64)
    same = qb[1:] == qb[:-1]
    prev[1:][same] = run[:-1][same]
    new = np.maximum(br - np.maximum(bl - 1, prev), 0)
    return np.bincount(qb, weights=new, minlength=nb).astype(np.int64)


def tile_work(n: int, block_size: int, *, causal: bool | str = False, window: Any = None,
              segment_ids: Any = None, m: int | None = None, attn_mask: Any = None,
              mask_mod: Any = None, batch: int = 1, heads: int = 1) -> np.ndarray | None:
    """Visible tiles of every block of ``block_size`` query rows, summed over the batch.

    Tiles are the global blocks ``[a T, (a + 1) T) x [b T, (b + 1) T)``
    (``T = block_size``; the last block may be shorter); a tile counts when
    at least one of its pairs is visible.

    Parameters
    ----------
    n : int
    block_size : int
        ``T``, the kernels' tile rows, ``>= 1``.
    causal, window, segment_ids, m, attn_mask, mask_mod, batch, heads
        As in :func:`balance`.

    Returns
    -------
    numpy.ndarray, shape (ceil(n / T),), int64, or None
        None when some document id occupies rows that are not consecutive
        (the count is then not computed; :func:`balance` falls back to
        visible pairs).

    Notes
    -----
    With consecutive documents the keys a query sees form one interval, so
    a query block touches the union of its rows' intervals: ``O(B n log n)``
    time, ``O(B n)`` memory. With an ``attn_mask`` or ``mask_mod`` a tile counts once when
    some pair of some batch entry and head is visible (the kernels skip it otherwise; every
    pair is evaluated, :func:`mpiattn.masks.counts.visible_tiles`).
    """
    n, T = operator.index(n), check_block_size(block_size, "tile_work")
    if T is None:
        raise TypeError("tile_work: block_size must be a positive integer, got None")
    nb = -(-n // T) if n else 0
    seg = _segments_2d(segment_ids, n)
    scored = _scored(n, m, causal, window, seg, attn_mask, mask_mod, batch, heads)
    if scored is not None:
        rules, mods, m = scored
        return visible_tiles(rules, mods, n, m, T, seg_q=seg, seg_k=seg)
    jlo, jhi = _band(n, causal, window, m)
    if seg is not None and m is not None and m != n:
        raise ValueError(f"segment_ids describe self-attention (m == n), got n = {n}, m = {m}")
    nkb = -(-(n if m is None else operator.index(m)) // T)
    rows = [None] if seg is None else list(seg)
    out = np.zeros(nb, dtype=np.int64)
    i = np.arange(n, dtype=np.int64)
    for row in rows:
        lo, hi = jlo, jhi
        if row is not None:
            change = np.flatnonzero(row[1:] != row[:-1]) + 1
            starts = np.concatenate(([0], change)).astype(np.int64)
            if np.unique(row).size != starts.size:
                return None  # an id in more than one run of rows
            stops = np.concatenate((change, [n])).astype(np.int64) - 1
            run = np.repeat(np.arange(starts.size), np.diff(np.concatenate((starts, [n]))))
            lo, hi = np.maximum(jlo, starts[run]), np.minimum(jhi, stops[run])
        keep = lo <= hi
        if keep.any():
            out += _new_blocks(i[keep] // T, lo[keep] // T, hi[keep] // T, nb, nkb)
    return out


def rank_work(layout: Any, n: int, size: int, *, causal: bool | str = False, window: Any = None,
              segment_ids: Any = None, m: int | None = None, attn_mask: Any = None,
              mask_mod: Any = None, batch: int = 1, heads: int = 1) -> np.ndarray:
    """Visible pairs of every rank's query rows under ``layout`` (the quantity :func:`balance` balances).

    Returns
    -------
    numpy.ndarray, shape (size,), int64
    """
    check_layout(layout)
    w = row_work(n, causal=causal, window=window, segment_ids=segment_ids, m=m,
                 attn_mask=attn_mask, mask_mod=mask_mod, batch=batch, heads=heads)
    return np.array([int(w[positions(s)].sum()) for s in all_segments(n, size, layout)], dtype=np.int64)


def _assign(work: np.ndarray, size: int, per: int) -> list[list[int]]:
    """``size * per`` chunks -> ranks, ``per`` chunks each, keeping the largest load small.

    Longest-processing-time first (each chunk, heaviest first, to the least
    loaded rank that still has room; ties to the lowest rank), then swaps of
    a chunk of the heaviest rank with a lighter chunk elsewhere while that
    lowers the largest load. Deterministic.
    """
    work = work.astype(np.int64)
    owner: list[list[int]] = [[] for _ in range(size)]
    load = np.zeros(size, dtype=np.int64)
    for c in sorted(range(work.size), key=lambda c: (-int(work[c]), c)):
        r = min((r for r in range(size) if len(owner[r]) < per), key=lambda r: (int(load[r]), r))
        owner[r].append(c)
        load[r] += work[c]
    for _ in range(4 * work.size):
        h = int(np.argmax(load))
        best = None
        wa = work[owner[h]]
        for o in range(size):
            if o == h or not owner[o]:
                continue
            d = wa[:, None] - work[owner[o]][None, :]  # load moved from h to o by a swap
            top = np.maximum(load[h] - d, load[o] + d)
            top[d <= 0] = load[h]
            a, b = np.unravel_index(int(np.argmin(top)), top.shape)
            if top[a, b] < load[h] and (best is None or top[a, b] < best[0]):
                best = (int(top[a, b]), o, int(a), int(b), int(d[a, b]))
        if best is None:
            break
        _, o, a, b, d = best
        owner[h][a], owner[o][b] = owner[o][b], owner[h][a]
        load[h] -= d
        load[o] += d
    return [sorted(cs) for cs in owner]


def _chunked(prefix: np.ndarray, n: int, size: int, per: int) -> tuple[list, int]:
    """Equal chunks of ``n`` units, ``per`` per rank, assigned by work: (ranges per rank, largest load)."""
    sizes = split_sizes(n, size * per)
    starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    work = prefix[starts[1:]] - prefix[starts[:-1]]
    owner = _assign(work, size, per)
    ranges = [[(int(starts[c]), int(starts[c + 1])) for c in cs] for cs in owner]
    return ranges, max(int(sum(work[c] for c in cs)) for cs in owner)


def _linear(prefix: np.ndarray, n: int, size: int) -> tuple[list, int]:
    """One contiguous range per rank with the smallest largest load (binary search on the load)."""
    total = int(prefix[-1])

    def cuts(limit: int) -> list[int] | None:
        out, start = [0], 0
        for _ in range(size - 1):
            stop = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            stop = max(stop, start)
            out.append(stop)
            start = stop
        out.append(n)
        return out if int(prefix[n] - prefix[out[-2]]) <= limit else None

    lo, hi = max(0, -(-total // size)), total
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    c = cuts(lo) or [0] * size + [n]
    ranges = [[(c[r], c[r + 1])] for r in range(size)]
    return ranges, max(int(prefix[c[r + 1]] - prefix[c[r]]) for r in range(size))


def balance(n: int, size: int, *, causal: bool | str = False, window: Any = None,
            segment_ids: Any = None, block_size: int | None = None, m: int | None = None,
            attn_mask: Any = None, mask_mod: Any = None, batch: int = 1, heads: int = 1) -> Layout:
    """A layout of ``n`` rows over ``size`` ranks with an equal share of visible pairs on every rank.

    Parameters
    ----------
    n : int
        Rows (self-attention: queries and keys share the layout), ``n >= 0``.
    size : int
        Ranks, ``size >= 1``.
    causal : bool or {"top-left", "bottom-right"}
        Key ``j`` visible to query ``i`` only if ``j <= i`` (True, top-left),
        or ``j <= i + m - n`` (``"bottom-right"``).
    window : (left, right), optional
        Only keys ``i - left <= j <= i + right`` (None: unbounded side; measured
        from ``i + m - n`` for bottom-right causal).
    segment_ids : integer array_like, shape (N,) or (B, N), optional
        Document ids; with ``(B, N)`` the work of every batch entry counts.
    block_size : int, optional
        The tile rows of the kernels that will run on the layout (the
        ``block_size`` passed to :func:`mpiattn.attention`, by default
        :data:`mpiattn.strategies.DEFAULT_BLOCK`). Given, the work is the
        visible tiles (:func:`tile_work`) and every range starts and ends at
        a multiple of ``block_size`` (or at ``n``); None (default): the
        visible pairs (:func:`row_work`), ranges cut at any row.
    m : int, optional
        Key rows, when the ``n`` queries attend ``m != n`` keys (a chunk of
        queries against a longer sequence, bottom-right causal); default
        ``n``. Only the queries' layout is returned; ``segment_ids`` need
        ``m == n``.
    attn_mask : array_like, shape (1 or batch, 1 or heads, n, m), optional
        The call's whole ``attn_mask`` (bool: True = visible; float: ``-inf`` hides);
        the pairs it hides do not count.
    mask_mod : callable, optional
        The call's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = visible), asked
        about every pair of ``batch`` entries and ``heads`` heads; the pairs it hides
        do not count.
    batch, heads : int
        The call's batch size and query heads, for ``attn_mask`` and ``mask_mod``
        (default 1: a mask that reads neither).

    Returns
    -------
    Layout
        Each rank owns ``n / size`` rows (within one chunk) in a few
        contiguous ranges, increasing in its local order; or, when no such
        assignment comes within :data:`TARGET` of the mean, one range per
        rank cut where the work is equal (uneven rows).

    Raises
    ------
    ValueError, TypeError
        For ``size < 1``, ``n < 0``, a bad window or bad segment ids.

    Notes
    -----
    Method: the work ``w[i]`` of every row (:func:`row_work`) and its prefix
    sums; then for ``c = 1, 2, 4, ...`` chunks per rank (chunks of at least
    :data:`MIN_CHUNK` rows, ``c <= MAX_CHUNKS_PER_RANK``) the rows are cut into
    ``c * size`` chunks of equal length and the chunks assigned by work
    (:func:`_assign`: heaviest first to the least loaded rank with room, then
    improving swaps); the first ``c`` whose largest load is within
    :data:`TARGET` of the mean wins. Before ``c = 4`` the one-range-per-rank
    cut with the smallest largest load (binary search on the prefix sums)
    is taken if it meets :data:`TARGET` with no rank above :data:`ROW_SLACK`
    times the mean rows. Failing all, the candidate with the smallest largest
    load. With ``c = 2`` and plain causal attention this is the zigzag
    layout. Adjacent chunks of a rank merge into one range.

    With ``block_size`` the same runs on blocks of ``block_size`` rows
    instead of rows (chunks of at least one block), weighted by visible
    tiles; where some document is not one run of consecutive rows, by the
    visible pairs of each block.

    With an ``attn_mask`` or ``mask_mod`` the work is counted by evaluating every pair
    (``O(B H n m)``, in chunks; :mod:`mpiattn.masks.counts`), together with the other rules.

    Cost: ``O(B n log n)`` for the work, ``O(C^2 log C + P c^2 C)`` for the
    assignments (``C = c P`` chunks), ``O(B n)`` memory; deterministic and
    local, so every rank computes the same layout without communicating.
    """
    if isinstance(size, (bool, np.bool_)):
        raise TypeError(f"size must be an integer >= 1, got {size!r}")
    size, n = operator.index(size), operator.index(n)
    if size < 1:
        raise ValueError(f"balance needs size >= 1 ranks, got {size}")
    if n < 0:
        raise ValueError(f"balance needs n >= 0 rows, got {n}")
    kw = dict(causal=causal, window=window, segment_ids=segment_ids, m=m, attn_mask=attn_mask,
              mask_mod=mask_mod, batch=batch, heads=heads)
    if block_size is None:
        unit, w = 1, row_work(n, **kw)
    else:
        unit = check_block_size(block_size, "balance")
        w = tile_work(n, unit, **kw)
        if w is None:  # a document in several runs: the pairs of each block
            pairs = np.concatenate(([0], np.cumsum(row_work(n, **kw))))
            edges = np.append(np.arange(0, n, unit), n)
            w = np.diff(pairs[edges])
    units = w.size
    prefix = np.concatenate(([0], np.cumsum(w))).astype(np.int64)
    goal = TARGET * int(prefix[-1]) / size
    min_chunk = max(1, MIN_CHUNK // unit)
    tried = []
    per = 1
    while per <= MAX_CHUNKS_PER_RANK and (per <= 2 or units // (per * size) >= min_chunk):
        tried.append(_chunked(prefix, units, size, per))
        if tried[-1][1] <= goal:
            return Layout(_merge(_rows(tried[-1][0], unit, n)))
        if per == 2:  # before more ranges: one range per rank, if its rows stay near even
            tried.append(_linear(prefix, units, size))
            ranges = _rows(tried[-1][0], unit, n)
            if tried[-1][1] <= goal and max(r[0][1] - r[0][0] for r in ranges) <= ROW_SLACK * n / size:
                return Layout(ranges)
        per *= 2
    return Layout(_merge(_rows(min(tried, key=lambda t: t[1])[0], unit, n)))


def _rows(ranges: list, unit: int, n: int) -> list:
    """Ranges of blocks of ``unit`` rows -> ranges of rows (the last block ends at ``n``)."""
    if unit == 1:
        return ranges
    return [[(min(a * unit, n), min(b * unit, n)) for a, b in rs] for rs in ranges]


def _merge(ranges: list) -> list:
    """Adjacent ranges of a rank (``stop == next start``) as one."""
    out = []
    for rs in ranges:
        merged: list = []
        for a, b in rs:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        out.append(merged)
    return out
