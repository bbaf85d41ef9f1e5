"""The NCCL transport: ring shifts over one NCCL communicator, each step's send and receive grouped.

Ring neighbours only: messages ``r -> r+1`` and ``r-1 -> r`` go through NCCL;
anything else, and the collectives, through a
:class:`~mpiattn.comm.staged.StagedTransport`.

One communicator per :class:`~mpiattn.comm.Comm` and one stream. NCCL's
point-to-point operations block their stream until the peer posts the
matching one, and NCCL's documentation warns that several communicators
whose kernels may wait on each other can deadlock (and NVIDIA/nccl#195).
So queued operations are issued in groups (``groupStart``/``groupEnd``) of
at most one send and one receive, paired in posting order: the ``j``-th send
to ``r+1`` with the ``j``-th receive from ``r-1``. On every rank group
``j`` then holds the ``j``-th message of each ring edge, which the neighbours'
group ``j`` completes, so no group waits for a later one. A receive or send
whose partner has not been asked for yet is issued alone when someone waits
for it. NCCL has no tags: messages on an edge match in posting order, which
:func:`mpiattn.comm.ring.circulate` keeps the same on both ends.

Waiting for a request never blocks the host: the current stream waits for
the group's event on the GPU (the transports' stream contract).

CUDA's lazy module loading (the default since CUDA 12.2) can deadlock
concurrent NCCL kernels with other kernels that load their module late; run
with ``CUDA_MODULE_LOADING=EAGER`` (set before CUDA starts: in the job
script). The transport logs a one-line notice from rank 0 when it is not set.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any, Callable

from .staged import StagedTransport
from .transports import _check_contiguous, _Done, _Request

__all__ = ["NcclTransport", "EAGER_VARIABLE"]

#: The environment variable NCCL needs set to ``EAGER`` before CUDA starts.
EAGER_VARIABLE = "CUDA_MODULE_LOADING"

_log = logging.getLogger("mpiattn.gpu")


class _Op(_Request):
    """One NCCL send or receive: queued, then issued in a group; done when its group's event is."""

    __slots__ = ("t", "kind", "arr", "peer", "event")

    def __init__(self, t: "NcclTransport", kind: str, arr: Any, peer: int):
        self.t, self.kind, self.arr, self.peer, self.event = t, kind, arr, peer, None

    def _issued(self) -> Any:
        if self.event is None:
            self.t.issue(self)
        return self.event

    def Test(self) -> bool:  # noqa: N802
        ev = self._issued()
        if not ev.done:
            return False
        self.Wait()
        return True

    def Wait(self) -> None:  # noqa: N802
        cp = self.t._cp
        cp.cuda.get_current_stream().wait_event(self._issued())  # on the GPU, not the host
        self.arr = None


class NcclTransport:
    """Ring shifts over one NCCL communicator and stream, send+receive grouped per step.

    Bootstrapped over MPI: rank 0's ``ncclGetUniqueId`` is broadcast and every
    rank joins (``ncclCommInitRank``, blocking and collective; a rank failing
    there aborts the job instead of leaving the others waiting).
    """

    name = "nccl"

    def __init__(self, comm: Any, cupy: Any):
        from cupy.cuda import nccl

        self._cp, self._nccl, self.reason = cupy, nccl, ""
        self.rank, self.size = comm.rank, comm.size
        self.staged = StagedTransport(comm, cupy)
        uid = comm.allgather_checked(lambda: nccl.get_unique_id() if comm.rank == 0 else None)[0]
        with comm.abort_on_error():
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.sends: collections.deque[_Op] = collections.deque()
        self.recvs: collections.deque[_Op] = collections.deque()
        self.groups = 0  # groups issued (for tests and reports)
        if comm.rank == 0 and os.environ.get(EAGER_VARIABLE, "").upper() != "EAGER":
            _log.warning("mpiattn: the nccl transport runs without %s=EAGER; CUDA's lazy loading "
                         "can deadlock NCCL kernels (set it in the job script)", EAGER_VARIABLE)

    def _neighbour(self, src: int, dst: int) -> bool:
        return self.size > 1 and dst == (src + 1) % self.size

    def _group(self, ops: list[_Op]) -> None:
        """Issue ``ops`` (at most one send and one receive) as one group on the stream."""
        cp, nccl = self._cp, self._nccl
        self.stream.wait_event(cp.cuda.get_current_stream().record(cp.cuda.Event(disable_timing=True)))
        nccl.groupStart()
        for op in ops:
            getattr(self.comm, op.kind)(op.arr.data.ptr, op.arr.nbytes, nccl.NCCL_UINT8, op.peer,
                                        self.stream.ptr)
        nccl.groupEnd()
        ev = self.stream.record(cp.cuda.Event(disable_timing=True))
        for op in ops:
            op.event = ev
        self.groups += 1

    def _pair(self) -> None:
        while self.sends and self.recvs:
            self._group([self.sends.popleft(), self.recvs.popleft()])

    def issue(self, op: _Op) -> None:
        """Issue the queued operations up to ``op`` (pairs first; the rest alone, in order)."""
        self._pair()
        queue = self.sends if op.kind == "send" else self.recvs
        while op.event is None:
            self._group([queue.popleft()])

    def _queue(self, kind: str, arr: Any, peer: int) -> _Request:
        _check_contiguous(arr)
        if arr.nbytes == 0:  # both ends skip, as sizes match
            return _Done()
        op = _Op(self, kind, arr, peer)
        (self.sends if kind == "send" else self.recvs).append(op)
        self._pair()
        return op

    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        if not self._neighbour(self.rank, dest):
            return self.staged.isend(arr, dest, tag)
        return self._queue("send", arr, dest)

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        if not self._neighbour(source, self.rank):
            return self.staged.irecv(arr, source, tag)
        return self._queue("recv", arr, source)

    def loopback(self, src: Any, dst: Any) -> None:
        """Send ``src`` to this rank and receive it into ``dst`` in one NCCL group (a self-test)."""
        _check_contiguous(src)
        _check_contiguous(dst)
        if src.nbytes != dst.nbytes:
            raise ValueError("loopback needs buffers of equal size")
        s, r = _Op(self, "send", src, self.rank), _Op(self, "recv", dst, self.rank)
        self._group([s, r])
        r.Wait()

    def send_buf(self, arr: Any) -> Any:
        return self.staged.send_buf(arr)

    def recv_buf(self, arr: Any, keep: bool = False) -> tuple[Any, Callable[[], None] | None]:
        return self.staged.recv_buf(arr, keep=keep)

    def close(self) -> None:
        while self.sends or self.recvs:
            op = (self.sends or self.recvs)[0]
            self.issue(op)
        self.staged.close()
        self.stream.synchronize()
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
