"""How CuPy buffers cross ranks: the transport decision, made collectively.

``MPIATTN_GPU_TRANSPORT`` (or :func:`configure`'s ``transport``) selects:

``auto`` (default)
    ``cuda-aware`` when every rank's MPI library says it handles CUDA device
    memory, else ``staged`` with a one-line notice. The evidence
    (:func:`gather_evidence`): the MPI 4.1 info key ``mpi_memory_alloc_kinds``
    (on the communicator, then ``MPI_INFO_ENV``) listing ``cuda`` device
    memory; ``MPIX_Query_cuda_support()`` (Open MPI, MPICH) looked up in the
    loaded MPI library; for Cray MPICH, ``MPICH_GPU_SUPPORT_ENABLED=1``; for
    MVAPICH, ``MV2_USE_CUDA=1``. An explicit "no" from any source wins over a
    "yes". The ranks agree: one doubtful rank makes every rank use
    ``staged``. Nothing is ever tested by sending a device pointer.
``cuda-aware``
    CuPy arrays are handed to mpi4py once the stream that produced them is
    synchronised.
``staged``
    Copies through reusable pinned host buffers on a dedicated copy stream,
    ordered with events (:mod:`mpiattn.comm.staged`).
``nccl``
    Ring shifts through NCCL communicators bootstrapped over MPI; needs one
    GPU per rank (NCCL refuses two ranks on one device), else ``staged``
    with a notice. Collectives stay on MPI (staged).

The decision is collective, so it is taken only at points every rank
reaches: :func:`prepare` (called by every public entry point that may move
CuPy buffers, right after its collective validation) and :func:`configure`.
A Comm never decides it inside a send.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from typing import Any

from .core import Comm, get_comm
from .. import backend
from . import cuda_aware, errors, nccl, staged

__all__ = ["TRANSPORTS", "gather_evidence", "judge_evidence", "decide_transport",
           "describe_transport", "configure", "prepare"]

#: Accepted values of ``MPIATTN_GPU_TRANSPORT``.
TRANSPORTS = ("auto", "cuda-aware", "staged", "nccl")

_log = logging.getLogger("mpiattn.gpu")


def _notice(c: Any, msg: str) -> None:
    """A one-line notice from rank 0 (logging, not print); a Comm decides its transport once."""
    if c.rank == 0:
        _log.warning("mpiattn: %s", msg)


# ----------------------------------------------------------------- evidence
def _libmpi_function(name: str) -> Any:
    """The C function ``name`` from the MPI library mpi4py loaded, or None."""
    import ctypes

    from mpi4py import MPI

    for handle in (MPI.__file__, None):
        try:
            return getattr(ctypes.CDLL(handle), name)
        except (OSError, AttributeError):
            continue
    return None


def _memory_kinds(mpi_comm: Any) -> str | None:
    """The ``mpi_memory_alloc_kinds`` info value (communicator first, then MPI_INFO_ENV)."""
    from mpi4py import MPI

    try:
        info = mpi_comm.Get_info()
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
        if value:
            return str(value)
    except Exception:  # noqa: BLE001 - pre-4.1 libraries or no info support
        pass
    try:
        value = MPI.INFO_ENV.Get("mpi_memory_alloc_kinds")
        return str(value) if value else None
    except Exception:  # noqa: BLE001
        return None


def gather_evidence(comm: Any = None) -> dict:
    """What this rank's MPI library says about CUDA device memory (local, no communication).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or mpiattn.comm.Comm, optional
        Whose info to read (default ``MPI.COMM_WORLD``).

    Returns
    -------
    dict
        ``library`` (first line of ``MPI_Get_library_version``), ``memory_alloc_kinds``
        (str or None), ``mpix_query_cuda_support`` (1, 0, or None when the
        function does not exist), ``env`` (the vendor switches that are set).
    """
    from mpi4py import MPI

    base = comm.mpi if isinstance(comm, Comm) else (MPI.COMM_WORLD if comm is None else comm)
    lib = MPI.Get_library_version().strip().splitlines()
    query = None
    fn = _libmpi_function("MPIX_Query_cuda_support")
    if fn is not None:
        import ctypes

        fn.restype, fn.argtypes = ctypes.c_int, []
        query = 1 if fn() else 0
    env = {k: os.environ[k] for k in ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA") if k in os.environ}
    return {"library": lib[0].strip() if lib else "", "memory_alloc_kinds": _memory_kinds(base),
            "mpix_query_cuda_support": query, "env": env}


def _kinds_allow_cuda_device(kinds: str) -> bool:
    """True when an ``mpi_memory_alloc_kinds`` value lists CUDA device memory."""
    for item in kinds.split(","):
        parts = [p.strip().lower() for p in item.split(":")]
        if parts[0] == "cuda" and (len(parts) == 1 or "device" in parts[1:]):
            return True
    return False


def judge_evidence(ev: dict) -> tuple[int, str]:
    """Turn one rank's evidence into a verdict (pure function).

    Returns
    -------
    (verdict, reason) : (int, str)
        ``verdict`` is 1 (the library handles CUDA device memory), 0 (no
        evidence either way) or -1 (it says it does not); ``reason`` is one
        line naming the evidence.
    """
    lib = ev.get("library", "") or ""
    env = ev.get("env", {}) or {}
    yes: list[str] = []
    no: list[str] = []
    if "cray mpich" in lib.lower():
        if env.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
            yes.append("Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1")
        else:
            no.append("Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1")
    if "mvapich" in lib.lower():
        if env.get("MV2_USE_CUDA") == "1":
            yes.append("MVAPICH with MV2_USE_CUDA=1")
        else:
            no.append("MVAPICH without MV2_USE_CUDA=1")
    kinds = ev.get("memory_alloc_kinds")
    if kinds and _kinds_allow_cuda_device(kinds):
        yes.append(f"mpi_memory_alloc_kinds={kinds!r} lists CUDA device memory")
    query = ev.get("mpix_query_cuda_support")
    if query == 1:
        yes.append("MPIX_Query_cuda_support() returned 1")
    elif query == 0:
        no.append("MPIX_Query_cuda_support() returned 0")
    if no:
        return -1, "; ".join(no)
    if yes:
        return 1, "; ".join(yes)
    detail = f"mpi_memory_alloc_kinds={kinds!r}" if kinds else "no mpi_memory_alloc_kinds"
    return 0, f"no evidence of CUDA-aware MPI ({detail}, no MPIX_Query_cuda_support)"


# ----------------------------------------------------------------- decision
def _requested(requested: str | None = None) -> str:
    """``requested`` if given, else ``MPIATTN_GPU_TRANSPORT`` (default "auto"), checked."""
    if requested is not None:
        if requested not in TRANSPORTS:
            raise ValueError(f"transport {requested!r}; expected one of {', '.join(TRANSPORTS)}")
        return requested
    want = os.environ.get("MPIATTN_GPU_TRANSPORT", "auto").strip().lower() or "auto"
    if want not in TRANSPORTS:
        raise ValueError(f"MPIATTN_GPU_TRANSPORT={want!r}; expected one of {', '.join(TRANSPORTS)}")
    return want


def _nccl_local() -> tuple[str, str]:
    """(problem or "", "host/pci-bus-id") for this rank's current device."""
    try:
        import cupy
        from cupy.cuda import nccl

        where = f"{socket.gethostname()}/{cupy.cuda.Device().pci_bus_id}"
    except Exception as exc:  # noqa: BLE001
        return f"no usable GPU ({type(exc).__name__}: {exc})", ""
    if not getattr(nccl, "available", False):
        return "CuPy cannot load NCCL (pip install nvidia-nccl-cu12 or -cu13)", where
    return "", where


def _nccl_feasible(c: Any) -> tuple[bool, str]:
    """Whether every rank can join NCCL communicators with its own GPU (collective)."""
    rows = c.allgather_obj(_nccl_local())
    for r, (problem, _) in enumerate(rows):
        if problem:
            return False, f"rank {r}: {problem}"
    seen: dict[str, int] = {}
    for r, (_, where) in enumerate(rows):
        if where in seen:
            return False, f"ranks {seen[where]} and {r} share GPU {where} (NCCL needs one GPU per rank)"
        seen[where] = r
    return True, ""


def decide_transport(comm: Any = None, notify: bool = True, requested: str | None = None) -> tuple[str, str]:
    """Choose how device buffers cross ranks (collective; every rank gets the same answer).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or mpiattn.comm.Comm, optional
        Default ``MPI.COMM_WORLD``.
    notify : bool
        Log the one-line notice (rank 0, once) when falling back to staged.
    requested : {"auto", "cuda-aware", "staged", "nccl"}, optional
        What the caller asks for (e.g. ``--gpu-transport``); default
        ``MPIATTN_GPU_TRANSPORT``.

    Returns
    -------
    (name, reason) : (str, str)
        ``name`` is "cuda-aware", "staged" or "nccl"; ``reason`` one line.

    Raises
    ------
    ValueError
        On every rank, when ``MPIATTN_GPU_TRANSPORT`` is invalid or differs
        between ranks.
    """
    c = get_comm(comm)
    wants = c.allgather_checked(lambda: _requested(requested))
    errors.same_everywhere(wants, "the requested GPU transport")
    want = wants[0]
    if want == "staged":
        return "staged", "requested (staged)"
    if want == "nccl":
        ok, why = _nccl_feasible(c)
        if ok:
            return "nccl", "requested (nccl)"
        reason = f"nccl was requested but {why}"
        if notify:
            _notice(c, f"device buffers are staged through host memory: {reason}")
        return "staged", reason
    votes = c.allgather_obj(judge_evidence(gather_evidence(c)))
    if want == "cuda-aware":
        doubt = [(r, why) for r, (v, why) in enumerate(votes) if v < 0]
        if doubt and c.rank == 0:
            warnings.warn(f"mpiattn: MPIATTN_GPU_TRANSPORT=cuda-aware although rank {doubt[0][0]} reports "
                          f"{doubt[0][1]}; MPI may crash on device pointers", RuntimeWarning, stacklevel=2)
        return "cuda-aware", "requested (cuda-aware)"
    if all(v > 0 for v, _ in votes):
        return "cuda-aware", votes[0][1]
    r, (_, why) = next((r, vw) for r, vw in enumerate(votes) if vw[0] <= 0)
    reason = why if c.size == 1 else f"rank {r}: {why}"
    if notify:
        _notice(c, f"device buffers are staged through host memory ({reason}); "
                   "set MPIATTN_GPU_TRANSPORT=cuda-aware|nccl to override")
    return "staged", reason


def describe_transport(comm: Any = None) -> dict:
    """What :func:`decide_transport` chooses and why, for ``mpiattn info`` (collective).

    Imports CuPy only when ``MPIATTN_GPU_TRANSPORT=nccl`` (the NCCL check
    needs the GPU) or when the communicator already moves device buffers.

    Returns
    -------
    dict
        ``requested``, ``transport``, ``reason``, ``evidence`` (rank 0's
        :func:`gather_evidence`), ``summary`` (one line).
    """
    c = get_comm(comm)
    configured = getattr(c, "device_transport", None)
    if configured is not None:
        name, reason = configured.name, getattr(configured, "reason", "configured")
    else:
        name, reason = decide_transport(c, notify=False)
    evidence = c.bcast_obj(gather_evidence(c) if c.rank == 0 else None)
    requested = os.environ.get("MPIATTN_GPU_TRANSPORT", "auto").strip().lower() or "auto"
    return {"requested": requested, "transport": name, "reason": reason, "evidence": evidence,
            "summary": f"{name} ({reason})"}


def configure(comm: Any = None, transport: str | None = None, requested: str | None = None) -> str:
    """Give a Comm its device-buffer transport (collective; idempotent).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or mpiattn.comm.Comm, optional
        Default ``MPI.COMM_WORLD``.
    transport : {"cuda-aware", "staged", "nccl"}, optional
        Skip :func:`decide_transport` and use this one (every rank must pass
        the same value).
    requested : {"auto", "cuda-aware", "staged", "nccl"}, optional
        Passed to :func:`decide_transport` (checked, with its fall-backs).

    Returns
    -------
    str
        The transport now in use.
    """
    c = get_comm(comm)
    if transport is None and getattr(c, "device_transport", None) is not None:
        return c.device_transport.name
    if transport is None:
        name, reason = decide_transport(c, requested=requested)
    else:
        if transport not in TRANSPORTS[1:]:
            raise ValueError(f"transport={transport!r}; expected one of {', '.join(TRANSPORTS[1:])}")
        name, reason = transport, "set by configure()"
    import cupy

    cls = {"cuda-aware": cuda_aware.CudaAwareTransport, "staged": staged.StagedTransport,
           "nccl": nccl.NcclTransport}[name]
    obj = cls(c, cupy)
    obj.reason = reason
    old = getattr(c, "device_transport", None)
    c.device_transport, c.transport = obj, name
    if old is not None:
        old.close()
    return name


def prepare(comm: Any, *arrays: Any) -> None:
    """Choose the device transport when the arrays are CuPy arrays and none is set (collective).

    Every rank must call it at the same point with arrays of the same kind
    (public calls do, right after their collective validation, so the
    backend is already agreed on); with NumPy arrays it does nothing.
    """
    c = get_comm(comm)
    if c.device_transport is None and any(backend.is_cupy_array(x) for x in arrays if x is not None):
        configure(c)
