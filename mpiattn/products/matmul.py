"""Sequence-sharded matrix products ``A·Bᵀ``, ``A·B``, ``Aᵀ·B`` and their backward.

Every operand is sharded along its row axis (-2) by one layout (see
:mod:`mpiattn.layouts`); columns are never sharded. Leading axes broadcast like
:func:`numpy.matmul`.

========== =============== =============== ==================== =================
product    ``a`` (rank r)  ``b`` (rank r)  result (rank r)      how
========== =============== =============== ==================== =================
matmul_nt  (..., n_r, d)   (..., m_r, d)   (..., n_r, M)  A·Bᵀ  ring over B
matmul_nn  (..., n_r, M)   (..., m_r, d)   (..., n_r, d)  A·B   ring over B
matmul_tn  (..., m_r, N)   (..., m_r, d)   (..., n_r, d)  Aᵀ·B  ring reduce-scatter
========== =============== =============== ==================== =================

``N = sum(n_r)`` and ``M = sum(m_r)`` are global lengths, each laid out by the
layout (a named layout fits any length; an explicit :class:`mpiattn.Layout` fixes
one, so with it every sharded length must be its ``n``). nt and nn stream B's rows
round the ring with :func:`mpiattn.comm.circulate` (the next piece in flight while the current one is multiplied). tn sends no
operand: partial sums of the output rows travel round the ring and come home
(O(block·d) words in flight per rank, never a full-size allreduce).

The gradients close over the three products (the thesis' closure)::

    C = A Bᵀ : dA = nn(dC, B),  dB = tn(dC, A)
    C = A B  : dA = nt(dC, B),  dB = tn(A, dC)
    C = Aᵀ B : dA = nt(B, dC),  dB = nn(A, dC)

Conventions shared by all functions here
----------------------------------------
* dtypes float16, float32, float64; ``a`` and ``b`` must have the same dtype.
  Products are computed and accumulated in float32 for float16/float32 input
  and in float64 for float64 (:func:`mpiattn.backend.accum_dtype`); results
  have the input dtype. Operand rows travel in the input dtype; tn's partial
  sums travel in the accumulation dtype (rounding them to float16 at every hop
  would lose accuracy P times).
* Any strides are accepted: rows that travel are copied into contiguous
  pieces, local operands are read through views. Subclasses that change the
  meaning of the data (``numpy.ma.MaskedArray``, ``numpy.matrix``) and
  anything that is not a NumPy/CuPy array are rejected with TypeError.
* ``block_size`` (rows per exchanged piece) bounds temporary memory. With
  ``None`` the library picks the largest block such that one travelling piece
  (rows of B for nt/nn; partial sums for tn, all leading axes included) takes
  at most :data:`PIECE_BYTES` bytes, clipped to ``[1, longest shard]``;
  it is computed from metadata every rank has, so it is the same everywhere.
* Bad input raises the same ValueError/TypeError on every rank: one metadata
  allgather per call decides it before any data moves.
* One rank (P = 1) with float32/float64 input runs no ring: the product is
  one local ``matmul`` of the operands (no pieces, partial sums or
  temporaries; no extra memory beyond the result), unless an explicit
  :class:`mpiattn.Layout` stores the travelling rows out of global order.
  float16 keeps the ring at P = 1, so its float32 copies stay piece-sized.

Costs below use ``P`` ranks, ``L`` = the number of leading-index
combinations of the result, ``L_b`` those of ``b``, ``k`` = block size, and
``r+1`` for the next rank on the ring.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .. import backend, gemm
from ..comm.core import Comm, get_comm
from ..comm.ring import circulate
from ..layouts import all_segments, local_lengths
from .plan import Plan, Shape, check_out, gather_meta, plan_nn, plan_nt, plan_tn

__all__ = ["matmul_nt", "matmul_nn", "matmul_tn",
           "matmul_nt_backward", "matmul_nn_backward", "matmul_tn_backward"]


# --------------------------------------------------------------- ring kernels
# Every product goes through :func:`mpiattn.gemm.matmul`, straight into its output (``beta = 1``
# accumulates in the same launch): on CuPy the operands stay in their dtype (float16 on tensor
# cores, float32 accumulation, no cast copies); on NumPy they are cast once to the accumulation
# dtype (BLAS has no float16).
def _one_matmul(c: Comm, dtype: np.dtype, n_ring: int, layout: Any) -> bool:
    """True when the product is one local matmul: one rank, no dtype conversion, rows in global order.

    With P = 1 nothing travels, so the ring would only split the product
    into pieces (and, for nn/tn, add them up); one ``matmul`` of the whole
    operands does the same arithmetic with no piece copies, partial sums or
    temporaries. float16 keeps the ring: its float32 copies stay
    piece-sized. An explicit :class:`~mpiattn.Layout` may store the ``n_ring``
    rows out of global order; then the ring (which addresses global
    positions) is used.
    """
    if c.size != 1 or backend.accum_dtype(dtype) != dtype:
        return False
    pos = 0
    for g, ln in all_segments(n_ring, 1, layout)[0]:
        if g != pos:
            return False
        pos += ln
    return True


def _result(xp: ModuleType, plan: Plan, dtype: np.dtype, out: Any) -> Any:
    """``out``, or a new array of the result's shape."""
    return xp.empty(plan.lead + (plan.out_rows, plan.out_cols), dtype=dtype) if out is None else out


def _accumulator(xp: ModuleType, plan: Plan, work: np.dtype, out: Any) -> Any:
    """Zeros of the result's shape in the accumulation dtype: ``out`` itself where it has that dtype."""
    if out is None or out.dtype != work:
        return xp.zeros(plan.lead + (plan.out_rows, plan.out_cols), dtype=work)
    out[...] = 0
    return out


def _finish(acc: Any, dtype: np.dtype, out: Any) -> Any:
    """The accumulated result in the operands' dtype, written into ``out`` when given."""
    if out is None:
        return acc.astype(dtype, copy=False)
    if acc is not out:
        out[...] = acc
    return out


def _ring_nt(c: Comm, xp: ModuleType, a: Any, b: Any, plan: Plan, layout: Any,
             out: Any = None) -> Any:
    if _one_matmul(c, a.dtype, plan.n_ring, layout):
        return xp.matmul(a, xp.swapaxes(b, -1, -2), out=out)
    op = gemm.operand_dtype(xp, a.dtype)
    out = _result(xp, plan, a.dtype, out)
    a_w = a.astype(op, copy=False)
    with c.abort_on_error():
        for piece in circulate(c, (b,), plan.n_ring, layout, plan.block):
            b_w = piece.data[0].astype(op, copy=False)
            gemm.matmul(a_w, xp.swapaxes(b_w, -1, -2), out[..., piece.start:piece.stop])
    return out


def _ring_nn(c: Comm, xp: ModuleType, a: Any, b: Any, plan: Plan, layout: Any,
             out: Any = None) -> Any:
    if _one_matmul(c, a.dtype, plan.n_ring, layout):
        return xp.matmul(a, b, out=out)
    work, op = backend.accum_dtype(a.dtype), gemm.operand_dtype(xp, a.dtype)
    acc = _accumulator(xp, plan, work, out)
    with c.abort_on_error():
        for i, piece in enumerate(circulate(c, (b,), plan.n_ring, layout, plan.block)):
            a_cols = a[..., piece.start:piece.stop].astype(op, copy=False)
            # the first piece writes the accumulator (no temporary), the others add to it
            gemm.matmul(a_cols, piece.data[0].astype(op, copy=False), acc, beta=1.0 if i else 0.0)
    return _finish(acc, a.dtype, out)


def _ring_tn(c: Comm, xp: ModuleType, a: Any, b: Any, plan: Plan, layout: Any,
             out: Any = None) -> Any:
    if _one_matmul(c, a.dtype, plan.n_ring, layout):
        return xp.matmul(xp.swapaxes(a, -1, -2), b, out=out)
    work, op = backend.accum_dtype(a.dtype), gemm.operand_dtype(xp, a.dtype)
    acc = _accumulator(xp, plan, work, out)
    b_w = b.astype(op, copy=False)
    with c.abort_on_error():
        for piece in circulate(c, (), plan.n_ring, layout, plan.block, acc_out=(acc,)):
            a_cols_t = xp.swapaxes(a[..., piece.start:piece.stop], -1, -2).astype(op, copy=False)
            gemm.matmul(a_cols_t, b_w, piece.acc[0], beta=1.0)  # a view: added in place
    return _finish(acc, a.dtype, out)


def _sum_to_shape(xp: ModuleType, g: Any, shape: Shape) -> Any:
    """Sum a broadcast gradient back to an operand's shape (numpy.matmul broadcasting)."""
    if tuple(g.shape) == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, s in enumerate(shape[:-2]) if s == 1 and g.shape[extra + i] != 1)
    # reduce in the accumulation dtype, return the operand's dtype
    red = xp.sum(g, axis=axes, dtype=backend.accum_dtype(g.dtype))
    return red.reshape(shape).astype(g.dtype, copy=False)


# ------------------------------------------------------------------- forward
def matmul_nt(a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None, *, out: Any = None) -> Any:
    """This rank's rows of ``A·Bᵀ`` for row-sharded A and B.

    Parameters
    ----------
    a : ndarray, shape (..., n_r, d)
        This rank's rows of A (N x d).
    b : ndarray, shape (..., m_r, d)
        This rank's rows of B (M x d).
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    layout : {"contiguous", "zigzag"} or Layout
        Layout of both N and M rows.
    block_size : int, optional
        Rows of B per exchanged piece (default: see the module notes).
    out : ndarray, optional
        Where to write the result: this rank's shape of it, the inputs' dtype,
        C-contiguous, sharing no memory with ``a`` or ``b``; given on every rank
        or on none. A loop that calls the product again and again can reuse one
        output (its memory pages are then touched once: at ``n_r x M = 10,000 x
        20,000`` float32 the first touch of a new result took 0-2.3 s on a 2-core
        VM, see ``benchmarks/products-thesis``).

    Returns
    -------
    ndarray, shape (broadcast(...), n_r, M)
        Rows of ``A·Bᵀ``, columns in global order; dtype of the inputs (``out``
        itself when given).

    Raises
    ------
    ValueError, TypeError
        On every rank, for bad or inconsistent input (see the module notes).

    Notes
    -----
    FLOPs ``2·L·n_r·M·d``. Words sent per rank ``L_b·(M - m_{r+1})·d`` (B's
    rows go round the ring; none go back to their owner), about as many
    received. Peak extra memory: about three pieces of B, ``3·L_b·k·d``
    words, plus sends not yet completed (one piece ahead per peer in
    practice); for float16 also float32 copies of ``a`` and of one output tile
    (``L·n_r·k``). The result itself is ``L·n_r·M`` words.

    Examples
    --------
    >>> import numpy as np, mpiattn
    >>> a = np.arange(6.0).reshape(3, 2)
    >>> c_r = mpiattn.matmul_nt(mpiattn.shard(a), mpiattn.shard(a))  # this rank's rows of A·Aᵀ
    >>> bool(np.array_equal(mpiattn.gather(c_r), a @ a.T))
    True
    """
    c = get_comm(comm)
    op = "matmul_nt"
    arrays = [("a", a), ("b", b)] + ([] if out is None else [("out", out)])
    xp, dtype, (sa, sb, *s_out), layout, block = gather_meta(c, op, arrays, layout, block_size)
    plan = plan_nt(sa, sb, layout, c.rank, block, dtype)
    if out is not None:
        check_out(s_out[0], plan.lead, [s[-2] for s in sa], plan.out_cols, op)
    return _ring_nt(c, xp, a, b, plan, layout, out)


def matmul_nn(a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None, *, out: Any = None) -> Any:
    """This rank's rows of ``A·B`` for row-sharded A (all M columns) and B.

    Parameters
    ----------
    a : ndarray, shape (..., n_r, M)
        This rank's rows of A (N x M), columns in global order.
    b : ndarray, shape (..., m_r, d)
        This rank's rows of B (M x d).
    comm, layout, block_size, out
        As in :func:`matmul_nt` (``block_size`` counts rows of B).

    Returns
    -------
    ndarray, shape (broadcast(...), n_r, d)
        Rows of ``A·B``; dtype of the inputs.

    Notes
    -----
    FLOPs ``2·L·n_r·M·d``. Words sent per rank ``L_b·(M - m_{r+1})·d``, about
    as many received. Peak extra memory: about ``3·L_b·k·d`` words of
    pieces in flight plus the accumulator and one product, ``2·L·n_r·d``
    (accumulation dtype; for float32/float64 the accumulator is the result);
    for float16 also a float32 copy of a ``n_r x k`` column block of ``a``.
    """
    c = get_comm(comm)
    op = "matmul_nn"
    arrays = [("a", a), ("b", b)] + ([] if out is None else [("out", out)])
    xp, dtype, (sa, sb, *s_out), layout, block = gather_meta(c, op, arrays, layout, block_size)
    plan = plan_nn(sa, sb, layout, c.rank, block, dtype)
    if out is not None:
        check_out(s_out[0], plan.lead, [s[-2] for s in sa], plan.out_cols, op)
    return _ring_nn(c, xp, a, b, plan, layout, out)


def matmul_tn(a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None, *, out: Any = None) -> Any:
    """This rank's rows of ``Aᵀ·B`` for row-sharded A and B (a ring reduce-scatter).

    Parameters
    ----------
    a : ndarray, shape (..., m_r, N)
        This rank's rows of A (M x N), columns in global order.
    b : ndarray, shape (..., m_r, d)
        This rank's rows of B (M x d), the same rows as ``a``.
    comm, layout, block_size, out
        As in :func:`matmul_nt`; the N output rows are partitioned by the same
        layout, and ``block_size`` counts output rows per travelling piece.

    Returns
    -------
    ndarray, shape (broadcast(...), n_r, d)
        This rank's ``n_r`` rows (of N, by the layout) of ``Aᵀ·B``.

    Notes
    -----
    Every rank adds its contribution ``A_rᵀ B_r`` to each block of output rows
    while that block's partial sum passes by; the sums come home to their
    owner after P hops. FLOPs ``2·L·m_r·N·d``. Words sent per rank
    ``L·(N - n_r)·d`` in the accumulation dtype (partial sums of every other
    rank's rows), as many received; no operand moves. Peak extra memory:
    about ``4·L·k·d`` accumulation-dtype words (pieces in flight and one
    product), plus sends not yet completed; for float16 also the float32
    result accumulator (``L·n_r·d``), a float32 copy of ``b`` and of one
    ``k x m_r`` block of ``aᵀ``.
    """
    c = get_comm(comm)
    op = "matmul_tn"
    arrays = [("a", a), ("b", b)] + ([] if out is None else [("out", out)])
    xp, dtype, (sa, sb, *s_out), layout, block = gather_meta(c, op, arrays, layout, block_size)
    plan = plan_tn(sa, sb, layout, c.rank, block, dtype)
    if out is not None:
        check_out(s_out[0], plan.lead, local_lengths(plan.n_ring, c.size, layout), plan.out_cols, op)
    return _ring_tn(c, xp, a, b, plan, layout, out)


# ------------------------------------------------------------------ backward
def _check_dc(sdc: list[Shape], want: list[Shape], op: str, fwd: str) -> None:
    for r, (got, exp) in enumerate(zip(sdc, want)):
        if tuple(got) != tuple(exp):
            raise ValueError(f"{op}: dc has shape {got} on rank {r}; expected {exp}, "
                             f"the shape of {fwd}(a, b) there")


def matmul_nt_backward(dc: Any, a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
                       block_size: int | None = None) -> tuple[Any, Any]:
    """Gradients of ``C = A·Bᵀ`` (:func:`matmul_nt`): ``dA = dC·B``, ``dB = dCᵀ·A``.

    Parameters
    ----------
    dc : ndarray, shape (broadcast(...), n_r, M)
        This rank's rows of dL/dC.
    a, b : ndarray
        The forward operands, shapes (..., n_r, d) and (..., m_r, d).
    comm, layout, block_size
        As in :func:`matmul_nt`.

    Returns
    -------
    da : ndarray, shape of ``a``
        ``matmul_nn(dc, b)``, summed over axes where ``a`` was broadcast.
    db : ndarray, shape of ``b``
        ``matmul_tn(dc, a)``, summed likewise.

    Notes
    -----
    FLOPs ``4·L·n_r·M·d``. Words sent per rank: ``L_b·(M - m_{r+1})·d`` (B's
    rows) plus ``L·(M - m_r)·d`` partial sums. Peak extra memory: the larger of
    the two products' (see :func:`matmul_nn`, :func:`matmul_tn`) plus the
    broadcast gradients before they are summed (``L·n_r·d``, ``L·m_r·d``).
    """
    c = get_comm(comm)
    op = "matmul_nt_backward"
    xp, dtype, (sdc, sa, sb), layout, block = gather_meta(
        c, op, [("dc", dc), ("a", a), ("b", b)], layout, block_size)
    fwd = plan_nt(sa, sb, layout, c.rank, block, dtype, op)
    want = [fwd.lead + (s[-2], fwd.out_cols) for s in sa]
    _check_dc(sdc, want, op, "matmul_nt")
    plan_a = plan_nn(sdc, sb, layout, c.rank, block, dtype, op, ("dc", "b"))
    plan_b = plan_tn(sdc, sa, layout, c.rank, block, dtype, op, ("dc", "a"))
    da = _ring_nn(c, xp, dc, b, plan_a, layout)
    db = _ring_tn(c, xp, dc, a, plan_b, layout)
    return _sum_to_shape(xp, da, a.shape), _sum_to_shape(xp, db, b.shape)


def matmul_nn_backward(dc: Any, a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
                       block_size: int | None = None) -> tuple[Any, Any]:
    """Gradients of ``C = A·B`` (:func:`matmul_nn`): ``dA = dC·Bᵀ``, ``dB = Aᵀ·dC``.

    Parameters
    ----------
    dc : ndarray, shape (broadcast(...), n_r, d)
        This rank's rows of dL/dC.
    a, b : ndarray
        The forward operands, shapes (..., n_r, M) and (..., m_r, d).
    comm, layout, block_size
        As in :func:`matmul_nn`.

    Returns
    -------
    da : ndarray, shape of ``a``
        ``matmul_nt(dc, b)``, summed over axes where ``a`` was broadcast.
    db : ndarray, shape of ``b``
        ``matmul_tn(a, dc)``, summed likewise.

    Notes
    -----
    FLOPs ``4·L·n_r·M·d``. Words sent per rank: ``L_b·(M - m_{r+1})·d`` (B's
    rows) plus ``L·(M - m_r)·d`` partial sums. Peak extra memory: as
    :func:`matmul_nt` and :func:`matmul_tn`, plus the broadcast gradients
    before they are summed.
    """
    c = get_comm(comm)
    op = "matmul_nn_backward"
    xp, dtype, (sdc, sa, sb), layout, block = gather_meta(
        c, op, [("dc", dc), ("a", a), ("b", b)], layout, block_size)
    fwd = plan_nn(sa, sb, layout, c.rank, block, dtype, op)
    want = [fwd.lead + (s[-2], fwd.out_cols) for s in sa]
    _check_dc(sdc, want, op, "matmul_nn")
    plan_a = plan_nt(sdc, sb, layout, c.rank, block, dtype, op, ("dc", "b"))
    plan_b = plan_tn(sa, sdc, layout, c.rank, block, dtype, op, ("a", "dc"))
    da = _ring_nt(c, xp, dc, b, plan_a, layout)
    db = _ring_tn(c, xp, a, dc, plan_b, layout)
    return _sum_to_shape(xp, da, a.shape), _sum_to_shape(xp, db, b.shape)


def matmul_tn_backward(dc: Any, a: Any, b: Any, comm: Any = None, layout: Any = "contiguous",
                       block_size: int | None = None) -> tuple[Any, Any]:
    """Gradients of ``C = Aᵀ·B`` (:func:`matmul_tn`): ``dA = B·dCᵀ``, ``dB = A·dC``.

    Parameters
    ----------
    dc : ndarray, shape (broadcast(...), n_r, d)
        This rank's rows (of N, by the layout) of dL/dC.
    a, b : ndarray
        The forward operands, shapes (..., m_r, N) and (..., m_r, d).
    comm, layout, block_size
        As in :func:`matmul_tn`.

    Returns
    -------
    da : ndarray, shape of ``a``
        ``matmul_nt(b, dc)``, summed over axes where ``a`` was broadcast.
    db : ndarray, shape of ``b``
        ``matmul_nn(a, dc)``, summed likewise.

    Notes
    -----
    FLOPs ``4·L·m_r·N·d``. Words sent per rank: about ``2·L_dc·(N - n_{r+1})·d``
    (dC's rows go round the ring twice, once per product). Peak extra
    memory: as :func:`matmul_nt` and :func:`matmul_nn`, plus the broadcast
    gradients before they are summed.
    """
    c = get_comm(comm)
    op = "matmul_tn_backward"
    xp, dtype, (sdc, sa, sb), layout, block = gather_meta(
        c, op, [("dc", dc), ("a", a), ("b", b)], layout, block_size)
    fwd = plan_tn(sa, sb, layout, c.rank, block, dtype, op)
    n_out, P = fwd.n_ring, len(sa)
    want = [fwd.lead + (n_r, fwd.out_cols) for n_r in local_lengths(n_out, P, layout)]
    _check_dc(sdc, want, op, "matmul_tn")
    plan_a = plan_nt(sb, sdc, layout, c.rank, block, dtype, op, ("b", "dc"))
    plan_b = plan_nn(sa, sdc, layout, c.rank, block, dtype, op, ("a", "dc"))
    da = _ring_nt(c, xp, b, dc, plan_a, layout)
    db = _ring_nn(c, xp, a, dc, plan_b, layout)
    return _sum_to_shape(xp, da, a.shape), _sum_to_shape(xp, db, b.shape)
