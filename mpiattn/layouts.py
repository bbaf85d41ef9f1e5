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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend
from .comm import get_comm

__all__ = ["LAYOUTS", "check_layout", "split_sizes", "segments", "all_segments",
           "local_length", "local_lengths", "positions", "check_shares", "to_global_order",
           "partition", "shard", "gather"]

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


def partition(n: int, comm: Any = None, layout: str = "contiguous") -> np.ndarray:
    """Global row indices this rank owns of a sequence of length ``n``.

    Parameters
    ----------
    n : int
        Global sequence length, ``n >= 0``.
    comm : mpi4py.MPI.Intracomm, optional
        Communicator (default ``MPI.COMM_WORLD``).
    layout : {"contiguous", "zigzag"}

    Returns
    -------
    numpy.ndarray
        1-D int64 array of length ``n_r``, increasing within each segment.
    """
    c = get_comm(comm)
    return positions(segments(int(n), c.rank, c.size, layout))


def _take_rows(x: Any, segs: Segments, axis: int) -> Any:
    xp = backend.array_module(x)
    sl = [slice(None)] * x.ndim
    parts = []
    for g, ln in segs:
        sl[axis] = slice(g, g + ln)
        parts.append(x[tuple(sl)])
    if not parts:
        shape = list(x.shape)
        shape[axis] = 0
        return xp.empty(shape, dtype=x.dtype)
    if len(parts) == 1:
        return xp.ascontiguousarray(parts[0])
    return xp.concatenate(parts, axis=axis)


def shard(x: Any, comm: Any = None, axis: int = -2, layout: str = "contiguous") -> Any:
    """This rank's rows of a global array that every rank holds.

    Parameters
    ----------
    x : ndarray, shape (..., N, ...)
        The same global array on every rank.
    axis : int
        The sequence axis (default -2, the rows of a ``(..., N, d)`` array).

    Returns
    -------
    ndarray, shape (..., n_r, ...)
        A contiguous copy of this rank's rows, in the layout's local order.
    """
    c = get_comm(comm)
    with c.collective_errors():
        backend.array_module(x)
        check_layout(layout)
        axis = _norm_axis(axis, x.ndim)
    return _take_rows(x, segments(x.shape[axis], c.rank, c.size, layout), axis)


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def gather(x: Any, comm: Any = None, axis: int = -2, layout: str = "contiguous",
           root: int | None = 0) -> Any:
    """Assemble the global array from every rank's rows.

    Parameters
    ----------
    x : ndarray, shape (..., n_r, ...)
        This rank's rows, in the layout's local order.
    axis : int
        The sequence axis.
    root : int or None
        The rank that receives the result; ``None`` gathers to every rank.

    Returns
    -------
    ndarray of shape (..., N, ...) on ``root`` (every rank when ``root`` is
    None), ``None`` elsewhere. ``N`` is the sum of the local lengths.

    Raises
    ------
    ValueError
        On every rank, when the other dimensions, dtypes or layouts differ
        between ranks, or a local length does not match the layout.
    """
    c = get_comm(comm)

    def local() -> tuple:
        backend.array_module(x)
        check_layout(layout)
        ax = _norm_axis(axis, x.ndim)
        if root is not None and not 0 <= root < c.size:
            raise ValueError(f"root {root} is not a rank of a communicator of size {c.size}")
        return (x.shape, str(x.dtype), ax, layout, root)

    meta = c.allgather_checked(local)
    _check_gather_meta(meta)  # the same data on every rank: the same error everywhere
    xp = backend.array_module(x)
    ax = meta[c.rank][2]
    lengths = [m[0][ax] for m in meta]
    rows = c.gatherv_rows(xp.ascontiguousarray(xp.moveaxis(x, ax, 0)), lengths, root=root)
    if rows is None:
        return None
    return xp.moveaxis(to_global_order(rows, sum(lengths), c.size, layout), 0, ax)


def _check_gather_meta(meta: list) -> None:
    shape0, dtype0, axis0, layout0, root0 = meta[0]
    for r, (shape, dtype, axis, layout, root) in enumerate(meta):
        if (axis, layout, root) != (axis0, layout0, root0) or len(shape) != len(shape0):
            raise ValueError(f"gather called with different axis/layout/root/ndim on rank {r} than on rank 0")
        if dtype != dtype0:
            raise ValueError(f"gather: rank {r} has dtype {dtype}, rank 0 has {dtype0}")
        other = shape[:axis] + shape[axis + 1:]
        if other != shape0[:axis0] + shape0[axis0 + 1:]:
            raise ValueError(f"gather: rank {r} has shape {shape}, incompatible with rank 0's {shape0}")
    check_shares([m[0][axis0] for m in meta], layout0, "gather")
