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
from .comm.core import get_comm
from .comm.device import prepare
from .layouts import Segments, check_layout, check_shares, positions, segments, to_global_order

__all__ = ["partition", "shard", "gather"]


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
        return (x.shape, str(x.dtype), ax, layout, root, backend.array_module(x).__name__)

    meta = c.allgather_checked(local)
    _check_gather_meta(meta)  # the same data on every rank: the same error everywhere
    xp = backend.array_module(x)
    prepare(c, x)
    ax = meta[c.rank][2]
    lengths = [m[0][ax] for m in meta]
    rows = c.gatherv_rows(xp.ascontiguousarray(xp.moveaxis(x, ax, 0)), lengths, root=root)
    if rows is None:
        return None
    return xp.moveaxis(to_global_order(rows, sum(lengths), c.size, layout), 0, ax)


def _check_gather_meta(meta: list) -> None:
    shape0, dtype0, axis0, layout0, root0, xp0 = meta[0]
    for r, (shape, dtype, axis, layout, root, xp) in enumerate(meta):
        if xp != xp0:
            raise ValueError(f"gather: rank {r} passes a {xp} array, rank 0 a {xp0} array")
        if (axis, layout, root) != (axis0, layout0, root0) or len(shape) != len(shape0):
            raise ValueError(f"gather called with different axis/layout/root/ndim on rank {r} than on rank 0")
        if dtype != dtype0:
            raise ValueError(f"gather: rank {r} has dtype {dtype}, rank 0 has {dtype0}")
        other = shape[:axis] + shape[axis + 1:]
        if other != shape0[:axis0] + shape0[axis0 + 1:]:
            raise ValueError(f"gather: rank {r} has shape {shape}, incompatible with rank 0's {shape0}")
    check_shares([m[0][axis0] for m in meta], layout0, "gather")
