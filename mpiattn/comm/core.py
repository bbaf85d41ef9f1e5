"""The Comm wrapper: point-to-point and row collectives on one duplicated communicator.

Everything that crosses ranks goes through :class:`Comm`:

* non-blocking point-to-point of contiguous arrays (``isend``/``irecv``), on
  which the ring pipeline (:mod:`mpiattn.comm.ring`) is built;
* row-wise collectives on contiguous buffers with explicit datatypes:
  ``gatherv_rows``, ``allgatherv_rows``, ``reduce_scatterv_rows``,
  ``alltoallv_rows``, ``allreduce_`` (each method its collective point; the
  MPI calls behind it in :mod:`mpiattn.comm.rows`);
* collective error agreement (:mod:`mpiattn.comm.errors`) as methods.

CuPy buffers go through the Comm's ``device_transport``, which
:func:`mpiattn.comm.device.prepare` sets at a collective point of a public
call (every rank there) before any device buffer is sent; a Comm never
decides it inside a send.

``bytes_sent`` counts the payload bytes this rank hands to MPI for other
ranks, ``bytes_between`` those of them addressed to ranks on other nodes
(by the Comm's :class:`~mpiattn.comm.topology.Topology`; collectives are
counted as if each rank sent its part to each destination directly).
Benchmarks and tests read them; they cost a few integer additions per call.

``import mpiattn`` does not import ``mpi4py.MPI`` (which would initialise
MPI). :func:`get_comm` duplicates the user's communicator on first use and
keeps the duplicate as an MPI attribute of the user's communicator (MPI's
own attribute caching, ``MPI_Comm_create_keyval``), so library traffic never
matches user messages, and the duplicate is freed when the user frees their
communicator: nothing outlives it, and a program that makes and frees
thousands of communicators does not run out of context ids. At the same
point the Comm learns which ranks share a node (:mod:`mpiattn.comm.node`),
and the first collective check of a public call on it warns when those
ranks run more BLAS threads than the node has cores.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

from .. import backend
from . import errors, node, rows
from .discipline import Discipline, checking_timeout
from .topology import Topology

__all__ = ["Comm", "Request", "get_comm", "find_comm"]

#: The MPI attribute key under which a user's communicator keeps its :class:`Comm`
#: (created once MPI runs; the only process-wide object here, MPI's own kind of key).
_KEYVAL: list = []


def _release(user_comm: Any, keyval: int, wrapped: "Comm") -> None:
    """MPI's delete callback: the user freed their communicator, so free ours too."""
    if isinstance(wrapped, Comm):
        wrapped.free()


def _keyval() -> int:
    if not _KEYVAL:
        from mpi4py import MPI

        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_release))
    return _KEYVAL[0]


def find_comm(comm: Any = None) -> "Comm | None":
    """The :class:`Comm` :func:`get_comm` made for ``comm``, or None (local: never creates one)."""
    if isinstance(comm, Comm):
        return comm
    from mpi4py import MPI

    base = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(base, MPI.Intracomm) or base == MPI.COMM_NULL or not _KEYVAL:
        return None
    return base.Get_attr(_KEYVAL[0])


def get_comm(comm: Any = None) -> "Comm":
    """Return the :class:`Comm` of ``comm`` (default ``MPI.COMM_WORLD``).

    The first call for a communicator duplicates it (a collective call on
    that communicator) and attaches the wrapper to it as an MPI attribute;
    later calls find it there. Freeing ``comm`` frees the duplicate.
    """
    if isinstance(comm, Comm):
        return comm
    from mpi4py import MPI

    base = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(base, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py.MPI.Intracomm, got {type(base).__name__}")
    if base == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL (freed, or not a member of it)")
    key = _keyval()
    wrapped = base.Get_attr(key)
    if wrapped is None:
        wrapped = Comm(base.Dup())
        wrapped.node = node.node_info(wrapped.mpi)  # collective, like the Dup: every rank is here
        wrapped.topology = Topology.of(wrapped.mpi)
        base.Set_attr(key, wrapped)
    return wrapped


def _caller() -> str:
    """The name of the function that called the caller (a collective check's default name)."""
    code = sys._getframe(2).f_code
    return getattr(code, "co_qualname", code.co_name)


class Request:
    """An MPI request plus what must happen once it completes (``wait()``; ``req.Test()``)."""

    __slots__ = ("req", "keep", "finish")

    def __init__(self, req: Any, keep: Any, finish: Callable[[], None] | None = None):
        self.req, self.keep, self.finish = req, keep, finish

    def wait(self) -> None:
        self.req.Wait()
        if self.finish is not None:
            self.finish()
            self.finish = None


class Comm:
    """mpiattn's view of one (duplicated) intracommunicator.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Intracomm
        A communicator reserved for mpiattn's traffic.
    """

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        #: Payload bytes this rank has handed to MPI for other ranks.
        self.bytes_sent = 0
        #: Of those, the bytes addressed to ranks on other nodes (by :attr:`topology`).
        self.bytes_between = 0
        #: Which ranks share a node (:class:`mpiattn.comm.topology.Topology`); :func:`get_comm`
        #: sets it, one node for a Comm made directly.
        self.topology: Topology = Topology(((tuple(range(self.size))),))
        #: Sub-communicators made by :meth:`split`, by key (freed with this Comm).
        self._splits: dict = {}
        #: For a sub-communicator: its parent Comm and the parent's rank of each of its ranks
        #: (its bytes are counted in the parent's counters too).
        self._parent: tuple | None = None
        #: How device (CuPy) buffers cross ranks: "staged" (through host
        #: memory), "cuda-aware" (device pointers handed to MPI) or "nccl";
        #: None until :func:`mpiattn.comm.device.configure` (called at a
        #: collective point of a public call) sets it, with
        #: ``device_transport``, the object that moves them.
        self.transport: str | None = None
        self.device_transport: Any = None
        #: This rank's node (:class:`mpiattn.comm.node.NodeInfo`); :func:`get_comm`
        #: sets it, None for a Comm made directly.
        self.node: node.NodeInfo | None = None
        #: Clean-ups an abort of this Comm runs first (:meth:`cleanup_on_abort`).
        self._abort_hooks: list[Callable[[], Any]] = []
        #: Whether the BLAS threads of this Comm's node were checked (:meth:`allgather_checked`).
        self._threads_checked = False
        #: The GPU bound for this Comm's ranks (:func:`mpiattn.gpu.bind_device`), or None.
        self.gpu_device: Any = None
        #: Collective checks opened on this Comm (:meth:`allgather_checked`'s call numbers).
        self.calls = 0
        #: The collective discipline: call sites compared in the checking mode, departure
        #: notices, one thread at a time (:mod:`mpiattn.comm.discipline`).
        self.discipline = Discipline(mpi_comm, checking_timeout())

    def free(self) -> None:
        """Release the sub-communicators, the device transport and the duplicate (local; idempotent)."""
        for sub in self._splits.values():
            sub.free()
        self._splits.clear()
        self.discipline.close()
        if self.device_transport is not None:
            transport, self.device_transport = self.device_transport, None
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - freeing must not fail
                pass
        from mpi4py import MPI

        if self.mpi != MPI.COMM_NULL and not MPI.Is_finalized():
            self.mpi.Free()

    # ------------------------------------------------------------------ errors
    def collective_errors(self) -> contextlib.AbstractContextManager[None]:
        """:func:`mpiattn.comm.errors.agree` on this communicator (a purely local block)."""
        return errors.agree(self.mpi, before=lambda: self.discipline.point("Comm.collective_errors"))

    def point(self, what: str) -> None:
        """A collective pattern of point-to-point messages starts here (the ring, the tree merge,
        the writers' token): :meth:`mpiattn.comm.discipline.Discipline.point`."""
        self.discipline.point(what)

    def allgather_checked(self, fn: Callable[[], Any], call: str | None = None) -> list:
        """:func:`mpiattn.comm.errors.allgather_checked` on this communicator.

        Every public call starts with it. ``call`` names it (default: the
        calling function); with the number of checks made on this Comm so
        far it tags the check, so that ranks in different calls get one clear
        error instead of mismatched messages. The first one on this Comm also
        warns (no communication) when the node is oversubscribed with BLAS
        threads (:func:`mpiattn.comm.node.warn_if_oversubscribed`).
        """
        return self._checked(fn, call or _caller())

    def agree(self, fn: Callable[[], dict], call: str | None = None) -> list:
        """:meth:`allgather_checked` of the local dict ``fn()``, then every field whose name does
        not start with ``_`` compared with rank 0's (:func:`mpiattn.comm.errors.same_fields`:
        "ranks disagree on X: rank 0 has ..., rank 2 has ..."). Returns every rank's dict."""
        got = self._checked(fn, call or _caller())
        with errors.alike():
            errors.same_fields(got)
        return got

    def _checked(self, fn: Callable[[], Any], call: str) -> list:
        if self.node is not None and not self._threads_checked:
            self._threads_checked = True
            node.warn_if_oversubscribed(self.node)
        self.calls += 1
        with self.discipline.claim(call):
            self.discipline.point(call)
            try:
                return errors.allgather_checked(self.mpi, fn, (call, self.calls),
                                                lambda obj: self.discipline.allgather(obj, call))
            except errors.CallMismatch as exc:  # every rank is here: be in step again from now on
                self.calls = max(t[1] for t in exc.tags if isinstance(t, tuple) and len(t) == 2)
                raise

    def abort_on_error(self) -> contextlib.AbstractContextManager[None]:
        """:func:`mpiattn.comm.errors.abort_on_error` on this communicator.

        The clean-ups of :meth:`cleanup_on_abort` run before the abort. The block holds
        this Comm for its thread (:meth:`mpiattn.comm.discipline.Discipline.claim`).
        """
        return self._abort_on_error(_caller())

    @contextlib.contextmanager
    def _abort_on_error(self, what: str) -> Iterator[None]:
        self.discipline.live(what)  # a freed communicator: refused before any abort
        with self.discipline.claim(what), errors.abort_on_error(self.mpi, self._abort_hooks):
            yield

    @contextlib.contextmanager
    def cleanup_on_abort(self, hook: Callable[[], Any]) -> Iterator[None]:
        """Inside the block, an abort through this Comm first runs ``hook()`` (local, never raising)."""
        self._abort_hooks.append(hook)
        try:
            yield
        finally:
            self._abort_hooks.remove(hook)

    def count_bytes(self, per_dest: dict) -> None:
        """Add the bytes this rank sends to each destination (itself excluded) to the counters
        (a sub-communicator's to its parent's as well)."""
        for dest, nbytes in per_dest.items():
            if dest != self.rank and nbytes:
                self.bytes_sent += nbytes
                if not self.topology.same_node(self.rank, dest):
                    self.bytes_between += nbytes
        if self._parent is not None:
            parent, ranks = self._parent
            parent.count_bytes({ranks[d]: nbytes for d, nbytes in per_dest.items()})

    def split(self, ranks: Sequence[int]) -> "Comm":
        """The Comm of a sub-communicator of the given ranks of this one (collective on this Comm).

        Every rank calls it with its own group's ``ranks`` (the groups a
        partition of the ranks, the same list on each of the group's ranks);
        rank ``i`` of the result is ``ranks[i]`` here. Made once per group
        and kept, with its restricted topology; freed with this Comm.
        """
        key = tuple(int(r) for r in ranks)
        sub = self._splits.get(key)
        if sub is None:
            self.discipline.point("Comm.split")
            sub = Comm(self.mpi.Split(min(key), key.index(self.rank)))
            sub.topology = self.topology.restricted(key)
            sub.node = self.node
            sub._parent = (self, key)
            sub.gpu_device = self.gpu_device
            self._splits[key] = sub
        return sub

    # ------------------------------------------------------------- small data
    def allgather_obj(self, obj: Any) -> list:
        """Pickle-based allgather for small metadata (never for array data)."""
        self.discipline.point("Comm.allgather_obj")
        return self.mpi.allgather(obj)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Pickle-based broadcast for small metadata."""
        self.discipline.point("Comm.bcast_obj")
        return self.mpi.bcast(obj, root=root)

    def barrier(self) -> None:
        self.discipline.point("Comm.barrier")
        self.mpi.Barrier()

    # ------------------------------------------------------- buffer transport
    def _device(self) -> Any:
        """The device-buffer transport, which a collective point must have set already."""
        if self.device_transport is None:
            raise RuntimeError(
                "a CuPy buffer reached mpiattn's Comm before its device transport was chosen; "
                "call mpiattn.comm.device.prepare(comm, *arrays) at a point every rank reaches")
        return self.device_transport

    def send_buffer(self, arr: Any) -> Any:
        """What MPI sends of ``arr``: the array itself, or the device transport's buffer of a CuPy array."""
        if not backend.is_cupy_array(arr):
            return arr
        return self._device().send_buf(arr)

    def recv_buffer(self, arr: Any, keep: bool = False) -> tuple[Any, Callable[[], None] | None]:
        """What MPI receives into for ``arr``, and what completes it after the receive (None: nothing;
        a CuPy array through the device transport; ``keep``: its contents are sent as well)."""
        if not backend.is_cupy_array(arr):
            return arr, None
        return self._device().recv_buf(arr, keep=keep)

    def isend(self, arr: Any, dest: int, tag: int) -> Request:
        """Non-blocking send of a contiguous array (as bytes)."""
        if dest != self.rank:
            self.count_bytes({dest: int(arr.nbytes)})
        if backend.is_cupy_array(arr):
            return self._device().isend(arr, dest, tag)
        from mpi4py import MPI

        return Request(self.mpi.Isend([arr, arr.nbytes, MPI.BYTE], dest=dest, tag=tag), arr)

    def irecv(self, arr: Any, source: int, tag: int) -> Request:
        """Non-blocking receive into a contiguous array (as bytes)."""
        if backend.is_cupy_array(arr):
            return self._device().irecv(arr, source, tag)
        from mpi4py import MPI

        return Request(self.mpi.Irecv([arr, arr.nbytes, MPI.BYTE], source=source, tag=tag), arr)

    # ------------------------------------------------------ row collectives
    def gatherv_rows(self, x: Any, counts: Sequence[int], root: int | None = 0) -> Any:
        """Gather the rows (axis 0) of contiguous arrays with equal trailing shapes.

        ``counts[r]`` is rank r's number of rows. Returns the concatenation on
        ``root`` (every rank when ``root`` is None), else None.
        """
        self.discipline.point("Comm.gatherv_rows")
        return rows.gatherv(self, x, counts, root)

    def allgatherv_rows(self, x: Any, counts: Sequence[int]) -> Any:
        """:meth:`gatherv_rows` to every rank."""
        return self.gatherv_rows(x, counts, root=None)

    def alltoallv_rows(self, x: Any, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Any:
        """All-to-all of row blocks along axis 0 of a contiguous array.

        Rows ``[sum(send_counts[:d]), sum(send_counts[:d+1]))`` go to rank ``d``;
        the result holds the rows from rank 0, 1, ... in order.
        Point-to-point messages, not ``MPI_Alltoallv`` (why: :mod:`mpiattn.comm.rows`).
        """
        self.discipline.point("Comm.alltoallv_rows")
        return rows.alltoallv(self, x, send_counts, recv_counts)

    def allreduce_(self, x: Any) -> Any:
        """Sum a contiguous float32/float64 array over all ranks, in place; returns ``x``.

        The result is bitwise identical on every rank (a reduce to rank 0 and
        a broadcast: MPI only *recommends* that ``MPI_Allreduce`` give every
        rank the same bits, and replicated parameters must never drift apart).
        """
        if self.size == 1 or x.size == 0:
            return x
        self.discipline.point("Comm.allreduce_")
        return rows.allreduce(self, x)

    def reduce_scatterv_rows(self, x: Any, counts: Sequence[int]) -> Any:
        """Sum ``x`` (rows along axis 0, float32/float64) over ranks; rank r keeps its ``counts[r]`` rows.

        Row ``[sum(counts[:r]), sum(counts[:r+1]))`` of the sum lands on rank r.
        """
        self.discipline.point("Comm.reduce_scatterv_rows")
        return rows.reduce_scatterv(self, x, counts)
