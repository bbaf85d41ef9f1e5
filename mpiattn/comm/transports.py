"""How CuPy buffers cross ranks: what every device transport offers, and its requests.

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
``cuda-aware``: :mod:`mpiattn.comm.cuda_aware` (device pointers straight to
MPI, one host synchronisation per batch of messages).

``staged``: :mod:`mpiattn.comm.staged` (pinned host copies on a dedicated
copy stream, buffers from :mod:`mpiattn.comm.pinned`, a progress thread).

``nccl``: :mod:`mpiattn.comm.nccl`.

This module holds what they share: the completion handles their requests
are (``_Request``, ``_Done``, ``_MpiRequest``), MPI's byte datatype, and the
check that a buffer is C-contiguous.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


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


def _check_contiguous(arr: Any) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError("device buffers must be C-contiguous to be communicated")
