"""Validation and planning of the distributed products (no data moves here).

One metadata allgather per call checks the operands of every rank (the same
error on every rank); the plan that follows is computed from data every rank
holds, so every rank derives the same ring: rows per piece, global lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm
from ..comm.device import prepare
from ..layouts import (check_block_size, check_layout, check_shares, describe_key, layout_key,
                       local_lengths)

__all__ = ["PIECE_BYTES", "Shape", "Plan", "default_block_size", "gather_meta", "check_out",
           "plan_nt", "plan_nn", "plan_tn"]

#: Target bytes of one travelling piece when ``block_size`` is None (16 MiB).
PIECE_BYTES = 16 * 2**20

Shape = tuple[int, ...]


# ---------------------------------------------------------------- validation
def default_block_size(max_rows: int, row_bytes: int, piece_bytes: int | None = None) -> int:
    """Rows per travelling piece chosen when ``block_size`` is None.

    Parameters
    ----------
    max_rows : int
        The longest shard of the travelling rows (no piece needs more).
    row_bytes : int
        Bytes of one travelling row, all leading axes included.
    piece_bytes : int, optional
        Memory target of one piece (default :data:`PIECE_BYTES`).

    Returns
    -------
    int
        ``clip(piece_bytes // row_bytes, 1, max(1, max_rows))``.
    """
    if piece_bytes is None:
        piece_bytes = PIECE_BYTES
    cap = max(1, int(max_rows))
    if row_bytes <= 0:
        return cap
    return max(1, min(cap, int(piece_bytes) // int(row_bytes)))


def _check_array(x: Any, name: str, op: str) -> None:
    if isinstance(x, (np.ma.MaskedArray, np.matrix)):
        raise TypeError(f"{op}: {name} is a {type(x).__name__}; pass a plain numpy.ndarray "
                        "(masks and matrix semantics are not supported)")
    try:
        backend.array_module(x)
    except TypeError as exc:
        raise TypeError(f"{op}: {name}: {exc}") from None
    backend.check_dtype(x.dtype, f"{op}: {name}")
    if x.ndim < 2:
        raise ValueError(f"{op}: {name} has shape {tuple(x.shape)}; expected at least 2 dimensions "
                         "(..., rows, columns) with the sharded rows on axis -2")


def gather_meta(c: Comm, op: str, arrays: Sequence[tuple[str, Any]], layout: Any,
                 block_size: Any) -> tuple[ModuleType, np.dtype, list[list[Shape]], str, int | None]:
    """Local checks and the metadata allgather (one collective), then the cross-rank checks.

    Returns the namespace, the common dtype, ``shapes[i][r]`` (operand i on
    rank r), the layout and the requested block size (None for the default).
    An entry named ``"out"`` is an output to write into: it must be writeable
    and share no memory with the other arrays, and every rank must pass one
    or none (its shape is checked against the plan by :func:`check_out`).
    """
    names = [nm for nm, _ in arrays]

    def local() -> tuple:
        check_layout(layout)
        blk = check_block_size(block_size, op)
        for nm, x in arrays:
            _check_array(x, nm, op)
        xp = backend.array_module(*(x for _, x in arrays))
        if "out" in names:
            _check_out_array(xp, dict(arrays), op)
        dtypes = {nm: np.dtype(x.dtype) for nm, x in arrays}
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{nm} {dt}" for nm, dt in dtypes.items())
            raise TypeError(f"{op}: operands must have the same dtype, got {listed}")
        return (layout_key(layout), blk, str(arrays[0][1].dtype),
                tuple(tuple(int(s) for s in x.shape) for _, x in arrays), xp.__name__, "out" in names)

    # local checks and the metadata allgather in one collective: a local error
    # becomes the same exception on every rank
    meta_all = c.allgather_checked(local)
    xp = backend.array_module(*(x for _, x in arrays))
    dtype = np.dtype(arrays[0][1].dtype)
    # From here on every rank holds the same data and runs the same pure checks,
    # so they raise the same error everywhere without further communication.
    block_size = meta_all[0][1]
    with errors.alike():
        errors.same_everywhere([m[5] for m in meta_all], f"whether {op} is given an out array",
                               lambda given: "one" if given else "none")
    shapes = [[m[3][i] for m in meta_all] for i in range(len(names))]
    with errors.alike():
        for i, what in ((4, "backend"), (0, "layout"), (1, "block_size"), (2, "dtype")):
            errors.same_everywhere([m[i] for m in meta_all], f"{op}'s {what}",
                                   describe_key if what == "layout" else repr)
        for nm, per_rank in zip(names, shapes):
            _same_except_rows(per_rank, nm, op)
    prepare(c, *(x for _, x in arrays))
    return xp, dtype, shapes, layout, block_size


def _check_out_array(xp: ModuleType, arrays: dict[str, Any], op: str) -> None:
    """``out`` may be written and shares no memory with an operand (a local check)."""
    out = arrays["out"]
    if not getattr(out.flags, "writeable", True):
        raise ValueError(f"{op}: out is read-only")
    if not out.flags.c_contiguous:
        raise ValueError(f"{op}: out is not C-contiguous; pass a C-contiguous array "
                         "(numpy.ascontiguousarray makes one)")
    for nm, x in arrays.items():
        if nm != "out" and xp.may_share_memory(out, x):
            raise ValueError(f"{op}: out shares memory with {nm}; pass an array of its own")


@errors.alike()  # on gathered metadata: every rank raises alike
def check_out(shapes: list[Shape], lead: Shape, rows: Sequence[int], cols: int, op: str) -> None:
    """Every rank's ``out`` has that rank's shape of the result, ``lead + (rows[r], cols)``.

    Parameters
    ----------
    shapes : list of tuple of int
        ``out``'s shape on each rank (gathered: the same list on every rank).
    lead : tuple of int
        The result's broadcast leading axes.
    rows : sequence of int
        The result's rows on each rank.
    cols : int
        The result's columns.
    op : str
        The product's name, for the message.
    """
    for r, (got, n_r) in enumerate(zip(shapes, rows)):
        want = tuple(lead) + (int(n_r), int(cols))
        if tuple(got) != want:
            raise ValueError(f"{op}: out has shape {tuple(got)} on rank {r}; the result there "
                             f"has shape {want}")


def _same_except_rows(shapes: list[Shape], name: str, op: str) -> None:
    s0 = shapes[0]
    for r, s in enumerate(shapes):
        if len(s) != len(s0) or s[:-2] != s0[:-2] or s[-1] != s0[-1]:
            raise ValueError(
                f"{op}: {name} has shape {s} on rank {r} but {s0} on rank 0; only axis -2 "
                "(the sharded rows) may differ between ranks")


def _row_counts(shapes: list[Shape], name: str, op: str, layout: Any) -> list[int]:
    """Each rank's rows of an operand; they must be the layout's shares of their sum."""
    counts = [s[-2] for s in shapes]
    check_shares(counts, layout, f"{op}: {name}")
    return counts


def _broadcast_lead(sa: Shape, sb: Shape, op: str) -> Shape:
    try:
        return tuple(np.broadcast_shapes(sa[:-2], sb[:-2]))
    except ValueError:
        raise ValueError(f"{op}: leading axes of a {sa[:-2]} and b {sb[:-2]} do not broadcast "
                         "(numpy.matmul rules)") from None


@dataclass(frozen=True)
class Plan:
    """What one ring needs, identical on every rank except ``out_rows``."""

    lead: Shape     # broadcast leading shape of the result
    n_ring: int     # global rows that travel: B's rows (nt, nn) or the output rows (tn)
    out_rows: int   # this rank's rows of the result
    out_cols: int   # last dimension of the result
    block: int      # rows per travelling piece


def _block(block_size: int | None, counts: list[int], row_bytes: int) -> int:
    if block_size is not None:
        return block_size
    return default_block_size(max(counts, default=0), row_bytes)


@errors.alike()  # on gathered metadata: every rank raises alike
def plan_nt(sa: list[Shape], sb: list[Shape], layout: Any, rank: int, block_size: int | None,
             dtype: np.dtype, op: str = "matmul_nt", names: tuple[str, str] = ("a", "b")) -> Plan:
    d_a, d_b = sa[0][-1], sb[0][-1]
    if d_a != d_b:
        raise ValueError(f"{op}: inner dimensions differ: {names[0]} has {d_a} columns, {names[1]} has "
                         f"{d_b} (A·Bᵀ needs equal column counts)")
    n = _row_counts(sa, names[0], op, layout)
    m = _row_counts(sb, names[1], op, layout)
    lead = _broadcast_lead(sa[0], sb[0], op)
    row_bytes = math.prod(sb[0][:-2]) * d_b * dtype.itemsize
    return Plan(lead, sum(m), n[rank], sum(m), _block(block_size, m, row_bytes))


@errors.alike()  # on gathered metadata: every rank raises alike
def plan_nn(sa: list[Shape], sb: list[Shape], layout: Any, rank: int, block_size: int | None,
             dtype: np.dtype, op: str = "matmul_nn", names: tuple[str, str] = ("a", "b")) -> Plan:
    n = _row_counts(sa, names[0], op, layout)
    m = _row_counts(sb, names[1], op, layout)
    if sa[0][-1] != sum(m):
        raise ValueError(f"{op}: inner dimensions differ: {names[0]} has {sa[0][-1]} columns, but "
                         f"{names[1]}'s rows add up to {sum(m)} over all ranks (A·B needs equal)")
    lead = _broadcast_lead(sa[0], sb[0], op)
    d = sb[0][-1]
    row_bytes = math.prod(sb[0][:-2]) * d * dtype.itemsize
    return Plan(lead, sum(m), n[rank], d, _block(block_size, m, row_bytes))


@errors.alike()  # on gathered metadata: every rank raises alike
def plan_tn(sa: list[Shape], sb: list[Shape], layout: Any, rank: int, block_size: int | None,
             dtype: np.dtype, op: str = "matmul_tn", names: tuple[str, str] = ("a", "b")) -> Plan:
    for r, (x, y) in enumerate(zip(sa, sb)):
        if x[-2] != y[-2]:
            raise ValueError(f"{op}: inner dimensions differ: on rank {r} {names[0]} has {x[-2]} rows "
                             f"and {names[1]} has {y[-2]} (Aᵀ·B needs the same rows of both)")
    _row_counts(sa, names[0], op, layout)
    n_out = sa[0][-1]
    out_counts = local_lengths(n_out, len(sa), layout)
    lead = _broadcast_lead(sa[0], sb[0], op)
    d = sb[0][-1]
    row_bytes = math.prod(lead) * d * backend.accum_dtype(dtype).itemsize
    return Plan(lead, n_out, out_counts[rank], d, _block(block_size, out_counts, row_bytes))
