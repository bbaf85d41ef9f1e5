"""Row collectives as MPI calls: rows of contiguous arrays gathered, exchanged, reduced.

The work behind :class:`~mpiattn.comm.core.Comm`'s ``gatherv_rows``,
``allgatherv_rows``, ``alltoallv_rows``, ``allreduce_`` and ``reduce_scatterv_rows``:
a row (every axis but the first) travels as one contiguous MPI datatype, counts and
displacements are in rows, and CuPy buffers go through the Comm's device transport. Each
function here is called by its ``Comm`` method right after the method's collective point
(:meth:`mpiattn.comm.discipline.Discipline.point`, which names the library's line that asked
for the collective, found outside ``core.py``: so the point stays in the method), and adds
the bytes this rank sends to the Comm's counters.

Two choices are not MPI's obvious ones:

* ``allreduce`` is a reduce to rank 0 and a broadcast: MPI only *recommends* that
  ``MPI_Allreduce`` give every rank the same bits, and replicated parameters must never
  drift apart.
* ``alltoallv`` is point-to-point messages, not ``MPI_Alltoallv``: every rank posts its
  receives (from rank ``r - k``) and sends (to ``r + k``), ``k = 1 .. P-1``, at once and
  copies its own rows. pip's MPICH 5.0.2 runs ``MPI_Alltoallv`` of 16 MiB per destination at
  0.06-0.08 GB/s when waiting ranks yield (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``) and at
  1.7 GB/s otherwise, where the same bytes as point-to-point messages move at 6-14 GB/s
  (2 ranks, shared memory, measured 2026-12-02); the cost model counts a link's bandwidth.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import backend

__all__ = ["ALLTOALL_TAG", "gatherv", "alltoallv", "allreduce", "reduce_scatterv"]

#: The tag of :func:`alltoallv`'s messages (none of the ring's, the merge's or the writer's).
ALLTOALL_TAG = 7501


def _rowtype(row_nbytes: int) -> Any:
    """A committed MPI datatype of one row of ``row_nbytes`` bytes (free it after use)."""
    from mpi4py import MPI

    t = MPI.BYTE.Create_contiguous(max(1, row_nbytes))
    t.Commit()
    return t


def _typed(dtype: Any) -> Any:
    """The MPI datatype a reduction sums ``dtype`` in (float32 or float64)."""
    from mpi4py import MPI

    types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}
    try:
        return types[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"reductions need float32 or float64 buffers, got {dtype}") from None


def gatherv(c: Any, x: Any, counts: Sequence[int], root: int | None) -> Any:
    """:meth:`Comm.gatherv_rows <mpiattn.comm.core.Comm.gatherv_rows>` on the Comm ``c``."""
    xp = backend.array_module(x)
    row_nbytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize
    total = int(sum(counts))
    want = root is None or root == c.rank
    out = xp.empty((total,) + x.shape[1:], dtype=x.dtype) if want else None
    if row_nbytes == 0 or total == 0:
        return out
    c.count_bytes({d: int(x.nbytes) for d in (range(c.size) if root is None else [root])})
    t = _rowtype(row_nbytes)
    try:
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        sbuf = c.send_buffer(x)
        if out is not None:
            rbuf, finish = c.recv_buffer(out)
            rspec = [rbuf, (list(map(int, counts)), list(map(int, displs))), t]
        else:
            rbuf, finish, rspec = None, None, None
        if root is None:
            c.mpi.Allgatherv([sbuf, x.shape[0], t], rspec)
        else:
            c.mpi.Gatherv([sbuf, x.shape[0], t], rspec, root=root)
        if finish is not None:
            finish()
    finally:
        t.Free()
    return out


def alltoallv(c: Any, x: Any, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Any:
    """:meth:`Comm.alltoallv_rows <mpiattn.comm.core.Comm.alltoallv_rows>` on the Comm ``c``, as
    point-to-point messages (see the module docstring)."""
    from mpi4py import MPI

    xp = backend.array_module(x)
    row_nbytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize
    out = xp.empty((int(sum(recv_counts)),) + x.shape[1:], dtype=x.dtype)
    if row_nbytes == 0:
        return out
    c.count_bytes({d: row_nbytes * int(cnt) for d, cnt in enumerate(send_counts)})
    sc, rc = [int(n) for n in send_counts], [int(n) for n in recv_counts]
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(int).tolist()
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(int).tolist()
    t = _rowtype(row_nbytes)
    try:
        sbuf = c.send_buffer(x)
        rbuf, finish = c.recv_buffer(out)
        P, me = c.size, c.rank
        reqs = []
        for k in range(1, P):
            src = (me - k) % P
            if rc[src]:
                reqs.append(c.mpi.Irecv([rbuf[rd[src]:rd[src] + rc[src]], rc[src], t], src, ALLTOALL_TAG))
        for k in range(1, P):
            dst = (me + k) % P
            if sc[dst]:
                reqs.append(c.mpi.Isend([sbuf[sd[dst]:sd[dst] + sc[dst]], sc[dst], t], dst, ALLTOALL_TAG))
        if sc[me]:
            rbuf[rd[me]:rd[me] + rc[me]] = sbuf[sd[me]:sd[me] + sc[me]]
        MPI.Request.Waitall(reqs)
        if finish is not None:
            finish()
    finally:
        t.Free()
    return out


def allreduce(c: Any, x: Any) -> Any:
    """:meth:`Comm.allreduce_ <mpiattn.comm.core.Comm.allreduce_>` on the Comm ``c`` (more than
    one rank, a non-empty ``x``): a reduce to rank 0 and a broadcast, in place; returns ``x``."""
    from mpi4py import MPI

    c.count_bytes({0: int(x.nbytes)} if c.rank else {d: int(x.nbytes) for d in range(c.size)})
    buf, finish = c.recv_buffer(x, keep=True)
    spec = [buf, _typed(x.dtype)]
    c.mpi.Reduce(MPI.IN_PLACE if c.rank == 0 else spec, spec if c.rank == 0 else None,
                 op=MPI.SUM, root=0)
    c.mpi.Bcast(spec, root=0)
    if finish is not None:
        finish()
    return x


def reduce_scatterv(c: Any, x: Any, counts: Sequence[int]) -> Any:
    """:meth:`Comm.reduce_scatterv_rows <mpiattn.comm.core.Comm.reduce_scatterv_rows>` on the
    Comm ``c``."""
    from mpi4py import MPI

    xp = backend.array_module(x)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = xp.empty((int(counts[c.rank]),) + x.shape[1:], dtype=x.dtype)
    if c.size == 1:
        out[...] = x
        return out
    if row == 0:
        return out
    c.count_bytes({d: row * x.dtype.itemsize * int(cnt) for d, cnt in enumerate(counts)})
    sbuf = c.send_buffer(xp.ascontiguousarray(x))
    rbuf, finish = c.recv_buffer(out)
    c.mpi.Reduce_scatter([sbuf, _typed(x.dtype)],
                         [rbuf, _typed(x.dtype)],
                         [int(n) * row for n in counts], op=MPI.SUM)
    if finish is not None:
        finish()
    return out
