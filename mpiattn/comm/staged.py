"""The ``staged`` transport: device buffers through pinned host memory, copies on their own stream.

Device -> pinned host copies on a dedicated copy stream, ordered by events.
``isend`` returns at once: the device-to-host copy waits on the GPU for the
producing stream. A progress thread (when MPI runs with
``MPI_THREAD_MULTIPLE``) posts each MPI send as soon as its copy has
finished, drives MPI's progress while the caller computes, and lands each
received message: a host-to-device copy on the copy stream as soon as MPI
has it; the consuming stream waits for that copy on the GPU. Without
``MPI_THREAD_MULTIPLE`` the same work happens at the transport's calls.
Collectives copy through pinned buffers on the copy stream too.
Pinned buffers are recycled (per size) once MPI and the copy engine are
done with them (:class:`mpiattn.comm.pinned.PinnedPool`).

The methods it offers and the stream contract it keeps are those of every
transport (:mod:`mpiattn.comm.transports`).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np

from .pinned import PinnedPool
from .transports import _byte_type, _check_contiguous, _Request

__all__ = ["StagedTransport"]


def _copy_async(cp: Any, dst_ptr: int, src_ptr: int, nbytes: int, kind: int, stream: Any) -> None:
    if nbytes:
        cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, stream.ptr)


class _StagedSend(_Request):
    __slots__ = ("t", "host", "arr", "copied", "dest", "tag", "mpi_req", "done")

    def __init__(self, t: "StagedTransport", host: np.ndarray, arr: Any, copied: Any, dest: int, tag: int):
        self.t, self.host, self.arr, self.copied = t, host, arr, copied
        self.dest, self.tag, self.mpi_req = dest, tag, None
        self.done = threading.Event()

    def post(self) -> None:
        self.arr = None  # the copy engine is done with the device memory (the caller may free it)
        self.mpi_req = self.t.mpi.Isend([self.host, self.host.nbytes, _byte_type()], dest=self.dest, tag=self.tag)

    def complete(self) -> None:
        self.t.pool.give(self.host)
        self.host = None
        self.done.set()

    def Test(self) -> bool:  # noqa: N802
        if self.done.is_set():
            return True
        self.t.progress()
        return self.done.is_set()

    def Wait(self) -> None:  # noqa: N802
        self.t.until(self)


class _StagedRecv(_Request):
    __slots__ = ("t", "host", "arr", "free_after", "mpi_req", "landed", "done")

    def __init__(self, t: "StagedTransport", host: np.ndarray, arr: Any, free_after: Any, mpi_req: Any):
        self.t, self.host, self.arr, self.free_after, self.mpi_req = t, host, arr, free_after, mpi_req
        self.landed = None
        self.done = threading.Event()

    def complete(self) -> None:
        """MPI has the data: copy it to the device on the copy stream (no host wait)."""
        t, cp = self.t, self.t._cp
        with t.copy_lock:
            t.copy.wait_event(self.free_after)
            _copy_async(cp, self.arr.data.ptr, self.host.ctypes.data, self.host.nbytes,
                        cp.cuda.runtime.memcpyHostToDevice, t.copy)
            self.landed = t.copy.record(cp.cuda.Event(disable_timing=True))
        t.pool.give(self.host, after=self.landed)
        self.host = self.arr = self.free_after = None
        self.done.set()

    def _use(self) -> None:
        self.t._cp.cuda.get_current_stream().wait_event(self.landed)

    def Test(self) -> bool:  # noqa: N802
        if not self.done.is_set():
            self.t.progress()
            if not self.done.is_set():
                return False
        self._use()
        return True

    def Wait(self) -> None:  # noqa: N802
        self.t.until(self)
        self._use()


class StagedTransport:
    """Device buffers through pinned host memory, copies on a dedicated stream.

    Parameters
    ----------
    comm : mpiattn.comm.Comm
    cupy : module
    threaded : bool, optional
        Run the progress thread (default: when MPI provides ``MPI_THREAD_MULTIPLE``).
    """

    name = "staged"

    def __init__(self, comm: Any, cupy: Any, threaded: bool | None = None):
        from mpi4py import MPI

        self.mpi, self._cp, self.reason = comm.mpi, cupy, ""
        self.copy = cupy.cuda.Stream(non_blocking=True)
        self.copy_lock = threading.Lock()
        self.pool = PinnedPool(cupy)
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()  # sends whose copy may not be done
        self._active: list = []                                 # posted MPI requests
        self._lent: list = []                                   # pinned buffers of the last collective
        if threaded is None:
            threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._device = cupy.cuda.Device().id
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="mpiattn-staged-progress", daemon=True)
            self._thread.start()

    def _event(self) -> Any:
        return self._cp.cuda.Event(disable_timing=True)

    # ------------------------------------------------------------ progress
    def progress(self) -> bool:
        """Post the sends whose copy finished, test the posted requests; True if anything moved.

        Called by the progress thread, or (without one) at every transport call.
        """
        moved = False
        with self._lock:
            while self._waiting and self._waiting[0].copied.done:
                req = self._waiting.popleft()
                req.post()
                self._active.append(req)
                moved = True
            still = []
            for req in self._active:
                if req.mpi_req.Test():
                    req.complete()
                    moved = True
                else:
                    still.append(req)
            self._active = still
        return moved

    def _run(self) -> None:
        with self._cp.cuda.Device(self._device):
            pause = 2e-6
            while not self._stop.is_set():
                if self.progress():
                    pause = 2e-6
                    continue
                with self._lock:
                    idle = not self._waiting and not self._active
                if idle:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                time.sleep(pause)  # lets the caller's thread run; MPI is polled, not waited on
                pause = min(2 * pause, 2e-4)

    def until(self, req: Any) -> None:
        """Return once ``req`` completed (the progress thread completes it, or this loop)."""
        if self._thread is not None:
            self._wake.set()
            if not req.done.wait(3600.0):
                raise RuntimeError("staged transport: a message never completed")
            return
        pause = 1e-6
        while not req.done.is_set():
            if not self.progress():
                time.sleep(pause)
                pause = min(2 * pause, 1e-4)

    # ------------------------------------------------------------ messages
    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        _check_contiguous(arr)
        cp = self._cp
        host = self.pool.take(arr.nbytes)
        ready = cp.cuda.get_current_stream().record(self._event())
        with self.copy_lock:
            self.copy.wait_event(ready)
            _copy_async(cp, host.ctypes.data, arr.data.ptr, arr.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                        self.copy)
            copied = self.copy.record(self._event())
        req = _StagedSend(self, host, arr, copied, dest, tag)
        with self._lock:
            self._waiting.append(req)  # even empty messages keep their place in the order
        self._wake.set()
        if self._thread is None:
            self.progress()
        return req

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        _check_contiguous(arr)
        host = self.pool.take(arr.nbytes)
        free_after = self._cp.cuda.get_current_stream().record(self._event())
        with self._lock:
            mpi_req = self.mpi.Irecv([host, host.nbytes, _byte_type()], source=source, tag=tag)
            req = _StagedRecv(self, host, arr, free_after, mpi_req)
            self._active.append(req)
        self._wake.set()
        if self._thread is None:
            self.progress()
        return req

    # ------------------------------------------------------------ collectives
    def _return_lent(self) -> None:
        lent, self._lent = self._lent, []
        for buf in lent:
            self.pool.give(buf)

    def _to_host(self, arr: Any) -> np.ndarray:
        """``arr`` in a pinned buffer (a stream-ordered copy; the host waits for it)."""
        cp = self._cp
        arr = cp.ascontiguousarray(arr)
        host = self.pool.take(arr.nbytes)
        with self.copy_lock:
            self.copy.wait_event(cp.cuda.get_current_stream().record(self._event()))
            _copy_async(cp, host.ctypes.data, arr.data.ptr, arr.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                        self.copy)
            done = self.copy.record(self._event())
        done.synchronize()  # the collective reads it now
        self._lent.append(host)
        return host.view(arr.dtype).reshape(arr.shape)

    def send_buf(self, arr: Any) -> Any:
        """A pinned host copy of ``arr`` for a blocking collective."""
        self._return_lent()
        return self._to_host(arr)

    def recv_buf(self, arr: Any, keep: bool = False) -> tuple[Any, Callable[[], None] | None]:
        """A pinned buffer for a collective's result (holding ``arr``'s data when ``keep``) and
        the ``finish()`` that copies it into ``arr`` on the copy stream (the current stream waits)."""
        cp = self._cp
        if keep:
            host = self._to_host(arr)
            raw = self._lent.pop()
        else:
            raw = self.pool.take(arr.nbytes)
            host = raw.view(arr.dtype).reshape(arr.shape)
        free_after = cp.cuda.get_current_stream().record(self._event())

        def finish() -> None:
            with self.copy_lock:
                self.copy.wait_event(free_after)
                _copy_async(cp, arr.data.ptr, raw.ctypes.data, raw.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                            self.copy)
                landed = self.copy.record(self._event())
            cp.cuda.get_current_stream().wait_event(landed)
            self.pool.give(raw, after=landed)

        return host, finish

    def close(self) -> None:
        with self._lock:
            pending = list(self._waiting) + [r for r in self._active if isinstance(r, _StagedSend)]
        for req in pending:
            req.Wait()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self._return_lent()

