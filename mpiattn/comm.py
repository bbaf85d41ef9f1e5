"""Communication: a thin wrapper around an mpi4py intracommunicator.

Everything that crosses ranks goes through :class:`Comm`:

* the ring pipeline :meth:`Comm.circulate` (non-blocking ``Isend``/``Irecv``,
  the next piece in flight while the current one is computed, optional
  accumulators that ride along with their pieces and come home at the end);
* row-wise collectives on contiguous buffers with explicit datatypes:
  ``gatherv_rows``, ``allgatherv_rows``, ``reduce_scatterv_rows``,
  ``alltoallv_rows``, ``allreduce_``;
* collective error agreement: :meth:`Comm.collective_errors` turns an
  exception raised on some ranks into the same exception on every rank, and
  :meth:`Comm.abort_on_error` ends the whole job when a rank fails where the
  others could otherwise wait for it forever.

``import mpiattn`` does not import ``mpi4py.MPI`` (which would initialise
MPI). :func:`get_comm` duplicates the user's communicator on first use and
caches the duplicate, so library traffic never matches user messages.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import backend

__all__ = ["Comm", "Piece", "get_comm", "CollectiveError"]


class CollectiveError(RuntimeError):
    """Raised on every rank when a rank failed with an exception that cannot be rebuilt."""


_CACHE: dict[int, tuple[Any, "Comm"]] = {}


def get_comm(comm: Any = None) -> "Comm":
    """Return the cached :class:`Comm` for ``comm`` (default ``MPI.COMM_WORLD``).

    The first call for a communicator duplicates it (a collective call on
    that communicator); later calls return the cached wrapper.
    """
    if isinstance(comm, Comm):
        return comm
    from mpi4py import MPI

    base = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(base, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py.MPI.Intracomm, got {type(base).__name__}")
    hit = _CACHE.get(id(base))
    if hit is not None and hit[0] is base:
        return hit[1]
    wrapped = Comm(base.Dup())
    _CACHE[id(base)] = (base, wrapped)
    return wrapped


@dataclass
class Piece:
    """One block of rows travelling round the ring.

    Attributes
    ----------
    owner : int
        The rank whose shard these rows belong to.
    start, stop : int
        Global row range ``[start, stop)``.
    local : slice
        The same rows as positions in the owner's shard.
    data : tuple of arrays
        Read-only arrays, each ``(..., stop - start, ...)`` along axis -2.
    acc : tuple of arrays
        Accumulators for these rows; the consumer adds into them in place.
    """

    owner: int
    start: int
    stop: int
    local: slice
    data: tuple
    acc: tuple


class _Pending:
    """An MPI request plus what must happen once it completes."""

    __slots__ = ("req", "keep", "finish")

    def __init__(self, req: Any, keep: Any, finish: Callable[[], None] | None = None):
        self.req, self.keep, self.finish = req, keep, finish

    def wait(self) -> None:
        self.req.Wait()
        if self.finish is not None:
            self.finish()
            self.finish = None


def _row_segments_to_pieces(segs: Sequence[tuple[int, int]], block: int) -> list[tuple[int, int, int]]:
    """Split an owner's segments into pieces ``(global_start, local_start, rows)`` of <= block rows."""
    out, local = [], 0
    for g, ln in segs:
        for off in range(0, ln, block):
            rows = min(block, ln - off)
            out.append((g + off, local + off, rows))
        local += ln
    return out


class Comm:
    """mpiattn's view of one (duplicated) intracommunicator.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Intracomm
        A communicator reserved for mpiattn's traffic.
    """

    #: How device (CuPy) buffers cross ranks: "staged" (through host memory),
    #: "cuda-aware" (device pointers handed to MPI) or "nccl". Set, with
    #: ``device_transport`` (the object that moves them), by
    #: :func:`mpiattn.gpu.configure` the first time a CuPy array is sent.
    transport = "staged"
    device_transport: Any = None

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()

    # ------------------------------------------------------------------ errors
    @contextlib.contextmanager
    def collective_errors(self) -> Iterator[None]:
        """Make an exception raised inside the block be raised on every rank.

        The block must be purely local (no communication): a rank that raises
        skips the rest of it. At the end every rank learns whether any rank
        failed (one small allreduce) and, if so, every rank raises the
        exception of the lowest failing rank: the same type and message.
        """
        err: BaseException | None = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - re-raised collectively below
            err = exc
        from mpi4py import MPI

        if self.size == 1:
            if err is not None:
                raise err
            return
        failed = self.mpi.allreduce(0 if err is None else 1, op=MPI.SUM)
        if failed:
            report = None if err is None else (type(err), str(err))
            self._raise_first(self.mpi.allgather(report), err)

    def allgather_checked(self, fn: Callable[[], Any]) -> list:
        """Run the local function ``fn`` on every rank and allgather its results.

        One collective serves both: if ``fn`` raised on any rank, every rank
        raises the exception of the lowest failing rank (same type and
        message), as :meth:`collective_errors` does; otherwise every rank gets
        the list of all ranks' results (small, pickled metadata).
        """
        err: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised collectively below
            err = exc
        if self.size == 1:
            if err is not None:
                raise err
            return [result]
        reports = self.mpi.allgather((None if err is None else (type(err), str(err)), result))
        if any(rep is not None for rep, _ in reports):
            self._raise_first([rep for rep, _ in reports], err)
        return [res for _, res in reports]

    def _raise_first(self, reports: list, err: BaseException | None) -> None:
        """Raise, identically on every rank, the first of the ranks' (type, message) reports."""
        failed = sum(rep is not None for rep in reports)
        first = next(r for r, rep in enumerate(reports) if rep is not None)
        cls, msg = reports[first]
        if failed > 1 or first != 0:
            msg = f"{msg} (raised on rank {first}{f' and {failed - 1} other rank(s)' if failed > 1 else ''})"
        try:
            exc = cls(msg)
        except Exception:  # noqa: BLE001 - exotic constructor
            exc = CollectiveError(f"{cls.__name__}: {msg}")
        if err is not None:
            raise exc from err
        raise exc

    @contextlib.contextmanager
    def abort_on_error(self) -> Iterator[None]:
        """Abort the whole job when the block raises on any rank (P > 1).

        Used around communication-heavy sections, where a rank that stops
        early would leave its peers blocked in MPI forever. With one rank the
        exception propagates normally.
        """
        try:
            yield
        except BaseException as exc:
            if self.size == 1:
                raise
            sys.stderr.write(
                f"mpiattn: rank {self.rank} of {self.size} failed during communication: "
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                "mpiattn: aborting the job so no rank waits forever\n")
            sys.stderr.flush()
            self.mpi.Abort(1)

    # ------------------------------------------------------------- small data
    def allgather_obj(self, obj: Any) -> list:
        """Pickle-based allgather for small metadata (never for array data)."""
        return self.mpi.allgather(obj)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Pickle-based broadcast for small metadata."""
        return self.mpi.bcast(obj, root=root)

    def barrier(self) -> None:
        self.mpi.Barrier()

    # ------------------------------------------------------- buffer transport
    def _device(self) -> Any:
        """The device-buffer transport; chosen collectively on first use (:mod:`mpiattn.gpu`)."""
        if self.device_transport is None:
            from . import gpu

            gpu.configure(self)
        return self.device_transport

    def _send_buf(self, arr: Any) -> Any:
        if not backend.is_cupy_array(arr):
            return arr
        return self._device().send_buf(arr)

    def _recv_buf(self, arr: Any) -> tuple[Any, Callable[[], None] | None]:
        if not backend.is_cupy_array(arr):
            return arr, None
        return self._device().recv_buf(arr)

    def isend(self, arr: Any, dest: int, tag: int) -> _Pending:
        """Non-blocking send of a contiguous array (as bytes)."""
        if backend.is_cupy_array(arr):
            return self._device().isend(arr, dest, tag)
        from mpi4py import MPI

        return _Pending(self.mpi.Isend([arr, arr.nbytes, MPI.BYTE], dest=dest, tag=tag), arr)

    def irecv(self, arr: Any, source: int, tag: int) -> _Pending:
        """Non-blocking receive into a contiguous array (as bytes)."""
        if backend.is_cupy_array(arr):
            return self._device().irecv(arr, source, tag)
        from mpi4py import MPI

        return _Pending(self.mpi.Irecv([arr, arr.nbytes, MPI.BYTE], source=source, tag=tag), arr)

    # ----------------------------------------------------------- ring pipeline
    def circulate(self, data: Sequence[Any], n: int, layout: str, block: int,
                  acc_out: Sequence[Any] = ()) -> Iterator[Piece]:
        """Stream every rank's rows past this rank, block by block, in ring order.

        Rank ``r`` sees its own rows first, then those of ``r-1``, ``r-2``,
        ..., ``r-P+1``. Each piece received from ``r-1`` is forwarded to
        ``r+1`` as soon as it arrives, and the receive of the next piece is
        posted before the current one is handed to the caller (double
        buffering), so transfers overlap compute wherever the hardware lets
        them.

        Parameters
        ----------
        data : sequence of arrays, each (..., m_r, w_i)
            This rank's read-only rows (row axis -2), sent round the ring.
        n : int
            Global number of rows (``sum of m_r``), laid out by ``layout``.
        layout : str
            The layout of the rows.
        block : int
            Maximum rows per piece (bounds the memory of pieces in flight).
        acc_out : sequence of arrays, each (..., m_r, u_j)
            Accumulators for this rank's rows. For this rank's own pieces the
            caller receives views into ``acc_out``; for another rank's pieces
            it receives travelling buffers (zeros at their first stop) that
            follow the piece and, after the last rank, return to the owner,
            which adds them into ``acc_out`` before the generator finishes.

        Yields
        ------
        Piece
            The caller may read ``piece.data`` and add into ``piece.acc`` until
            it asks for the next piece.

        Notes
        -----
        Per rank: ``(P-1)`` pieces of every other rank are received, i.e.
        ``(n - m_r) * sum(w_i)`` words in, about the same out, plus
        ``(n - m_r) * sum(u_j)`` words for accumulators. Extra memory: about
        three pieces (``3 * block * (sum w_i + sum u_j)`` words per leading
        index) plus sends that have not completed yet.
        """
        from .layouts import all_segments

        P, r = self.size, self.rank
        nxt, prv = (r + 1) % P, (r - 1) % P
        segs = all_segments(n, P, layout)
        block = max(1, int(block))
        order: list[tuple[int, int, int, int]] = []  # (owner, gstart, lstart, rows)
        for s in range(P):
            o = (r - s) % P
            order.extend((o, g, l, k) for g, l, k in _row_segments_to_pieces(segs[o], block))

        xp = backend.array_module(*data, *acc_out)
        lead_d = [(d.shape[:-2], d.shape[-1], d.dtype) for d in data]
        lead_a = [(a.shape[:-2], a.shape[-1], a.dtype) for a in acc_out]
        sends: list[_Pending] = []

        def post_recv(idx: int) -> tuple[list, list, list]:
            o, _, _, k = order[idx]
            bufs_d = [xp.empty(lead + (k, w), dtype=dt) for lead, w, dt in lead_d]
            reqs = [self.irecv(b, prv, 10 + i) for i, b in enumerate(bufs_d)]
            bufs_a: list = []
            if acc_out:
                if o == prv:  # first stop of this piece: fresh accumulators
                    bufs_a = [xp.zeros(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
                else:
                    bufs_a = [xp.empty(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
                    reqs += [self.irecv(b, prv, 100 + j) for j, b in enumerate(bufs_a)]
            return bufs_d, bufs_a, reqs

        n_own = sum(1 for o, *_ in order if o == r)
        pending = post_recv(n_own) if n_own < len(order) else None
        for idx, (o, g, l, k) in enumerate(order):
            if o == r:
                bufs_d = [xp.ascontiguousarray(d[..., l:l + k, :]) for d in data]
                bufs_a = [a[..., l:l + k, :] for a in acc_out]
            else:
                bufs_d, bufs_a, reqs = pending  # type: ignore[misc]
                for q in reqs:
                    q.wait()
                pending = post_recv(idx + 1) if idx + 1 < len(order) else None
            if nxt != o:  # the next rank still needs these rows
                sends += [self.isend(b, nxt, 10 + i) for i, b in enumerate(bufs_d)]
            yield Piece(o, g, g + k, slice(l, l + k), tuple(bufs_d), tuple(bufs_a))
            if acc_out and o != r:  # pass the accumulators on (or home)
                sends += [self.isend(b, nxt, 100 + j) for j, b in enumerate(bufs_a)]
            sends = [s for s in sends if not s.req.Test()]

        if acc_out and P > 1:
            for g, l, k in _row_segments_to_pieces(segs[r], block):
                homes = [xp.empty(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
                reqs = [self.irecv(b, prv, 100 + j) for j, b in enumerate(homes)]
                for j, q in enumerate(reqs):
                    q.wait()
                    acc_out[j][..., l:l + k, :] += homes[j]
        for s in sends:
            s.wait()

    # ------------------------------------------------------ row collectives
    def _rowtype(self, row_nbytes: int) -> Any:
        from mpi4py import MPI

        t = MPI.BYTE.Create_contiguous(max(1, row_nbytes))
        t.Commit()
        return t

    def gatherv_rows(self, x: Any, counts: Sequence[int], root: int | None = 0) -> Any:
        """Gather the rows (axis 0) of contiguous arrays with equal trailing shapes.

        ``counts[r]`` is rank r's number of rows. Returns the concatenation on
        ``root`` (every rank when ``root`` is None), else None.
        """
        xp = backend.array_module(x)
        row_nbytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize
        total = int(sum(counts))
        want = root is None or root == self.rank
        out = xp.empty((total,) + x.shape[1:], dtype=x.dtype) if want else None
        if row_nbytes == 0 or total == 0:
            return out
        t = self._rowtype(row_nbytes)
        try:
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            sbuf = self._send_buf(x)
            if out is not None:
                rbuf, finish = self._recv_buf(out)
                rspec = [rbuf, (list(map(int, counts)), list(map(int, displs))), t]
            else:
                rbuf, finish, rspec = None, None, None
            if root is None:
                self.mpi.Allgatherv([sbuf, x.shape[0], t], rspec)
            else:
                self.mpi.Gatherv([sbuf, x.shape[0], t], rspec, root=root)
            if finish is not None:
                finish()
        finally:
            t.Free()
        return out

    def allgatherv_rows(self, x: Any, counts: Sequence[int]) -> Any:
        """:meth:`gatherv_rows` to every rank."""
        return self.gatherv_rows(x, counts, root=None)

    def alltoallv_rows(self, x: Any, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Any:
        """All-to-all of row blocks along axis 0 of a contiguous array.

        Rows ``[sum(send_counts[:d]), sum(send_counts[:d+1]))`` go to rank ``d``;
        the result holds the rows from rank 0, 1, ... in order.
        """
        xp = backend.array_module(x)
        row_nbytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize
        out = xp.empty((int(sum(recv_counts)),) + x.shape[1:], dtype=x.dtype)
        if row_nbytes == 0:
            return out
        t = self._rowtype(row_nbytes)
        try:
            sd = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(int).tolist()
            rd = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(int).tolist()
            sbuf = self._send_buf(x)
            rbuf, finish = self._recv_buf(out)
            self.mpi.Alltoallv([sbuf, (list(map(int, send_counts)), sd), t],
                               [rbuf, (list(map(int, recv_counts)), rd), t])
            if finish is not None:
                finish()
        finally:
            t.Free()
        return out

    def _typed(self, dtype: Any) -> Any:
        from mpi4py import MPI

        types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}
        try:
            return types[np.dtype(dtype)]
        except KeyError:
            raise TypeError(f"reductions need float32 or float64 buffers, got {dtype}") from None

    def allreduce_(self, x: Any) -> Any:
        """Sum a contiguous float32/float64 array over all ranks, in place; returns ``x``.

        The result is bitwise identical on every rank (a reduce to rank 0 and
        a broadcast: MPI only *recommends* that ``MPI_Allreduce`` give every
        rank the same bits, and replicated parameters must never drift apart).
        """
        from mpi4py import MPI

        if self.size == 1 or x.size == 0:
            return x
        buf, finish = self._recv_buf(x)
        if buf is not x:
            buf[...] = x.get()
        spec = [buf, self._typed(x.dtype)]
        self.mpi.Reduce(MPI.IN_PLACE if self.rank == 0 else spec, spec if self.rank == 0 else None,
                        op=MPI.SUM, root=0)
        self.mpi.Bcast(spec, root=0)
        if finish is not None:
            finish()
        return x

    def reduce_scatterv_rows(self, x: Any, counts: Sequence[int]) -> Any:
        """Sum ``x`` (rows along axis 0, float32/float64) over ranks; rank r keeps its ``counts[r]`` rows.

        Row ``[sum(counts[:r]), sum(counts[:r+1]))`` of the sum lands on rank r.
        """
        from mpi4py import MPI

        xp = backend.array_module(x)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        out = xp.empty((int(counts[self.rank]),) + x.shape[1:], dtype=x.dtype)
        if self.size == 1:
            out[...] = x
            return out
        if row == 0:
            return out
        sbuf = self._send_buf(xp.ascontiguousarray(x))
        rbuf, finish = self._recv_buf(out)
        self.mpi.Reduce_scatter([sbuf, self._typed(x.dtype)],
                                [rbuf, self._typed(x.dtype)],
                                [int(c) * row for c in counts], op=MPI.SUM)
        if finish is not None:
            finish()
        return out
