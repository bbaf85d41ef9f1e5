"""The ``cuda-aware`` transport: device pointers straight to MPI, one host wait per batch.

``isend``/``irecv`` record an event on the current stream and queue the MPI
operation; the first ``Test``/``Wait`` of any of its requests (or ``close``)
waits for the newest queued event once and posts every queued operation in
order. So a ring step (receives of the next piece, sends of this one) costs
one host synchronisation, not one per message.

The methods it offers and the stream contract it keeps are those of every
transport (:mod:`mpiattn.comm.transports`).
"""

from __future__ import annotations

from typing import Any, Callable

from .transports import _byte_type, _check_contiguous, _MpiRequest, _Request

__all__ = ["CudaAwareTransport"]


class _Queued(_MpiRequest):
    """A CUDA-aware MPI operation queued until its transport's next flush (which sets ``mpi_req``)."""

    __slots__ = ("t", "post")

    def __init__(self, t: "CudaAwareTransport", post: Callable[[], Any], keep: Any):
        super().__init__(None, keep)
        self.t, self.post = t, post

    def Test(self) -> bool:  # noqa: N802
        if self.keep is not None:
            self.t.flush()
        return super().Test()

    def Wait(self) -> None:  # noqa: N802
        if self.keep is not None:
            self.t.flush()
        super().Wait()


class CudaAwareTransport:
    """Device pointers straight to MPI, one host synchronisation per batch of messages."""

    name = "cuda-aware"

    def __init__(self, comm: Any, cupy: Any):
        self.mpi, self._cp, self.reason = comm.mpi, cupy, ""
        self._queued: list[_Queued] = []
        self._events: dict[int, Any] = {}  # stream ptr -> newest event of the queued batch

    def _queue(self, arr: Any, make: Callable[[], Any]) -> _Queued:
        # the producing kernels must be done before MPI reads, and earlier users of a
        # receive buffer before MPI writes: an event now, one wait at the flush
        cur = self._cp.cuda.get_current_stream()
        self._events[cur.ptr] = cur.record(self._cp.cuda.Event(disable_timing=True))
        req = _Queued(self, make, arr)
        self._queued.append(req)
        return req

    def flush(self) -> None:
        """Wait for the queued batch's events (once per stream) and post its MPI operations."""
        if not self._queued:
            return
        for ev in self._events.values():
            if not ev.done:
                ev.synchronize()
        self._events.clear()
        queued, self._queued = self._queued, []
        for req in queued:
            req.mpi_req = req.post()

    def isend(self, arr: Any, dest: int, tag: int) -> _Request:
        _check_contiguous(arr)
        return self._queue(arr, lambda: self.mpi.Isend([arr, arr.nbytes, _byte_type()], dest=dest, tag=tag))

    def irecv(self, arr: Any, source: int, tag: int) -> _Request:
        _check_contiguous(arr)
        return self._queue(arr, lambda: self.mpi.Irecv([arr, arr.nbytes, _byte_type()], source=source, tag=tag))

    def _settle(self) -> None:
        self.flush()
        self._cp.cuda.get_current_stream().synchronize()

    def send_buf(self, arr: Any) -> Any:
        self._settle()
        return arr

    def recv_buf(self, arr: Any, keep: bool = False) -> tuple[Any, Callable[[], None] | None]:
        self._settle()
        return arr, None

    def close(self) -> None:
        self.flush()
