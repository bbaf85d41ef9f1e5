"""Moving global arrays to and from a layout: ``partition``, ``shard``, ``gather``.

Which rows a rank owns is :mod:`mpiattn.layouts` (pure arithmetic); this
module adds the communicator: the rows of the calling rank, and the
assembly of a global array from every rank's rows (with the same error on
every rank when the ranks' pieces do not fit together).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend
from .comm import errors
from .comm.core import get_comm
from .comm.device import prepare
from .layouts import (Segments, all_segments, check_layout, check_shares, describe_key, layout_key,
                      positions, segments, to_global_order)

__all__ = ["partition", "shard", "gather", "relayout_rows"]


def partition(n: int, comm: Any = None, layout: Any = "contiguous") -> np.ndarray:
    """Global row indices this rank owns of a sequence of length ``n``.

    Parameters
    ----------
    n : int
        Global sequence length, ``n >= 0``.
    comm : mpi4py.MPI.Intracomm, optional
        Communicator (default ``MPI.COMM_WORLD``).
    layout : {"contiguous", "zigzag"} or Layout
        A :class:`mpiattn.Layout` must cover ``n`` rows over the
        communicator's ranks. (No communication: the ranks' layouts are not
        compared here; :func:`shard`, :func:`gather` and the computations do.)

    Returns
    -------
    numpy.ndarray
        1-D int64 array of length ``n_r``, increasing within each segment.

    Examples
    --------
    In one process every row is rank 0's; under ``mpiexec -n 2`` with
    ``layout="zigzag"`` rank 0 gets rows 0-1 and 6-7 of 8.

    >>> import mpiattn
    >>> mpiattn.partition(8, layout="zigzag")
    array([0, 1, 2, 3, 4, 5, 6, 7])
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


def shard(x: Any, comm: Any = None, axis: int = -2, layout: Any = "contiguous") -> Any:
    """This rank's rows of a global array that every rank holds.

    Parameters
    ----------
    x : ndarray, shape (..., N, ...)
        The same global array on every rank.
    axis : int
        The sequence axis (default -2, the rows of a ``(..., N, d)`` array).
    layout : {"contiguous", "zigzag"} or Layout
        The same on every rank (checked).

    Returns
    -------
    ndarray, shape (..., n_r, ...)
        A contiguous copy of this rank's rows, in the layout's local order.
    """
    c = get_comm(comm)

    def local() -> tuple:
        backend.array_module(x)
        check_layout(layout)
        ax = _norm_axis(axis, x.ndim)
        return ax, segments(x.shape[ax], c.rank, c.size, layout), layout_key(layout)

    got = c.allgather_checked(local)
    errors.same_everywhere([g[2] for g in got], "shard's layout", describe_key)
    return _take_rows(x, got[c.rank][1], got[c.rank][0])


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def gather(x: Any, comm: Any = None, axis: int = -2, layout: Any = "contiguous",
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
        return (x.shape, str(x.dtype), ax, layout_key(layout), root, backend.array_module(x).__name__)

    meta = c.allgather_checked(local)
    _check_gather_meta(meta, layout)  # the same data on every rank: the same error everywhere
    xp = backend.array_module(x)
    prepare(c, x)
    ax = meta[c.rank][2]
    lengths = [m[0][ax] for m in meta]
    rows = c.gatherv_rows(xp.ascontiguousarray(xp.moveaxis(x, ax, 0)), lengths, root=root)
    if rows is None:
        return None
    return xp.moveaxis(to_global_order(rows, sum(lengths), c.size, layout), 0, ax)


def _check_gather_meta(meta: list, layout: Any) -> None:
    """Every rank's ``(shape, dtype, axis, layout key, root, backend)`` must agree (but the rows)."""
    with errors.alike():
        errors.same_everywhere([m[3] for m in meta], "gather's layout", describe_key)
        for i, what in ((5, "gather's backend"), (1, "gather's dtype"), (2, "gather's axis"),
                        (4, "gather's root"), (0, "gather's shape apart from the axis")):
            errors.same_everywhere([m[i][:m[2]] + m[i][m[2] + 1:] if i == 0 else m[i] for m in meta],
                                   what)
        check_shares([m[0][meta[0][2]] for m in meta], layout, "gather")


def relayout_rows(c: Any, x: Any, n: int, src: Any, dst: Any) -> Any:
    """This rank's rows of a global length-``n`` array, moved from layout ``src`` to ``dst``.

    A building block for the strategies (no validation: every rank calls it
    with the same ``n``, ``src``, ``dst`` and compatible arrays).

    Parameters
    ----------
    c : Comm
    x : ndarray, shape (..., n_r, F)
        This rank's rows by ``src`` (row axis -2).
    n : int
        Global number of rows.
    src, dst : layout names or :class:`mpiattn.Layout`

    Returns
    -------
    ndarray, shape (..., n'_r, F)
        This rank's rows by ``dst``. One all-to-all of the rows that change
        owner; ``x`` itself (no copy) when the layouts agree.
    """
    if layout_key(src) == layout_key(dst):
        return x
    xp = backend.array_module(x)
    P, r = c.size, c.rank
    src_pos = [positions(s) for s in all_segments(n, P, src)]
    owner = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    for d, s in enumerate(all_segments(n, P, dst)):
        p = positions(s)
        owner[p], local[p] = d, np.arange(p.size)
    mine = src_pos[r]
    order = np.lexsort((local[mine], owner[mine]))  # by destination rank, then its local order
    send_counts = np.bincount(owner[mine], minlength=P).tolist()
    into = [p[owner[p] == r] for p in src_pos]  # rows I receive from each source
    rows = xp.moveaxis(x, -2, 0)
    send = xp.ascontiguousarray(rows[backend.to_device(order, xp)])
    got = c.alltoallv_rows(send, send_counts, [p.size for p in into])
    dest = np.concatenate([np.sort(local[p]) for p in into]) if into else np.zeros(0, np.int64)
    out = xp.empty((dest.size,) + rows.shape[1:], dtype=x.dtype)
    out[backend.to_device(dest, xp)] = got
    return xp.ascontiguousarray(xp.moveaxis(out, 0, -2))
