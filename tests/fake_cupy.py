"""A stand-in for CuPy on machines without a GPU: just enough to run mpiattn's GPU path.

"Device" arrays are NumPy arrays of a subclass whose module is called
``cupy``, so :mod:`mpiattn.backend` takes them for CuPy arrays; every other
``cupy.<name>`` is NumPy's, with array results turned into that subclass.

Streams are what make it useful. "Kernels" (NumPy calls) run at once on the
host, so the current stream is always idle; every other stream is a worker
thread that runs its queued operations in order after a random pause:
asynchronous copies (``runtime.memcpyAsync``), event records, waits for
events, and NCCL sends and receives (blocking MPI calls on a communicator of
their own, like NCCL kernels that wait for their peer). A transport that
forgets to order a copy before its consumer, reuses a pinned buffer too
early, or queues NCCL operations so that they wait on each other, then
reads stale data or hangs, as it would on a GPU.

Use :func:`install` (with pytest's ``monkeypatch``) and :func:`shutdown`.
"""

from __future__ import annotations

import ctypes
import os
import queue
import random
import sys
import threading
import types
from typing import Any

import numpy as np

WAIT_LIMIT_S = 60.0  # an event not reached by then means a deadlock


class FakeArray(np.ndarray):
    """A "device" array: NumPy memory, CuPy's module name and a few CuPy methods."""

    @property
    def data(self) -> Any:  # CuPy: a MemoryPointer with .ptr
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self, stream: Any = None) -> np.ndarray:
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, host: Any, stream: Any = None) -> None:
        self.view(np.ndarray)[...] = host


FakeArray.__module__ = "cupy"


def _dev(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, FakeArray):
        return x.view(FakeArray)
    if isinstance(x, tuple):
        return tuple(_dev(y) for y in x)
    return x


# ------------------------------------------------------------------ streams
class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self._flag = threading.Event()
        self._flag.set()  # never recorded: complete, as in CUDA

    @property
    def done(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        if not self._flag.wait(WAIT_LIMIT_S):
            raise RuntimeError("fake cupy: an event never completed (deadlock)")

    def record(self, stream: Any = None) -> None:
        (stream or _state.current).record(self)


class ImmediateStream:
    """The current stream: its work (NumPy) is already done when queued."""

    ptr = 0

    def record(self, event: Event | None = None) -> Event:
        ev = event or Event()
        ev._flag.set()
        return ev

    def wait_event(self, event: Event) -> None:
        event.synchronize()  # later "kernels" run now, so they must wait now

    def synchronize(self) -> None:
        pass


class Stream:
    """A worker thread running queued operations in order."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority: Any = None):
        self.ptr = id(self)
        self._ops: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        _state.streams[self.ptr] = self

    def _run(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            if _state.jitter:
                threading.Event().wait(random.uniform(0, _state.jitter))
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                _state.errors.append(exc)

    def enqueue(self, op: Any) -> None:
        self._ops.put(op)

    def record(self, event: Event | None = None) -> Event:
        ev = event or Event()
        ev._flag.clear()
        self.enqueue(ev._flag.set)
        return ev

    def wait_event(self, event: Event) -> None:
        self.enqueue(event.synchronize)

    def synchronize(self) -> None:
        self.record().synchronize()

    def __enter__(self) -> "Stream":  # "kernels" still run at once: nothing to switch
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def stop(self) -> None:
        self._ops.put(None)
        self._thread.join(WAIT_LIMIT_S)


class _State:
    def __init__(self) -> None:
        self.current: Any = ImmediateStream()
        self.streams: dict[int, Any] = {0: self.current}
        self.errors: list[BaseException] = []
        self.jitter = 2e-4
        self.device_count: int | Exception = 1
        self.device = 0
        self.bus_id = "0000:00:00.0"
        self.nccl_comms: list[Any] = []


_state = _State()
_saved: list[_State] = []  # states replaced by install(), restored by shutdown()


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    _state.streams[stream].enqueue(lambda: ctypes.memmove(dst, src, size))


def _device_count() -> int:
    if isinstance(_state.device_count, Exception):
        raise _state.device_count
    return _state.device_count


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device: int | None = None):
        self.id = _state.device if device is None else device

    def use(self) -> None:
        if not 0 <= self.id < _device_count():
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        _state.device = self.id

    def __enter__(self) -> "Device":  # as CuPy's: current for the block, then the previous one
        self._previous = _state.device
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.device = self._previous

    @property
    def pci_bus_id(self) -> str:
        return _state.bus_id


# --------------------------------------------------------------------- nccl
class NcclCommunicator:
    """Blocking MPI calls on a stream thread stand in for NCCL kernels."""

    def __init__(self, ndev: int, comm_id: Any, rank: int):
        from mpi4py import MPI

        self.mpi = MPI.COMM_WORLD.Dup()  # collective, like ncclCommInitRank
        assert self.mpi.Get_size() == ndev and self.mpi.Get_rank() == rank
        _state.nccl_comms.append(self)

    def _buf(self, ptr: int, count: int) -> Any:
        return (ctypes.c_char * count).from_address(ptr)

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        op = ("send", self, ptr, count, peer)
        if _state_nccl.group is not None:
            _state_nccl.group.append((op, stream))
        else:
            _state.streams[stream].enqueue(lambda: self.mpi.Ssend([self._buf(ptr, count), count, _BYTE()], peer))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        op = ("recv", self, ptr, count, peer)
        if _state_nccl.group is not None:
            _state_nccl.group.append((op, stream))
        else:
            _state.streams[stream].enqueue(lambda: self.mpi.Recv([self._buf(ptr, count), count, _BYTE()], peer))

    def destroy(self) -> None:
        pass


def _BYTE() -> Any:  # noqa: N802
    from mpi4py import MPI

    return MPI.BYTE


class _NcclState:
    group: list | None = None


_state_nccl = _NcclState()


def _group_start() -> None:
    _state_nccl.group = []


def _group_end() -> None:
    from mpi4py import MPI

    ops, _state_nccl.group = _state_nccl.group, None
    if not ops:
        return

    def run() -> None:
        reqs = []
        for (kind, c, ptr, count, peer), _ in ops:
            buf = [c._buf(ptr, count), count, MPI.BYTE]
            reqs.append(c.mpi.Isend(buf, peer) if kind == "send" else c.mpi.Irecv(buf, peer))
        MPI.Request.Waitall(reqs)

    _state.streams[ops[0][1]].enqueue(run)


# ------------------------------------------------------------------- module
def _numpy_attr(name: str) -> Any:
    obj = getattr(np, name)
    if callable(obj) and not isinstance(obj, type):
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return _dev(obj(*args, **kwargs))
        return wrapped
    return obj


def _asarray(x: Any, dtype: Any = None, order: Any = None) -> FakeArray:
    if isinstance(x, FakeArray) and (dtype is None or np.dtype(dtype) == x.dtype):
        return x
    return np.array(x, dtype=dtype, copy=True).view(FakeArray)  # host -> device copies


def build() -> dict[str, types.ModuleType]:
    """Fresh ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime`` and ``cupy.cuda.nccl`` modules."""
    cp = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    nccl = types.ModuleType("cupy.cuda.nccl")
    cp.__version__ = "0.0-fake"
    cp.ndarray = FakeArray
    cp.cuda = cuda
    cp.asarray = _asarray
    cp.array = _asarray
    cp.__getattr__ = _numpy_attr
    cuda.Stream, cuda.Event, cuda.Device = Stream, Event, Device
    cuda.get_current_stream = lambda: _state.current
    cuda.alloc_pinned_memory = lambda n: bytearray(n)
    cuda.runtime, cuda.nccl = runtime, nccl
    runtime.memcpyAsync = _memcpy_async
    runtime.memcpyHostToDevice, runtime.memcpyDeviceToHost = 1, 2
    runtime.getDeviceCount = _device_count
    runtime.memGetInfo = lambda: (1 << 30, 1 << 30)
    runtime.CUDARuntimeError = CUDARuntimeError
    nccl.available = True
    nccl.NCCL_UINT8 = 7
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = lambda: os.urandom(16)
    nccl.groupStart, nccl.groupEnd = _group_start, _group_end
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.nccl": nccl}


def install(monkeypatch: Any, device_count: int | Exception = 1, bus_id: str | None = None,
            jitter: float = 2e-4) -> types.ModuleType:
    """Put a fresh fake CuPy into ``sys.modules`` for one test; returns the ``cupy`` module."""
    global _state
    _saved.append(_state)
    _state = _State()
    _state.device_count, _state.jitter = device_count, jitter
    if bus_id is not None:
        _state.bus_id = bus_id
    mods = build()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["cupy"]


def shutdown() -> None:
    """Stop the stream threads, free the fake NCCL communicators, restore the state that
    :func:`install` replaced; raise a stream's error."""
    global _state
    done = _state
    for s in list(done.streams.values()):
        if isinstance(s, Stream):
            s.stop()
    for c in done.nccl_comms:
        c.mpi.Free()
    done.nccl_comms.clear()
    if _saved:
        _state = _saved.pop()
    if done.errors:
        raise done.errors[0]
