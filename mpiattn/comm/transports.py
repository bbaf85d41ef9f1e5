"""How CuPy buffers cross ranks: CUDA-aware MPI, pinned host staging, or NCCL.

:class:`mpiattn.comm.Comm` hands every CuPy buffer it communicates to one
transport object (chosen collectively by :mod:`mpiattn.comm.device`). All
transports offer the same methods:

``isend(arr, dest, tag)`` / ``irecv(arr, source, tag)``
    Non-blocking point-to-point of a C-contiguous array (as bytes). They
    return a request with ``wait()``, ``Test()`` and ``Wait()``, and with
    ``req`` referring to itself, so :func:`mpiattn.comm.ring.circulate` can
    treat it like its MPI requests.
``send_buf(arr)`` / ``recv_buf(arr)``
    Buffers for the blocking collectives: what to give MPI for ``arr``, and
    for receives a ``finish()`` to call once the collective returned.

Stream contract (every transport)
---------------------------------
* A send transmits ``arr`` as left by the work queued on the stream that is
  current when ``isend`` is called; the caller may drop ``arr`` at once.
* A receive may overwrite ``arr`` only after the work queued on the current
  stream before ``irecv`` (earlier users of that memory).
* After a receive's ``wait()`` (or a ``Test()`` that returned True), work
  queued on the stream current at that moment sees the data.

Transports
----------
``cuda-aware``: synchronises the current stream, then hands the device
buffer to MPI.

``staged``: device -> pinned host copies on a dedicated copy stream, ordered
by events. ``isend`` returns at once: the device-to-host copy waits on the
GPU for the producing stream, and the MPI send is posted (in order) by the
next transport call that sees the copy finished. A receive lands in pinned
memory, then a host-to-device copy runs on the copy stream and the consuming
stream waits for it on the GPU. Copies thus overlap the compute queued in
between. Pinned buffers are recycled (per size) once MPI and the copy
engine are done with them.

``nccl``: ring neighbours only (anything else goes ``staged``). Each ring
edge ``r -> r+1`` gets a NCCL communicator of its own colour (2 colours for
even P, 3 for odd P) and each communicator its own stream, so the send to
``r+1`` and the receive from ``r-1`` never queue behind each other on one
stream: NCCL operations block their stream until the peer posts the
matching one, and circulate's pipeline posts receives one piece ahead of
the sends they depend on. Messages on an edge are matched in posting order
(NCCL has no tags; circulate posts them in the same order on both ends).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import numpy as np

__all__ = ["PinnedPool", "CudaAwareTransport", "StagedTransport", "NcclTransport", "make"]

#: Free pinned bytes kept for reuse (in-flight buffers are not counted).
PINNED_KEEP_BYTES = 1 << 30


def _byte_type() -> Any:
    from mpi4py import MPI

    return MPI.BYTE


class _Request:
    """Completion handle: ``wait()``, ``Test()``, ``Wait()``, and ``req`` (itself)."""

    __slots__ = ()

    @property
    def req(self) -> "_Request":
        return self

    def wait(self) -> None:
        self.Wait()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        raise NotImplementedError

    def Wait(self) -> None:  # noqa: N802
        raise NotImplementedError


class _Done(_Request):
    """A request that completed when it was made."""

    __slots__ = ()

    def Test(self) -> bool:  # noqa: N802
        return True

    def Wait(self) -> None:  # noqa: N802
        pass


class _MpiRequest(_Request):
    """An MPI request and the buffer it must keep alive."""

    __slots__ = ("mpi_req", "keep")

    def __init__(self, mpi_req: Any, keep: Any):
        self.mpi_req, self.keep = mpi_req, keep

    def Test(self) -> bool:  # noqa: N802
        if self.keep is None:
            return True
        if self.mpi_req.Test():
            self.keep = None
            return True
        return False

    def Wait(self) -> None:  # noqa: N802
        if self.keep is not None:
            self.mpi_req.Wait()
            self.keep = None


class _EventRequest(_Request):
    """Work queued on a stream, finished when its recorded event is."""

    __slots__ = ("event", "keep")

    def __init__(self, event: Any, keep: Any):
        self.event, self.keep = event, keep

    def Test(self) -> bool:  # noqa: N802
        if self.keep is None:
            return True
        if self.event.done:
            self.keep = None
            return True
        return False

    def Wait(self) -> None:  # noqa: N802
        if self.keep is not None:
            self.event.synchronize()
            self.keep = None


def _check_contiguous(arr: Any) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError("device buffers must be C-contiguous to be communicated")


# ---------------------------------------------------------------- pinned pool
class PinnedPool:
    """Reusable page-locked host buffers, keyed by size in bytes.

    A buffer handed back with an event is reused only once the event has
    completed (a copy engine may still read or write it until then).

    Parameters
    ----------
    cupy : module
        The CuPy module (its ``cuda.alloc_pinned_memory``).
    keep_bytes : int
        Most free bytes kept; beyond that, returned buffers are released.
    """

    def __init__(self, cupy: Any, keep_bytes: int = PINNED_KEEP_BYTES):
        self._cp = cupy
        self._free: dict[int, collections.deque] = {}
        self.kept = 0
        self.keep_bytes = keep_bytes
        self.allocated = 0  # buffers made so far (for tests and reports)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 host array of ``nbytes`` that nothing else uses."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        free = self._free.get(nbytes)
        if free:
            for _ in range(len(free)):
                buf, after = free[0]
                if after is None or after.done:
                    free.popleft()
                    self.kept -= nbytes
                    return buf
                free.rotate(-1)
        mem = self._cp.cuda.alloc_pinned_memory(nbytes)
        self.allocated += 1
        return np.ndarray((nbytes,), dtype=np.uint8, buffer=mem)

    def give(self, buf: np.ndarray, after: Any = None) -> None:
        """Return ``buf``; ``after`` is an event that must complete before its reuse."""
        if buf.nbytes == 0:
            return
        if self.kept + buf.nbytes > self.keep_bytes:
            if after is not None:
                after.synchronize()  # freed memory may be handed out again at once
            return
        self._free.setdefault(buf.nbytes, collections.deque()).append((buf, after))
        self.kept += buf.nbytes


def _copy_async(cp: Any, dst_ptr: int, src_ptr: int, nbytes: int, kind: int, stream: Any) -> None:
    if nbytes:
        cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, stream.ptr)


# ------------------------------------------------------------------ cuda-aware
class CudaAwareTransport:
    """Device pointers straight to MPI, after synchronising the current stream."""

    name = "cuda-aware"

    def __init__(self, comm: Any, cupy: Any):
        self.mpi, self._cp, self.reason = comm.mpi, cupy, ""

    def _settle(self) -> None:
        # the producing kernels must be done before MPI reads, and earlier
        # users of a receive buffer before MPI writes
        self._cp.cuda.get_current_stream().synchronize()

    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        _check_contiguous(arr)
        self._settle()
        return _MpiRequest(self.mpi.Isend([arr, arr.nbytes, _byte_type()], dest=dest, tag=tag), arr)

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        _check_contiguous(arr)
        self._settle()
        return _MpiRequest(self.mpi.Irecv([arr, arr.nbytes, _byte_type()], source=source, tag=tag), arr)

    def send_buf(self, arr: Any) -> Any:
        self._settle()
        return arr

    def recv_buf(self, arr: Any) -> tuple[Any, Callable[[], None] | None]:
        self._settle()
        return arr, None

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- staged
class _StagedSend(_Request):
    __slots__ = ("t", "host", "arr", "copied", "dest", "tag", "mpi_req", "done")

    def __init__(self, t: "StagedTransport", host: np.ndarray, arr: Any, copied: Any, dest: int, tag: int):
        self.t, self.host, self.arr, self.copied = t, host, arr, copied
        self.dest, self.tag, self.mpi_req, self.done = dest, tag, None, False

    def post(self) -> None:
        self.arr = None  # the device data is in self.host now
        self.mpi_req = self.t.mpi.Isend([self.host, self.host.nbytes, _byte_type()], dest=self.dest, tag=self.tag)

    def _complete(self) -> None:
        self.t.pool.give(self.host)
        self.host, self.done = None, True

    def Test(self) -> bool:  # noqa: N802
        if self.done:
            return True
        self.t.progress()
        if self.mpi_req is not None and self.mpi_req.Test():
            self._complete()
            return True
        return False

    def Wait(self) -> None:  # noqa: N802
        if self.done:
            return
        if self.mpi_req is None:
            self.copied.synchronize()  # GPU work never waits for MPI, so this ends
            self.t.progress()  # copies finish in order: this posts every send up to this one
        self.t.until(self.mpi_req)
        self._complete()


class _StagedRecv(_Request):
    __slots__ = ("t", "host", "arr", "free_after", "mpi_req", "done")

    def __init__(self, t: "StagedTransport", host: np.ndarray, arr: Any, free_after: Any, mpi_req: Any):
        self.t, self.host, self.arr, self.free_after, self.mpi_req = t, host, arr, free_after, mpi_req
        self.done = False

    def _finish(self) -> None:
        t, cp = self.t, self.t._cp
        t.copy.wait_event(self.free_after)
        _copy_async(cp, self.arr.data.ptr, self.host.ctypes.data, self.host.nbytes,
                    cp.cuda.runtime.memcpyHostToDevice, t.copy)
        landed = t.copy.record(cp.cuda.Event(disable_timing=True))
        cp.cuda.get_current_stream().wait_event(landed)
        t.pool.give(self.host, after=landed)
        self.host = self.arr = self.free_after = None
        self.done = True

    def Test(self) -> bool:  # noqa: N802
        if self.done:
            return True
        self.t.progress()
        if self.mpi_req.Test():
            self._finish()
            return True
        return False

    def Wait(self) -> None:  # noqa: N802
        if not self.done:
            self.t.until(self.mpi_req)
            self._finish()


class StagedTransport:
    """Device buffers through pinned host memory, copies on a dedicated stream.

    Parameters
    ----------
    comm : mpiattn.comm.Comm
    cupy : module
    """

    name = "staged"

    def __init__(self, comm: Any, cupy: Any):
        self.mpi, self._cp, self.reason = comm.mpi, cupy, ""
        self.copy = cupy.cuda.Stream(non_blocking=True)
        self.pool = PinnedPool(cupy)
        self.deferred: collections.deque[_StagedSend] = collections.deque()

    def _event(self) -> Any:
        return self._cp.cuda.Event(disable_timing=True)

    def progress(self) -> None:
        """Post, in order, the sends whose device-to-host copy has finished."""
        while self.deferred and self.deferred[0].copied.done:
            self.deferred.popleft().post()

    def until(self, mpi_req: Any) -> None:
        """Complete ``mpi_req``, posting our deferred sends meanwhile.

        While a send of ours still waits for its copy, blocking inside MPI
        could leave a peer waiting for that send forever: poll instead.
        """
        pause = 1e-6
        while self.deferred:
            self.progress()
            if mpi_req.Test():
                return
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        mpi_req.Wait()

    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        _check_contiguous(arr)
        cp = self._cp
        host = self.pool.take(arr.nbytes)
        ready = cp.cuda.get_current_stream().record(self._event())
        self.copy.wait_event(ready)
        _copy_async(cp, host.ctypes.data, arr.data.ptr, arr.nbytes, cp.cuda.runtime.memcpyDeviceToHost, self.copy)
        req = _StagedSend(self, host, arr, self.copy.record(self._event()), dest, tag)
        self.deferred.append(req)  # even empty messages keep their place in the order
        self.progress()
        return req

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        _check_contiguous(arr)
        host = self.pool.take(arr.nbytes)
        free_after = self._cp.cuda.get_current_stream().record(self._event())
        mpi_req = self.mpi.Irecv([host, host.nbytes, _byte_type()], source=source, tag=tag)
        self.progress()
        return _StagedRecv(self, host, arr, free_after, mpi_req)

    def send_buf(self, arr: Any) -> Any:
        return arr.get()  # ordered after the current stream; pageable, as collectives are blocking

    def recv_buf(self, arr: Any) -> tuple[Any, Callable[[], None] | None]:
        host = np.empty(arr.shape, dtype=arr.dtype)
        return host, (lambda: arr.set(host))

    def close(self) -> None:
        for req in list(self.deferred):
            req.Wait()


# ------------------------------------------------------------------------ nccl
def edge_colour(src: int, size: int) -> int:
    """Colour of the ring edge ``src -> (src+1) % size``: a rank's two edges never share one.

    Two colours alternate round an even ring; an odd ring gives its last
    edge a third colour. One rank: colour 0.
    """
    if size == 1:
        return 0
    if size % 2 == 1 and src == size - 1:
        return 2
    return src % 2


def n_colours(size: int) -> int:
    """Number of NCCL communicators the ring needs: 1, 2 (even P) or 3 (odd P)."""
    return 1 if size == 1 else (2 if size % 2 == 0 else 3)


class NcclTransport:
    """Ring shifts over NCCL, one communicator and stream per edge colour.

    Bootstrapped over MPI: for each colour rank 0's ``ncclGetUniqueId`` is
    broadcast and every rank joins (``ncclCommInitRank``, blocking and
    collective; a rank failing there aborts the job instead of leaving the
    others waiting). Collectives and messages to non-neighbours go through a
    :class:`StagedTransport`.
    """

    name = "nccl"

    def __init__(self, comm: Any, cupy: Any):
        from cupy.cuda import nccl

        self._cp, self._nccl, self.reason = cupy, nccl, ""
        self.rank, self.size = comm.rank, comm.size
        self.staged = StagedTransport(comm, cupy)
        self.comms: list[Any] = []
        self.streams: list[Any] = []
        for _ in range(n_colours(self.size)):
            uid = comm.allgather_checked(lambda: nccl.get_unique_id() if comm.rank == 0 else None)[0]
            with comm.abort_on_error():
                self.comms.append(nccl.NcclCommunicator(self.size, uid, self.rank))
            self.streams.append(cupy.cuda.Stream(non_blocking=True))

    def _colour(self, src: int, dst: int) -> int | None:
        return edge_colour(src, self.size) if dst == (src + 1) % self.size else None

    def _launch(self, op: str, arr: Any, peer: int, colour: int) -> _Request:
        _check_contiguous(arr)
        if arr.nbytes == 0:  # both ends skip, as sizes match
            return _Done()
        cp = self._cp
        stream = self.streams[colour]
        stream.wait_event(cp.cuda.get_current_stream().record(cp.cuda.Event(disable_timing=True)))
        getattr(self.comms[colour], op)(arr.data.ptr, arr.nbytes, self._nccl.NCCL_UINT8, peer, stream.ptr)
        return _EventRequest(stream.record(cp.cuda.Event(disable_timing=True)), arr)

    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        colour = self._colour(self.rank, dest)
        if colour is None:
            return self.staged.isend(arr, dest, tag)
        return self._launch("send", arr, dest, colour)

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        colour = self._colour(source, self.rank)
        if colour is None:
            return self.staged.irecv(arr, source, tag)
        return self._launch("recv", arr, source, colour)

    def loopback(self, src: Any, dst: Any) -> None:
        """Send ``src`` to this rank and receive it into ``dst`` in one NCCL group (a self-test)."""
        _check_contiguous(src)
        _check_contiguous(dst)
        if src.nbytes != dst.nbytes:
            raise ValueError("loopback needs buffers of equal size")
        cp, nccl = self._cp, self._nccl
        stream = self.streams[0]
        stream.wait_event(cp.cuda.get_current_stream().record(cp.cuda.Event(disable_timing=True)))
        nccl.groupStart()
        self.comms[0].send(src.data.ptr, src.nbytes, nccl.NCCL_UINT8, self.rank, stream.ptr)
        self.comms[0].recv(dst.data.ptr, dst.nbytes, nccl.NCCL_UINT8, self.rank, stream.ptr)
        nccl.groupEnd()
        cp.cuda.get_current_stream().wait_event(stream.record(cp.cuda.Event(disable_timing=True)))

    def send_buf(self, arr: Any) -> Any:
        return self.staged.send_buf(arr)

    def recv_buf(self, arr: Any) -> tuple[Any, Callable[[], None] | None]:
        return self.staged.recv_buf(arr)

    def close(self) -> None:
        self.staged.close()
        for s in self.streams:
            s.synchronize()
        for c in self.comms:
            c.destroy()
        self.comms = []


def make(name: str, comm: Any, cupy: Any) -> Any:
    """The transport object called ``name`` for ``comm``."""
    cls = {"cuda-aware": CudaAwareTransport, "staged": StagedTransport, "nccl": NcclTransport}[name]
    return cls(comm, cupy)
