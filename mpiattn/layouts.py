"""Layouts: which global rows of a sequence each rank owns.

Two layouts are part of the public contract.

``contiguous``
    Like ``numpy.array_split(numpy.arange(n), P)``: the first ``n mod P``
    ranks own ``ceil(n/P)`` rows, the rest ``floor(n/P)``; rank ``r`` owns one
    contiguous range, in rank order.
``zigzag``
    For causal load balance: the rows are split into ``2P`` chunks by the
    same rule and rank ``r`` owns chunk ``r`` followed by chunk ``2P-1-r``.

Any ``n >= 0`` and any ``P >= 1`` work; a rank may own zero rows. A rank's
rows are a list of *segments*, ``(global_start, length)`` pairs in local
order, so every kernel can address global positions with slices.

This module is pure arithmetic (no communication); :mod:`mpiattn.sharding`
moves arrays to and from a layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend

__all__ = ["LAYOUTS", "check_layout", "split_sizes", "segments", "all_segments",
           "local_length", "local_lengths", "positions", "check_shares", "to_global_order"]

LAYOUTS = ("contiguous", "zigzag")

Segments = list[tuple[int, int]]


def check_layout(layout: str) -> str:
    """Return ``layout`` or raise ValueError when it is not a known layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout


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


def all_segments(n: int, nranks: int, layout: str = "contiguous") -> list[Segments]:
    """Segments ``[(global_start, length), ...]`` of every rank, in local row order.

    Empty segments are dropped, so a rank with no rows has an empty list.
    """
    check_layout(layout)
    if n < 0:
        raise ValueError(f"sequence length must be >= 0, got {n}")
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


def segments(n: int, rank: int, nranks: int, layout: str = "contiguous") -> Segments:
    """Segments of one rank (see :func:`all_segments`)."""
    return all_segments(n, nranks, layout)[rank]


def local_length(n: int, rank: int, nranks: int, layout: str = "contiguous") -> int:
    """Number of rows rank ``rank`` owns of a length-``n`` sequence."""
    return sum(ln for _, ln in segments(n, rank, nranks, layout))


def local_lengths(n: int, nranks: int, layout: str = "contiguous") -> list[int]:
    """Rows owned by each rank of a length-``n`` sequence."""
    return [sum(ln for _, ln in segs) for segs in all_segments(n, nranks, layout)]


def positions(segs: Segments) -> np.ndarray:
    """Global row indices (int64, local order) of a rank's segments."""
    if not segs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(g, g + ln, dtype=np.int64) for g, ln in segs])


def check_shares(counts: list[int], layout: str, what: str) -> int:
    """Check that ``counts[r]`` (rows on rank r) are the layout's shares of their sum; return the sum.

    Raises ValueError naming the first rank that holds the wrong number of
    rows. Every rank passes the same gathered ``counts``, so every rank
    raises the same error without further communication.
    """
    n, P = sum(counts), len(counts)
    for r, (got, want) in enumerate(zip(counts, local_lengths(n, P, layout))):
        if got != want:
            raise ValueError(
                f"{what}: rank {r} holds {got} rows, but the {layout} layout of {n} rows over "
                f"{P} ranks gives it {want} (rows per rank: {counts})")
    return n


def to_global_order(rows: Any, n: int, nranks: int, layout: str) -> Any:
    """Rows (axis 0) concatenated in rank order, each rank's in local order -> global order."""
    xp = backend.array_module(rows)
    out = xp.empty_like(rows)
    pos = 0
    for segs in all_segments(n, nranks, layout):
        for g, ln in segs:
            out[g:g + ln] = rows[pos:pos + ln]
            pos += ln
    return out
