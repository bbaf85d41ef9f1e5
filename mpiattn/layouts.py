"""Layouts: which global rows of a sequence each rank owns.

Two layouts are part of the public contract.

``contiguous``
    Like ``numpy.array_split(numpy.arange(n), P)``: the first ``n mod P``
    ranks own ``ceil(n/P)`` rows, the rest ``floor(n/P)``; rank ``r`` owns one
    contiguous range, in rank order.
``zigzag``
    For causal load balance: the rows are split into ``2P`` chunks by the
    same rule and rank ``r`` owns chunk ``r`` followed by chunk ``2P-1-r``.

``Layout(ranges)``
    An explicit layout: ``ranges[r]`` lists the half-open global row ranges
    ``(start, stop)`` of rank ``r``, in the order the rank stores them. A
    Layout is accepted wherever a layout name is; it fixes both the length
    ``n`` and the number of ranks. :func:`mpiattn.balance` builds one that
    balances the visible pairs of a mask.

Any ``n >= 0`` and any ``P >= 1`` work; a rank may own zero rows. A rank's
rows are a list of *segments*, ``(global_start, length)`` pairs in local
order, so every kernel can address global positions with slices.

This module is pure arithmetic (no communication); :mod:`mpiattn.sharding`
moves arrays to and from a layout.
"""

from __future__ import annotations

from typing import Any

import hashlib
import operator

import numpy as np

from . import backend

__all__ = ["LAYOUTS", "Layout", "check_layout", "layout_key", "describe", "split_sizes", "segments", "all_segments",
           "local_length", "local_lengths", "positions", "check_shares", "to_global_order", "check_block_size"]

LAYOUTS = ("contiguous", "zigzag")

Segments = list[tuple[int, int]]


class Layout:
    """An explicit row layout: which global rows every rank owns, in its local order.

    Parameters
    ----------
    ranges : sequence of sequences of (int, int)
        ``ranges[r]`` holds rank ``r``'s half-open global row ranges
        ``(start, stop)``, in the order the rank stores its rows. Together
        the ranges must partition ``[0, n)`` (every row owned exactly once);
        empty ranges are allowed and ignored.

    Attributes
    ----------
    ranges : tuple of tuples of (int, int)
        The ranges as given (as plain ints).
    n : int
        The number of rows (the sum of the range lengths).
    size : int
        The number of ranks (``len(ranges)``).

    Raises
    ------
    ValueError, TypeError
        When the ranges are malformed or do not partition ``[0, n)``.
    """

    __slots__ = ("ranges", "n", "size", "_segs", "_key")

    def __init__(self, ranges: Any):
        if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__iter__"):
            raise TypeError(f"Layout takes a sequence (one entry per rank) of sequences of "
                            f"(start, stop) ranges, got {type(ranges).__name__}")
        rs = tuple(tuple(_range(rng, r) for rng in _ranks_entry(entry, r))
                   for r, entry in enumerate(ranges))
        if not rs:
            raise ValueError("Layout needs ranges for at least one rank")
        owned = sorted((a, b, r) for r, entry in enumerate(rs) for a, b in entry if b > a)
        pos, prev = 0, -1
        for a, b, r in owned:
            if a > pos:
                raise ValueError(f"Layout ranges must partition [0, n): rows [{pos}, {a}) belong "
                                 "to no rank")
            if a < pos:
                raise ValueError(f"Layout ranges must partition [0, n): rows [{a}, {min(b, pos)}) "
                                 f"are owned twice (by rank {prev} and rank {r})")
            pos, prev = b, r
        self.ranges, self.n, self.size = rs, pos, len(rs)
        self._segs = [_merged(entry) for entry in rs]
        flat = np.array([(r, a, b) for r, entry in enumerate(rs) for a, b in entry], dtype=np.int64)
        self._key = ("Layout", self.n, self.size, hashlib.sha1(flat.tobytes()).hexdigest())

    @property
    def key(self) -> tuple:
        """A small tuple identifying the layout (compared across ranks)."""
        return self._key

    def segments(self) -> list[Segments]:
        """Every rank's segments ``(global_start, length)``, adjacent ranges merged."""
        return [list(s) for s in self._segs]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other._key == self._key and other.ranges == self.ranges

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        text = repr(self.ranges)
        if len(text) > 120:
            text = text[:100] + " ...)"
        return f"Layout(n={self.n}, size={self.size}, ranges={text})"


def _ranks_entry(entry: Any, r: int) -> Any:
    if isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
        raise TypeError(f"Layout: ranges[{r}] must be a sequence of (start, stop) pairs, "
                        f"got {entry!r}")
    return entry


def _range(rng: Any, r: int) -> tuple[int, int]:
    try:
        a, b = rng
        a, b = operator.index(a), operator.index(b)
    except (TypeError, ValueError):
        raise TypeError(f"Layout: rank {r} has the range {rng!r}; each range is a pair of "
                        "integers (start, stop)") from None
    if a < 0 or b < a:
        raise ValueError(f"Layout: rank {r} has the range ({a}, {b}); need 0 <= start <= stop")
    return int(a), int(b)


def _merged(entry: tuple[tuple[int, int], ...]) -> Segments:
    out: Segments = []
    for a, b in entry:
        if b == a:
            continue
        if out and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + b - a)
        else:
            out.append((a, b - a))
    return out


def check_layout(layout: Any) -> Any:
    """Return ``layout`` (a name of :data:`LAYOUTS` or a :class:`Layout`), or raise ValueError."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)} "
                         "or an mpiattn.Layout")
    return layout


def layout_key(layout: Any) -> Any:
    """What identifies a layout across ranks: its name, or a Layout's :attr:`Layout.key`."""
    return layout.key if isinstance(layout, Layout) else layout


def describe(layout: Any) -> str:
    """A short name for messages: ``"zigzag"``, ``"explicit (n=..., size=...)"``."""
    if isinstance(layout, Layout):
        return f"explicit (n={layout.n}, {layout.size} ranks)"
    return str(layout)


def describe_key(key: Any) -> str:
    """A :func:`layout_key` for messages: ``'zigzag'``, or an explicit Layout by rows and digest."""
    if isinstance(key, tuple):
        return f"an explicit Layout of {key[1]} rows, digest {key[3][:12]}"
    return repr(key)


def check_block_size(block_size: Any, op: str) -> int | None:
    """``block_size`` (rows per block) as an int >= 1, or None; ``op`` names the caller in errors.

    Raises TypeError for anything but an integer (``True`` included) or
    None, ValueError below 1.
    """
    if block_size is None:
        return None
    if isinstance(block_size, bool):
        raise TypeError(f"{op}: block_size must be a positive integer or None, got {block_size!r}")
    try:
        k = operator.index(block_size)
    except TypeError:
        raise TypeError(f"{op}: block_size must be a positive integer or None, got {block_size!r}") from None
    if k < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {k}")
    return int(k)


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``numpy.array_split(range(n), parts)``: the first ``n % parts`` get one more."""
    q, rem = divmod(int(n), int(parts))
    return [q + 1 if i < rem else q for i in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def all_segments(n: int, nranks: int, layout: Any = "contiguous") -> list[Segments]:
    """Segments ``[(global_start, length), ...]`` of every rank, in local row order.

    Empty segments are dropped, so a rank with no rows has an empty list.
    A :class:`Layout` must have ``n`` rows and ``nranks`` ranks (ValueError
    otherwise).
    """
    check_layout(layout)
    if n < 0:
        raise ValueError(f"sequence length must be >= 0, got {n}")
    if isinstance(layout, Layout):
        if layout.n != n:
            raise ValueError(f"the explicit Layout covers {layout.n} rows, but the sequence has {n}")
        if layout.size != nranks:
            raise ValueError(f"the explicit Layout has ranges for {layout.size} ranks, but there "
                             f"are {nranks}")
        return layout.segments()
    if layout == "contiguous":
        sizes = split_sizes(n, nranks)
        starts = _starts(sizes)
        segs = [[(starts[r], sizes[r])] for r in range(nranks)]
    else:
        sizes = split_sizes(n, 2 * nranks)
        starts = _starts(sizes)
        segs = [[(starts[r], sizes[r]), (starts[2 * nranks - 1 - r], sizes[2 * nranks - 1 - r])]
                for r in range(nranks)]
    return [[(g, ln) for g, ln in s if ln > 0] for s in segs]


def segments(n: int, rank: int, nranks: int, layout: Any = "contiguous") -> Segments:
    """Segments of one rank (see :func:`all_segments`)."""
    return all_segments(n, nranks, layout)[rank]


def local_length(n: int, rank: int, nranks: int, layout: Any = "contiguous") -> int:
    """Number of rows rank ``rank`` owns of a length-``n`` sequence."""
    return sum(ln for _, ln in segments(n, rank, nranks, layout))


def local_lengths(n: int, nranks: int, layout: Any = "contiguous") -> list[int]:
    """Rows owned by each rank of a length-``n`` sequence."""
    return [sum(ln for _, ln in segs) for segs in all_segments(n, nranks, layout)]


def positions(segs: Segments) -> np.ndarray:
    """Global row indices (int64, local order) of a rank's segments."""
    if not segs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(g, g + ln, dtype=np.int64) for g, ln in segs])


def check_shares(counts: list[int], layout: Any, what: str) -> int:
    """Check that ``counts[r]`` (rows on rank r) are the layout's shares of their sum; return the sum.

    Raises ValueError naming the first rank that holds the wrong number of
    rows. Every rank passes the same gathered ``counts``, so every rank
    raises the same error without further communication.
    """
    n, P = sum(counts), len(counts)
    if isinstance(layout, Layout) and (layout.n, layout.size) != (n, P):
        raise ValueError(f"{what}: the ranks hold {n} rows over {P} ranks, but the explicit "
                         f"Layout covers {layout.n} rows over {layout.size} ranks")
    for r, (got, want) in enumerate(zip(counts, local_lengths(n, P, layout))):
        if got != want:
            raise ValueError(
                f"{what}: rank {r} holds {got} rows, but the {describe(layout)} layout of {n} rows over "
                f"{P} ranks gives it {want} (rows per rank: {counts})")
    return n


def to_global_order(rows: Any, n: int, nranks: int, layout: Any) -> Any:
    """Rows (axis 0) concatenated in rank order, each rank's in local order -> global order."""
    xp = backend.array_module(rows)
    out = xp.empty_like(rows)
    pos = 0
    for segs in all_segments(n, nranks, layout):
        for g, ln in segs:
            out[g:g + ln] = rows[pos:pos + ln]
            pos += ln
    return out
