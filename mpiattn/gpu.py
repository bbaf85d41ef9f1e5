"""GPU runs: one rank per device.

Importing this module imports neither CuPy nor ``mpi4py.MPI``; every function
that needs them imports them when called, and only when the GPU was asked for.

Device binding
--------------
:func:`bind_device` gives each rank one GPU: the rank's index among the ranks
of its node (``Split_type(COMM_TYPE_SHARED)``) modulo the node's device
count, unless ``MPIATTN_DEVICE`` says otherwise (one device id, or a
comma-separated list indexed by node-local rank). When no GPU is usable on
some rank (CuPy missing, no driver, no device) every rank raises the same
:class:`NoGPUError`.

How device buffers cross ranks (``MPIATTN_GPU_TRANSPORT``: auto, cuda-aware,
staged, nccl) is decided collectively in :mod:`mpiattn.comm.device`; its
public functions are re-exported here. :func:`bind_device` configures the
communicator it was given.

Host data reaches the device through :func:`upload` (pinned staging buffers
on a copy stream, :class:`Uploader`); :func:`compute_stream` keeps compute
off the legacy default stream and orders itself with the stream current
where its block starts and ends (:class:`ComputeStream`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
import socket
import warnings
from typing import Any

import numpy as np

from .comm.core import find_comm, get_comm
from .comm.device import (TRANSPORTS, configure, decide_transport, describe_transport,
                          gather_evidence, judge_evidence)
from .comm.pinned import PinnedPool

__all__ = [
    "NoGPUError",
    "TRANSPORTS",
    "bind_device",
    "probe",
    "gather_evidence",
    "judge_evidence",
    "decide_transport",
    "describe_transport",
    "configure",
    "compute_stream",
    "upload",
    "BoundDevice",
    "ComputeStream",
]



class NoGPUError(RuntimeError):
    """No usable GPU: CuPy is missing, has no CUDA driver, or sees no device."""


# ------------------------------------------------------------------ binding
def probe() -> tuple[int, str]:
    """This rank's usable GPU count and, when it is 0, why (never raises, no MPI).

    Returns
    -------
    (count, reason) : (int, str)
        ``count`` devices CuPy can use; ``reason`` is empty when ``count > 0``.
    """
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install
        return 0, f"CuPy is not importable ({type(exc).__name__}: {exc}); pip install 'mpiattn[cuda12]'"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return 0, f"CuPy {getattr(cupy, '__version__', '?')} is installed but CUDA is not usable: {text}"
    if count < 1:
        return 0, "CUDA reports no GPU on this node"
    return count, ""


def _requested_devices(local_rank: int, ndev: int) -> int:
    """Device id for ``local_rank``: ``MPIATTN_DEVICE`` if set, else ``local_rank % ndev``."""
    spec = os.environ.get("MPIATTN_DEVICE", "").strip()
    if not spec:
        return local_rank % ndev
    try:
        ids = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ValueError(f"MPIATTN_DEVICE={spec!r}: expected a device id or a comma-separated list") from None
    dev = ids[local_rank % len(ids)]
    if not 0 <= dev < ndev:
        raise ValueError(f"MPIATTN_DEVICE={spec!r} asks for device {dev}, but this node has {ndev} GPU(s)")
    return dev


def bind_device(comm: Any = None, configure_transport: bool = True, transport: str | None = None) -> int:
    """Make one GPU current for this rank (collective over ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or mpiattn.comm.Comm, optional
        The ranks to place (default ``MPI.COMM_WORLD``).
    configure_transport : bool
        Also choose how this communicator moves device buffers
        (:func:`configure`).
    transport : {"auto", "cuda-aware", "staged", "nccl"}, optional
        The transport asked for (default ``MPIATTN_GPU_TRANSPORT``), decided
        with :func:`decide_transport`'s checks and fall-backs.

    Returns
    -------
    int
        The CUDA device id now current on this rank.

    Raises
    ------
    NoGPUError
        On every rank, when some rank cannot use a GPU (CuPy missing, CuPy
        installed without a driver, no device).
    ValueError
        On every rank, for a malformed or out-of-range ``MPIATTN_DEVICE``.

    Warns
    -----
    RuntimeWarning
        Once, from the first rank of a node where ranks share a device.
    """
    from mpi4py import MPI

    c = get_comm(comm)
    node = c.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()

        def choose() -> tuple[int, int]:
            ndev, why = probe()
            if ndev == 0:
                raise NoGPUError(f"no usable GPU: {why}")
            dev = _requested_devices(local_rank, ndev)
            import cupy

            try:
                cupy.cuda.Device(dev).use()
                cupy.cuda.runtime.memGetInfo()  # creates the context: fails early in exclusive mode
            except Exception as exc:  # noqa: BLE001
                raise NoGPUError(f"GPU {dev} is not usable: {type(exc).__name__}: {exc}") from None
            return dev, ndev

        dev, ndev = c.allgather_checked(choose)[c.rank]
        on_node = node.allgather(dev)
    finally:
        node.Free()
    shared = len(set(on_node)) < len(on_node)
    c.gpu_device = BoundDevice(dev)
    if shared and local_rank == 0:  # (Python's warning filters show it once per place)
        warnings.warn(
            f"mpiattn: {local_size} ranks on {socket.gethostname()} share {len(set(on_node))} of its "
            f"{ndev} GPU(s) (devices by local rank: {on_node}); they will compete for memory and compute. "
            "Launch one rank per GPU, or set MPIATTN_DEVICE.", RuntimeWarning, stacklevel=2)
    if configure_transport:
        configure(c, requested=transport)
    return dev


@dataclass
class BoundDevice:
    """The GPU :func:`bind_device` made current for a communicator, and what it keeps for it.

    Attributes
    ----------
    id : int
        The CUDA device id.
    stream : ComputeStream or None
        Its compute stream (:func:`compute_stream`), made on first use.
    uploader : Uploader or None
        Its pinned host-to-device copier (:func:`upload`), made on first use.
    """

    id: int
    stream: Any = None
    uploader: Any = None


def _bound(comm: Any) -> BoundDevice:
    """The device :func:`bind_device` bound for ``comm`` (local: never communicates)."""
    c = find_comm(comm)
    dev = None if c is None else c.gpu_device
    if dev is None:
        raise RuntimeError("no GPU is bound for this communicator: call "
                           "mpiattn.gpu.bind_device(comm) on every rank first")
    return dev


def compute_stream(comm: Any = None) -> "ComputeStream":
    """The compute stream of the GPU bound for ``comm`` (made on first use; local).

    Use it as ``with gpu.compute_stream(): ...`` so that compute does not
    run on the legacy default stream (which would serialise with copies).
    Work queued before the block (``cupy.asarray`` of the inputs, say) is
    finished before the block's work starts, and work queued after it
    (``out.get()``) sees the block's results: see :class:`ComputeStream`.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or Comm, optional
        The communicator passed to :func:`bind_device` (default ``MPI.COMM_WORLD``).

    Returns
    -------
    ComputeStream
    """
    dev = _bound(comm)
    if dev.stream is None:
        import cupy

        dev.stream = ComputeStream(cupy, dev.id)
    return dev.stream


class ComputeStream:
    """A non-blocking stream that orders itself with the stream current around its block.

    A ``non_blocking`` CUDA stream has no implicit order with the legacy
    default stream, so on its own ``with stream:`` would let its kernels
    read inputs whose copies (queued on the default stream before the
    block) have not landed, and let ``.get()`` after the block copy results
    not yet computed. Entering the block makes this stream wait (on the GPU,
    through an event) for the work queued so far on the stream that was
    current; leaving it makes that stream wait for the block's work. No
    host synchronisation either way. Other attributes are the stream's
    (``ptr``, ``synchronize()``, ``record()``, ...).

    Parameters
    ----------
    cupy : module
    device : int
        The device the stream belongs to.
    """

    def __init__(self, cupy: Any, device: int):
        self._cp = cupy
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._outer: list = []

    def _event(self) -> Any:
        return self._cp.cuda.Event(disable_timing=True)

    def __enter__(self) -> Any:
        outer = self._cp.cuda.get_current_stream()
        self.stream.wait_event(outer.record(self._event()))
        self._outer.append(outer)
        self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        self.stream.__exit__(*exc)
        outer = self._outer.pop()
        outer.wait_event(self.stream.record(self._event()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def upload(host: Any, comm: Any = None) -> Any:
    """Copy a host array to the GPU bound for ``comm`` through a pinned staging buffer (local).

    The copy runs on a copy stream; the current stream is ordered after it
    (no host wait), so the caller may use the result at once.

    Parameters
    ----------
    host : numpy.ndarray
        Any shape and dtype (e.g. an HDF5 slab just read).
    comm : mpi4py.MPI.Intracomm or Comm, optional
        The communicator passed to :func:`bind_device` (default ``MPI.COMM_WORLD``).

    Returns
    -------
    cupy.ndarray
        Same shape and dtype, C-contiguous, on the current device.
    """
    dev = _bound(comm)
    if dev.uploader is None:
        import cupy

        dev.uploader = Uploader(cupy)
    return dev.uploader.upload(host)


class Uploader:
    """Host -> device copies through pinned buffers on a copy stream of their own (for HDF5 slabs)."""

    def __init__(self, cupy: Any):
        self._cp = cupy
        self.copy = cupy.cuda.Stream(non_blocking=True)
        self.pool = PinnedPool(cupy)

    def upload(self, host: Any) -> Any:
        cp = self._cp
        src = np.ascontiguousarray(host)
        out = cp.empty(src.shape, dtype=src.dtype)
        cur = cp.cuda.get_current_stream()
        staging = self.pool.take(src.nbytes)
        staging[...] = src.reshape(-1).view(np.uint8)
        self.copy.wait_event(cur.record(cp.cuda.Event(disable_timing=True)))
        if src.nbytes:
            cp.cuda.runtime.memcpyAsync(out.data.ptr, staging.ctypes.data, src.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, self.copy.ptr)
        landed = self.copy.record(cp.cuda.Event(disable_timing=True))
        cur.wait_event(landed)
        self.pool.give(staging, after=landed)
        return out
