"""A strict stand-in for CuPy on machines without a GPU: it fails where real CuPy would.

"Device" arrays (:class:`ndarray`) wrap NumPy memory but are not NumPy
arrays: ``np.asarray(device_array)`` raises TypeError, and a host array mixed
into a device operation raises TypeError, as in CuPy. Every other
``cupy.<name>`` is NumPy's function run on the unwrapped data, its array
results wrapped again.

What it checks and counts
-------------------------
* **Host synchronisations** (:func:`counters`): ``bool``/``int``/``float``/
  ``item``/``tolist``/``get``/``asnumpy``, boolean-mask indexing, uploads
  from pageable host memory (CUDA synchronises the stream before those),
  stream/event/device ``synchronize``.
* **Launches**: every operation that runs on the device (NumPy calls that
  compute, copies, fills, GEMMs, ``RawKernel`` calls) counts one; views and
  allocations count none. ``RawKernel``\\ s run through NumPy twins
  registered by kernel name (:data:`KERNELS`), which read their arguments
  as raw pointers, so a wrong layout or pointer offset gives wrong numbers.
* **GEMMs** (``cupy_backends.cuda.libs.cublas.gemmStridedBatchedEx`` and
  ``cupy.matmul``): each call is recorded (operand types, leading
  dimensions, alignment), computed from the raw pointers in column-major
  order as cuBLAS would, and checked like cuBLAS checks its arguments.
  ``cupy.matmul`` on float16 is recorded as CuPy's path (no float32 output).
* **Streams**: every stream, the legacy null stream included, is a worker
  thread running its copies, event records, event waits and NCCL operations
  in order after random pauses; "kernels" run on the host when their stream
  has reached them. ``with stream:`` makes a stream current (and restores
  the previous one). Ordering is also checked logically, with vector
  clocks: an operation on stream S that touches memory last written (or
  read) on stream T is a race (:class:`RaceError`, raised at once) unless S
  is ordered after it: by an event S waited on, by the host having waited
  for it, or by the legacy null stream's implicit order with *blocking*
  streams (``non_blocking=True`` streams have none).
* **Pinned memory** is registered, so a host array can be told pageable.
* **NCCL**: communicators are checked to share one unique id; a receive
  must match the size of the message it gets (real NCCL would hang).
* ``ndarray.set`` needs a C-contiguous target of the same shape and dtype.

Use :func:`install` (with pytest's ``monkeypatch``), :func:`counters` /
:func:`reset_counters`, and :func:`shutdown`.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import random
import sys
import threading
import types
import weakref
from typing import Any, Callable

import numpy as np

WAIT_LIMIT_S = 60.0  # an event not reached by then means a deadlock
HOST = -1            # the host's id in the vector clocks


class RaceError(AssertionError):
    """Two streams touched the same memory without an order between them."""


# ------------------------------------------------------------------ counters
class Counters:
    """What the fake saw since the last :func:`reset_counters`."""

    def __init__(self) -> None:
        self.syncs: dict[str, int] = {}
        self.launches = 0
        self.kinds: dict[str, int] = {}
        self.gemms: list[dict] = []
        self.kernels: list[str] = []

    def sync(self, kind: str) -> None:
        self.syncs[kind] = self.syncs.get(kind, 0) + 1

    def launch(self, kind: str) -> None:
        self.launches += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    @property
    def host_syncs(self) -> int:
        """Syncs that read device data on the host (not stream/event waits)."""
        return sum(v for k, v in self.syncs.items() if not k.startswith("wait:"))

    @property
    def waits(self) -> int:
        """Host waits for streams or events (``synchronize``)."""
        return sum(v for k, v in self.syncs.items() if k.startswith("wait:"))


# --------------------------------------------------------------- memory map
class _Mem:
    """One device allocation: its address range and who touched it last."""

    __slots__ = ("start", "end", "last_write", "reads", "__weakref__")

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.last_write: tuple[int, int] | None = None
        self.reads: dict[int, int] = {}


def _root(a: np.ndarray) -> Any:
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Memory:
    """Device allocations by the id of their root NumPy object, and by address."""

    def __init__(self) -> None:
        self.by_root: dict[int, _Mem] = {}
        self.starts: list[int] = []
        self.by_start: dict[int, _Mem] = {}
        self.lock = threading.Lock()

    def mem_of(self, a: np.ndarray) -> _Mem:
        root = _root(a)
        got = self.by_root.get(id(root))
        if got is not None:
            return got
        if isinstance(root, np.ndarray):
            start, size = _addr(root), root.nbytes
        else:
            start, size = _addr(a), a.nbytes
        mem = _Mem(start, start + max(size, 1))
        with self.lock:
            self.by_root[id(root)] = mem
            if start not in self.by_start:
                bisect.insort(self.starts, start)
            self.by_start[start] = mem
        weakref.finalize(root, self._forget, id(root), start, mem)
        return mem

    def _forget(self, key: int, start: int, mem: _Mem) -> None:
        with self.lock:
            if self.by_root.get(key) is mem:
                del self.by_root[key]
            if self.by_start.get(start) is mem:
                del self.by_start[start]
                i = bisect.bisect_left(self.starts, start)
                if i < len(self.starts) and self.starts[i] == start:
                    self.starts.pop(i)

    def find(self, ptr: int) -> _Mem | None:
        with self.lock:
            i = bisect.bisect_right(self.starts, ptr) - 1
            if i < 0:
                return None
            mem = self.by_start[self.starts[i]]
            return mem if mem.start <= ptr < mem.end else None


class _Pinned(bytearray):
    """Page-locked host memory (registered, so uploads from it do not synchronise)."""


# ------------------------------------------------------------------- streams
class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self._flag = threading.Event()
        self._flag.set()  # never recorded: complete, as in CUDA
        self.vc: dict[int, int] = {}

    @property
    def done(self) -> bool:
        if self._flag.is_set():
            _join(_state.host_vc, self.vc)  # the host has seen it complete
            return True
        return False

    def synchronize(self) -> None:
        _state.counters.sync("wait:event")
        self._wait()

    def _wait(self) -> None:
        if not self._flag.wait(WAIT_LIMIT_S):
            raise RuntimeError("fake cupy: an event never completed (deadlock)")
        _join(_state.host_vc, self.vc)

    def record(self, stream: Any = None) -> None:
        (stream or _state.current).record(self)


def _join(into: dict, other: dict) -> None:
    for k, v in list(other.items()):
        if into.get(k, 0) < v:
            into[k] = v


class Stream:
    """A worker thread running queued operations in order; kernels run when it reaches them."""

    _next_id = 1

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority: Any = None, _sid: int | None = None):
        if _sid is None:
            _sid = Stream._next_id
            Stream._next_id += 1
        self.sid = _sid
        self.ptr = 0 if _sid == 0 else id(self)
        self.non_blocking = bool(non_blocking)
        self.clock = 0
        self.vc: dict[int, int] = {}
        self._pending = 0
        self._cv = threading.Condition()
        self._ops: list = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._prev: list = []
        _state.streams[self.ptr] = self
        _state.by_sid[self.sid] = self
        if not self.non_blocking:
            _state.blocking.append(self)

    # ---- the worker
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ops:
                    self._cv.wait()
                op = self._ops.pop(0)
            if op is None:
                return
            if _state.jitter:
                threading.Event().wait(random.uniform(0, _state.jitter))
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                _state.errors.append(exc)
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._pending += 1
            self._ops.append(op)
            self._cv.notify_all()

    def _drain(self) -> None:
        """Wait (uncounted) until every queued operation ran: a kernel may run now."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending == 0, WAIT_LIMIT_S):
                raise RuntimeError("fake cupy: a stream never reached a kernel (deadlock)")

    # ---- ordering
    def snapshot(self) -> dict:
        vc = dict(self.vc)
        vc[self.sid] = self.clock
        return vc

    def _step(self) -> int:
        """One more operation on this stream: its number, after the implicit orders."""
        _join(self.vc, _state.host_vc)
        null = _state.null
        if self is null:
            for s in _state.blocking:
                if s is not null:
                    _join(self.vc, s.snapshot())
        elif not self.non_blocking:
            _join(self.vc, null.snapshot())
        self.clock += 1
        self.vc[self.sid] = self.clock
        return self.clock

    def touch(self, reads: list, writes: list, what: str) -> None:
        """Check and record an operation on this stream that reads/writes these allocations."""
        vc = dict(self.vc)
        _join(vc, _state.host_vc)
        for m in reads + writes:
            if m is None or m.last_write is None:
                continue
            sid, clk = m.last_write
            if sid != self.sid and vc.get(sid, 0) < clk and not self._implied(sid, clk):
                raise RaceError(f"fake cupy: {what} on stream {self.sid} touches memory written on "
                                f"stream {sid} (op {clk}) without waiting for it")
        for m in writes:
            if m is None:
                continue
            for sid, clk in m.reads.items():
                if sid != self.sid and vc.get(sid, 0) < clk and not self._implied(sid, clk):
                    raise RaceError(f"fake cupy: {what} on stream {self.sid} overwrites memory that "
                                    f"stream {sid} reads (op {clk}) without waiting for it")
        clk = self._step()
        for m in reads:
            if m is not None:
                m.reads[self.sid] = clk
        for m in writes:
            if m is not None:
                m.last_write, m.reads = (self.sid, clk), {}

    def _implied(self, sid: int, clk: int) -> bool:
        """The legacy null stream's implicit order with blocking streams."""
        null = _state.null
        other = _state.by_sid.get(sid)
        if other is None:
            return False
        if self is null and not other.non_blocking:
            return True
        if other is null and not self.non_blocking:
            return True
        return False

    # ---- the CuPy API
    def record(self, event: Event | None = None) -> Event:
        ev = event or Event()
        ev._flag.clear()
        ev.vc = self.snapshot()
        self.enqueue(ev._flag.set)
        return ev

    def wait_event(self, event: Event) -> None:
        _join(self.vc, event.vc)
        self.enqueue(event._wait_quiet)

    def synchronize(self) -> None:
        _state.counters.sync("wait:stream")
        self._drain()
        _join(_state.host_vc, self.snapshot())

    def launch_host_func(self, fn: Callable, arg: Any) -> None:
        self.enqueue(lambda: fn(arg))

    def use(self) -> "Stream":
        _state.current = self
        return self

    def __enter__(self) -> "Stream":
        self._prev.append(_state.current)
        _state.current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.current = self._prev.pop()

    def stop(self) -> None:
        with self._cv:
            self._ops.append(None)
            self._cv.notify_all()
        self._thread.join(WAIT_LIMIT_S)


def _event_wait_quiet(self: Event) -> None:
    if not self._flag.wait(WAIT_LIMIT_S):
        raise RuntimeError("fake cupy: an event never completed (deadlock)")


Event._wait_quiet = _event_wait_quiet


class _State:
    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}
        self.by_sid: dict[int, Stream] = {}
        self.blocking: list = []
        self.errors: list[BaseException] = []
        self.jitter = 2e-4
        self.device_count: int | Exception = 1
        self.device = 0
        self.bus_id = "0000:00:00.0"
        self.nccl_comms: list[Any] = []
        self.counters = Counters()
        self.memory = _Memory()
        self.pinned: list[tuple[int, int]] = []
        self.host_vc: dict[int, int] = {}
        self.allocator: Any = None
        self.null: Stream = None  # type: ignore[assignment]
        self.current: Stream = None  # type: ignore[assignment]

    def start(self) -> None:
        self.null = Stream(_sid=0)
        self.current = self.null


_state = _State()
_saved: list[_State] = []  # states replaced by install(), restored by shutdown()


def counters() -> Counters:
    """What the fake counted since the last :func:`reset_counters`."""
    return _state.counters


def reset_counters() -> Counters:
    """Start counting afresh; returns the new (empty) counters."""
    _state.counters = Counters()
    return _state.counters


def _is_pinned(a: np.ndarray) -> bool:
    p = _addr(a)
    return any(s <= p < e for s, e in _state.pinned)


def _alloc_pinned(n: int) -> _Pinned:
    buf = _Pinned(max(int(n), 1))
    start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    span = (start, start + len(buf))
    pinned = _state.pinned
    pinned.append(span)
    weakref.finalize(buf, pinned.remove, span)
    return buf


# -------------------------------------------------------------------- arrays
_SCALARS = (int, float, complex, bool, np.generic)


def _host_error(x: Any) -> TypeError:
    return TypeError(f"fake cupy: unsupported type {type(x).__module__}.{type(x).__name__} "
                     "in a device operation (move it with cupy.asarray first)")


class ndarray:  # noqa: N801 - CuPy's name
    """A "device" array: NumPy memory that NumPy will not take implicitly."""

    __slots__ = ("_a", "_mem", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape: Any = None, dtype: Any = float, *, _a: np.ndarray | None = None,
                 _mem: _Mem | None = None):
        if _a is None:
            _a = np.empty(shape, dtype=dtype)
            _mem = None
        object.__setattr__(self, "_a", _a)
        object.__setattr__(self, "_mem", _mem if _mem is not None else _state.memory.mem_of(_a))

    # -------- metadata (no device work)
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def data(self) -> Any:
        return types.SimpleNamespace(ptr=_addr(self._a), mem=self._mem)

    @property
    def device(self) -> Any:
        return Device(_state.device)

    @property
    def T(self) -> "ndarray":  # noqa: N802
        return _view(self._a.T, self)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        _state.counters.sync("repr")
        return "fake_cupy." + repr(self._a)

    # -------- implicit host conversion: refused or counted, as in CuPy
    def __array__(self, *a: Any, **kw: Any) -> Any:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def _read(self, kind: str) -> np.ndarray:
        _state.counters.sync(kind)
        cur = _state.current
        cur._drain()
        cur.touch([self._mem], [], kind)
        _join(_state.host_vc, cur.snapshot())
        return self._a

    def __bool__(self) -> bool:
        return bool(self._read("bool"))

    def __int__(self) -> int:
        return int(self._read("int"))

    def __float__(self) -> float:
        return float(self._read("float"))

    def __index__(self) -> int:
        return int(self._read("int").__index__())

    def item(self) -> Any:
        return self._read("item").item()

    def tolist(self) -> Any:
        return self._read("tolist").tolist()

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        s = stream or _state.current
        _state.counters.sync("get")
        s._drain()
        s.touch([self._mem], [], "get")
        _join(_state.host_vc, s.snapshot())
        return np.array(self._a, copy=True, order=order)

    def set(self, arr: Any, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr).__name__}")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        s = stream or _state.current
        _upload_sync(arr, s)
        s._drain()
        s.touch([], [self._mem], "set")
        _state.counters.launch("copy")
        self._a[...] = arr

    # -------- dlpack (mpi4py, torch): host memory, so CPU DLPack; the host must be ordered
    def __dlpack__(self, stream: Any = None, **kw: Any) -> Any:
        # torch imports on the consumer's stream (real CuPy orders it there); MPI reads at once
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("torch"):
            _host_access(self._mem)
        return self._a.__dlpack__(**{k: v for k, v in kw.items() if k == "max_version"})

    def __dlpack_device__(self) -> Any:
        return self._a.__dlpack_device__()

    # -------- views (no launch)
    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        got = self._a.reshape(*shape, order=order)
        return _result(got, [self])

    def view(self, dtype: Any = None) -> "ndarray":
        return _view(self._a.view() if dtype is None else self._a.view(dtype), self)

    def transpose(self, *axes: Any) -> "ndarray":
        return _view(self._a.transpose(*axes), self)

    def swapaxes(self, a: int, b: int) -> "ndarray":
        return _view(self._a.swapaxes(a, b), self)

    def ravel(self, order: str = "C") -> "ndarray":
        return _result(self._a.ravel(order), [self])

    def squeeze(self, axis: Any = None) -> "ndarray":
        return _view(self._a.squeeze(axis), self)

    def __iter__(self) -> Any:
        return (_view(self._a[i], self) for i in range(len(self._a)))

    # -------- device work
    def copy(self, order: str = "C") -> "ndarray":
        return _call("copy", np.copy, (self,), {"order": order})

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> "ndarray":
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _call("astype", lambda a: a.astype(dtype, order=order), (self,), {})

    def fill(self, value: Any) -> None:
        _call("fill", lambda a: a.fill(value), (self,), {}, writes=[self])

    def __getitem__(self, key: Any) -> "ndarray":
        key = _index(key)
        got = self._a[key[0]]
        if key[1]:
            _state.counters.sync("boolean mask")
            return _call("getitem", lambda a: a[key[0]], (self,), {})
        if isinstance(got, np.ndarray) and _root(got) is _root(self._a):
            return _view(got, self)
        return _call("getitem", lambda a: a[key[0]], (self,), {})

    def __setitem__(self, key: Any, value: Any) -> None:
        key = _index(key)
        if key[1]:
            _state.counters.sync("boolean mask")
        if isinstance(value, np.ndarray) and not isinstance(value, ndarray):
            _upload_sync(value, _state.current)
        elif isinstance(value, ndarray):
            pass
        elif not isinstance(value, _SCALARS):
            raise _host_error(value)

        def put(a: np.ndarray, v: Any = None) -> None:
            a[key[0]] = value._a if isinstance(value, ndarray) else value

        _call("setitem", put, (self,) + ((value,) if isinstance(value, ndarray) else ()), {},
              writes=[self])

    # reductions and methods that compute
    def _method(name: str) -> Callable:  # noqa: N805
        def fn(self: "ndarray", *args: Any, **kw: Any) -> Any:
            return _call(name, getattr(np.ndarray, name), (self,) + args, kw)
        fn.__name__ = name
        return fn

    for _n in ("sum", "max", "min", "any", "all", "mean", "prod", "cumsum", "argmax", "argmin", "dot"):
        locals()[_n] = _method(_n)
    del _n, _method

    # operators
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kw: Any) -> Any:
        fn = getattr(ufunc, method)
        return _call(ufunc.__name__, fn, inputs, kw)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        return _dispatch(func.__name__, func)(*args, **kwargs)


def _binop(name: str, reflect: bool = False, inplace: bool = False) -> Callable:
    uf = getattr(np, name)

    def fn(self: ndarray, other: Any) -> Any:
        if isinstance(other, np.ndarray) and not isinstance(other, ndarray):
            raise _host_error(other)
        if not isinstance(other, (ndarray,) + _SCALARS):
            return NotImplemented
        if inplace:
            _call(name, uf, (self, other), {"out": (self,)}, writes=[self])
            return self
        return _call(name, uf, (other, self) if reflect else (self, other), {})
    return fn


for _name, _uf in [("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                   ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "power"),
                   ("and", "bitwise_and"), ("or", "bitwise_or"), ("xor", "bitwise_xor"),
                   ("matmul", "matmul")]:
    setattr(ndarray, f"__{_name}__", _binop(_uf))
    setattr(ndarray, f"__r{_name}__", _binop(_uf, reflect=True))
    if _name != "matmul":
        setattr(ndarray, f"__i{_name}__", _binop(_uf, inplace=True))
for _name, _uf in [("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal"),
                   ("eq", "equal"), ("ne", "not_equal")]:
    setattr(ndarray, f"__{_name}__", _binop(_uf))
ndarray.__neg__ = lambda self: _call("negative", np.negative, (self,), {})  # type: ignore[attr-defined]
ndarray.__invert__ = lambda self: _call("invert", np.invert, (self,), {})  # type: ignore[attr-defined]
ndarray.__abs__ = lambda self: _call("absolute", np.absolute, (self,), {})  # type: ignore[attr-defined]
ndarray.__hash__ = None  # type: ignore[assignment]
ndarray.__module__ = "cupy"


def _view(a: np.ndarray, of: ndarray) -> ndarray:
    return ndarray(_a=a, _mem=of._mem)


def _index(key: Any) -> tuple[Any, bool]:
    """``key`` with device arrays unwrapped, and whether it holds a boolean mask."""
    keys = key if isinstance(key, tuple) else (key,)
    out, mask = [], False
    for k in keys:
        if isinstance(k, ndarray):
            mask = mask or k.dtype == np.bool_
            k = k._a
        elif isinstance(k, np.ndarray):
            if k.dtype == np.bool_:
                mask = True
            _upload_sync(k, _state.current)
        out.append(k)
    return (tuple(out) if isinstance(key, tuple) else out[0]), mask


def _upload_sync(host: np.ndarray, stream: Stream) -> None:
    """A copy from pageable host memory: CUDA synchronises the stream first."""
    if not _is_pinned(host):
        _state.counters.sync("pageable upload")
        stream._drain()
        _join(_state.host_vc, stream.snapshot())


def _host_access(mem: _Mem) -> None:
    """The host (MPI through DLPack) takes device memory: it must have waited for its last writer."""
    hv = _state.host_vc
    if mem.last_write is not None:
        sid, clk = mem.last_write
        if sid != HOST and hv.get(sid, 0) < clk:
            raise RaceError(f"fake cupy: the host hands memory written on stream {sid} (op {clk}) "
                            "to MPI before synchronising with it")


def _unwrap(x: Any, mems: list, host_ok: bool = False) -> Any:
    if isinstance(x, ndarray):
        mems.append(x._mem)
        return x._a
    if isinstance(x, np.ndarray):
        if host_ok:
            return x
        raise _host_error(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y, mems, host_ok) for y in x)
    return x


def _result(r: Any, inputs: list, out: Any = None) -> Any:
    if isinstance(r, tuple):
        return tuple(_result(x, inputs, out) for x in r)
    if isinstance(r, list):
        return [_result(x, inputs, out) for x in r]
    if isinstance(r, np.ndarray):
        for o in (out if isinstance(out, tuple) else (out,)):
            if isinstance(o, ndarray) and r is o._a:
                return o
        for x in inputs:
            if isinstance(x, ndarray) and _root(r) is _root(x._a):
                return ndarray(_a=r, _mem=x._mem)
        return ndarray(_a=r)
    if isinstance(r, np.generic):  # CuPy reductions give 0-d device arrays
        return ndarray(_a=np.asarray(r))
    return r


def _flat(x: Any) -> list:
    if isinstance(x, ndarray):
        return [x]
    if isinstance(x, (list, tuple)):
        return [y for z in x for y in _flat(z)]
    if isinstance(x, dict):
        return [y for z in x.values() for y in _flat(z)]
    return []


_NO_LAUNCH = {"empty", "empty_like", "reshape", "moveaxis", "swapaxes", "transpose", "broadcast_to",
              "expand_dims", "squeeze", "atleast_1d", "atleast_2d", "atleast_3d", "shape", "ndim",
              "result_type", "may_share_memory", "shares_memory", "ravel", "split", "array_split"}


def _call(name: str, fn: Callable, args: tuple, kw: dict, writes: list | None = None,
          host_ok: bool = False) -> Any:
    """Run ``fn`` on the current stream with device arrays unwrapped; wrap the result."""
    ins = _flat(args) + _flat(kw)
    mems: list = []
    a2 = _unwrap(args, mems, host_ok)
    k2 = {k: _unwrap(v, mems, host_ok) for k, v in kw.items()}
    out = kw.get("out")
    outs = _flat(out) + (writes or [])
    cur = _state.current
    cur._drain()
    r = fn(*a2, **k2)
    res = _result(r, ins, out)
    fresh = [x for x in _flat(res) if x._mem not in {m for m in mems} and x not in outs]
    views_only = not outs and all(any(x._mem is y._mem for y in ins) for x in _flat(res))
    if name in _NO_LAUNCH or (views_only and _flat(res)):
        return res
    cur.touch([m for m in mems], [x._mem for x in outs + fresh], name)
    _state.counters.launch(name)
    return res


def _dispatch(name: str, fn: Callable) -> Callable:
    def wrapped(*args: Any, **kw: Any) -> Any:
        return _call(name, fn, args, kw)
    wrapped.__name__ = name
    return wrapped


# ---------------------------------------------------------------- transfers
def _asarray(x: Any, dtype: Any = None, order: Any = None, copy: Any = None, blocking: bool = False) -> ndarray:
    if isinstance(x, ndarray):
        if dtype is None or np.dtype(dtype) == x.dtype:
            return x
        return x.astype(dtype)
    host = np.asarray(x, dtype=dtype)
    if isinstance(x, np.ndarray):
        _upload_sync(x, _state.current)
    out = ndarray(_a=np.array(host, copy=True, order="C"))
    _state.current.touch([], [out._mem], "asarray")
    _state.counters.launch("upload")
    return out


def _asnumpy(x: Any, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
    if isinstance(x, ndarray):
        _state.counters.sync("asnumpy")
        return x.get(stream=stream, order=order)
    return np.asarray(x, order=order)


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    s = _state.streams[stream]
    mem = _state.memory
    md, ms = mem.find(dst), mem.find(src)
    s.touch([ms] if ms else [], [md] if md else [], "memcpyAsync")
    s.enqueue(lambda: ctypes.memmove(dst, src, size))


def _device_count() -> int:
    if isinstance(_state.device_count, Exception):
        raise _state.device_count
    return _state.device_count


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device: int | None = None):
        self.id = _state.device if device is None else int(device)

    def use(self) -> "Device":
        if not 0 <= self.id < _device_count():
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        _state.device = self.id
        return self

    def __enter__(self) -> "Device":  # as CuPy's: current for the block, then the previous one
        self._previous = _state.device
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.device = self._previous

    def synchronize(self) -> None:
        _state.counters.sync("wait:device")
        for s in list(_state.by_sid.values()):
            s._drain()
            _join(_state.host_vc, s.snapshot())

    @property
    def pci_bus_id(self) -> str:
        return _state.bus_id

    @property
    def compute_capability(self) -> str:
        return "90"

    @property
    def attributes(self) -> dict:
        return {"MultiProcessorCount": 132, "ClockRate": 1980000}


# ------------------------------------------------------------------ kernels
#: NumPy twins of RawKernels, by kernel name: ``twin(grid, block, args)`` with
#: device arrays passed as raw pointers (ints) and scalars as given.
KERNELS: dict[str, Callable] = {}


def _ptr_args(args: tuple) -> tuple[tuple, list]:
    out, mems = [], []
    for a in args:
        if isinstance(a, ndarray):
            mems.append(a._mem)
            out.append(_addr(a._a))
        elif isinstance(a, np.ndarray):
            raise _host_error(a)
        else:
            out.append(a)
    return tuple(out), mems


class RawKernel:
    def __init__(self, code: str, name: str, options: tuple = (), backend: str = "nvrtc", **kw: Any):
        if name not in KERNELS:
            raise RuntimeError(f"fake cupy: no NumPy twin for kernel {name!r}")
        if f"void {name}(" not in code:
            raise RuntimeError(f"fake cupy: kernel {name!r} is not defined in its source")
        self.code, self.name, self.options = code, name, options

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        s = stream or _state.current
        raw, mems = _ptr_args(args)
        s._drain()
        s.touch(mems, mems, f"kernel {self.name}")
        _state.counters.launch(f"kernel:{self.name}")
        _state.counters.kernels.append(self.name)
        KERNELS[self.name](grid, block, raw, kernel=self)


def view(ptr: int, dtype: Any, shape: tuple, strides: tuple | None = None) -> np.ndarray:
    """A NumPy view of device memory at a raw pointer (for kernel twins); strides in elements."""
    dt = np.dtype(dtype)
    if not shape or min(shape) == 0:
        return np.empty(shape, dtype=dt)
    st = strides if strides is not None else tuple(
        int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    span = 1 + sum((n - 1) * s for n, s in zip(shape, st))
    buf = (ctypes.c_char * (span * dt.itemsize)).from_address(ptr)
    return np.ndarray(shape, dtype=dt, buffer=buf, strides=tuple(s * dt.itemsize for s in st))


# -------------------------------------------------------------------- cublas
_CUDA_TYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16)}
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70


class CUBLASError(RuntimeError):
    pass


def _gemm_strided_batched_ex(handle: int, transa: int, transb: int, m: int, n: int, k: int,
                             alpha: int, A: int, Atype: int, lda: int, strideA: int,
                             B: int, Btype: int, ldb: int, strideB: int, beta: int,
                             C: int, Ctype: int, ldc: int, strideC: int, batch: int,
                             compute: int, algo: int) -> None:
    """cublasGemmStridedBatchedEx, column-major: C = alpha op(A) op(B) + beta C."""
    ta, tb, tc = _CUDA_TYPES.get(Atype), _CUDA_TYPES.get(Btype), _CUDA_TYPES.get(Ctype)
    if ta is None or tb is None or tc is None or ta != tb:
        raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED: operand types")
    if compute == CUBLAS_COMPUTE_64F:
        ok, work = ta == tc == np.float64, np.float64
    elif compute in (CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32):
        ok, work = ta != np.float64 and tc != np.float64, np.float32
    else:
        ok, work = False, np.float32
    if not ok:
        raise CUBLASError(f"CUBLAS_STATUS_NOT_SUPPORTED: compute type {compute} with {ta}/{tc}")
    rows_a, rows_b = (m if transa == 0 else k), (k if transb == 0 else n)
    if min(m, n, k, batch) < 0 or lda < max(1, rows_a) or ldb < max(1, rows_b) or ldc < max(1, m):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: m={m} n={n} k={k} lda={lda} ldb={ldb} ldc={ldc}")
    scal = np.float64 if compute == CUBLAS_COMPUTE_64F else np.float32
    al, be = (float(np.frombuffer((ctypes.c_char * np.dtype(scal).itemsize).from_address(p), dtype=scal)[0])
              for p in (alpha, beta))
    s = _state.current
    mems = [_state.memory.find(p) for p in (A, B, C)]
    s._drain()
    s.touch([x for x in mems[:2] if x], [mems[2]] if mems[2] else [], "gemm")
    c = _state.counters
    c.launch("gemm")
    c.gemms.append({"api": "gemmEx", "A": ta.name, "C": tc.name, "compute": compute,
                    "lda": lda, "ldb": ldb, "ldc": ldc, "m": m, "n": n, "k": k, "batch": batch,
                    "aligned": all(x % 16 == 0 for x in (A, B, C))
                    and all((ld * it) % 16 == 0 for ld, it in ((lda, ta.itemsize), (ldb, tb.itemsize),
                                                              (ldc, tc.itemsize)))})
    if m == 0 or n == 0 or batch == 0:
        return
    for i in range(batch):
        a = view(A + i * strideA * ta.itemsize, ta, (rows_a, k if transa == 0 else m), (1, lda))
        b = view(B + i * strideB * tb.itemsize, tb, (rows_b, n if transb == 0 else k), (1, ldb))
        cc = view(C + i * strideC * tc.itemsize, tc, (m, n), (1, ldc))
        opa = (a if transa == 0 else a.T).astype(work)
        opb = (b if transb == 0 else b.T).astype(work)
        prod = al * (opa @ opb)
        if be != 0:
            prod = prod + be * cc.astype(work)
        cc[...] = prod.astype(tc)


def _matmul(a: Any, b: Any, out: Any = None, **kw: Any) -> Any:
    """CuPy's matmul: recorded as a GEMM in the operands' promoted dtype (float16 gives float16)."""
    for x in (a, b):
        if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
            raise _host_error(x)
    dt = np.promote_types(a.dtype, b.dtype)
    c = _state.counters
    lda = a.strides[-2] // a.itemsize if a.ndim >= 2 else 1
    ldb = b.strides[-2] // b.itemsize if b.ndim >= 2 else 1
    c.gemms.append({"api": "matmul", "A": dt.name, "C": dt.name, "compute": None, "lda": lda,
                    "ldb": ldb, "ldc": None, "aligned": (lda * dt.itemsize) % 16 == 0
                    and (ldb * dt.itemsize) % 16 == 0})
    return _call("matmul", np.matmul, (a, b), dict(kw, out=out) if out is not None else kw)


# --------------------------------------------------------------------- nccl
class NcclCommunicator:
    """Blocking MPI calls on a stream thread stand in for NCCL kernels."""

    def __init__(self, ndev: int, comm_id: Any, rank: int):
        from mpi4py import MPI

        self.mpi = MPI.COMM_WORLD.Dup()  # collective, like ncclCommInitRank
        ids = self.mpi.allgather((bytes(comm_id) if not isinstance(comm_id, tuple) else comm_id, rank))
        if len({i for i, _ in ids}) != 1:
            raise RuntimeError("fake nccl: ranks joined with different unique ids (real NCCL hangs)")
        assert self.mpi.Get_size() == ndev and self.mpi.Get_rank() == rank
        if sorted(r for _, r in ids) != list(range(ndev)):
            raise RuntimeError("fake nccl: ranks are not 0..ndev-1")
        _state.nccl_comms.append(self)

    def _buf(self, ptr: int, count: int) -> Any:
        return (ctypes.c_char * count).from_address(ptr)

    def _touch(self, kind: str, ptr: int, stream: int) -> None:
        m = _state.memory.find(ptr)
        _state.streams[stream].touch([m] if kind == "send" and m else [],
                                     [m] if kind == "recv" and m else [], f"nccl {kind}")

    def _recv_checked(self, ptr: int, count: int, peer: int) -> Any:
        from mpi4py import MPI

        st = MPI.Status()
        self.mpi.Probe(peer, MPI.ANY_TAG, st)
        if st.Get_count(MPI.BYTE) != count:
            raise RuntimeError(f"fake nccl: recv of {count} bytes matched a send of "
                               f"{st.Get_count(MPI.BYTE)} (real NCCL hangs or corrupts)")
        return self.mpi.Irecv([self._buf(ptr, count), count, MPI.BYTE], peer)

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._touch("send", ptr, stream)
        if _state_nccl.group is not None:
            _state_nccl.group.append((("send", self, ptr, count, peer), stream))
        else:
            _state.streams[stream].enqueue(lambda: self.mpi.Ssend([self._buf(ptr, count), count, _BYTE()], peer))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._touch("recv", ptr, stream)
        if _state_nccl.group is not None:
            _state_nccl.group.append((("recv", self, ptr, count, peer), stream))
        else:
            _state.streams[stream].enqueue(lambda: self._recv_checked(ptr, count, peer).Wait())

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
    if len({s for _, s in ops}) != 1:
        raise RuntimeError("fake nccl: one group on several streams")

    def run() -> None:
        reqs = []
        for (kind, c, ptr, count, peer), _ in ops:  # sends first: a probe must not wait on ourselves
            if kind == "send":
                reqs.append(c.mpi.Isend([c._buf(ptr, count), count, MPI.BYTE], peer))
        for (kind, c, ptr, count, peer), _ in ops:
            if kind == "recv":
                reqs.append(c._recv_checked(ptr, count, peer))
        MPI.Request.Waitall(reqs)

    _state.streams[ops[0][1]].enqueue(run)


# ------------------------------------------------------------------- module
_HOST_OK = {"asarray", "array", "asnumpy"}


def _module_getattr(name: str) -> Any:
    obj = getattr(np, name)
    if callable(obj) and not isinstance(obj, type):
        return _dispatch(name, obj)
    return obj


class _PoolStub:
    def free_all_blocks(self) -> None:
        pass

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


class _using_allocator:  # noqa: N801
    def __init__(self, allocator: Any = None):
        self.allocator = allocator

    def __enter__(self) -> None:
        self._prev, _state.allocator = _state.allocator, self.allocator

    def __exit__(self, *exc: Any) -> None:
        _state.allocator = self._prev


def build() -> dict[str, types.ModuleType]:
    """Fresh ``cupy`` (and ``cupy.cuda``, ``...runtime``, ``...nccl``, ``...device``,
    ``cupy_backends.cuda.libs.cublas``) modules."""
    cp = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    nccl = types.ModuleType("cupy.cuda.nccl")
    device = types.ModuleType("cupy.cuda.device")
    backends = types.ModuleType("cupy_backends")
    bcuda = types.ModuleType("cupy_backends.cuda")
    libs = types.ModuleType("cupy_backends.cuda.libs")
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cp.__version__ = "0.0-fake"
    cp.ndarray = ndarray
    cp.cuda = cuda
    cp.asarray = _asarray
    cp.array = _asarray
    cp.asnumpy = _asnumpy
    cp.matmul = _matmul
    cp.RawKernel = RawKernel
    cp.get_default_memory_pool = lambda: _PoolStub()
    cp.get_default_pinned_memory_pool = lambda: _PoolStub()
    cp.__getattr__ = _module_getattr
    cuda.Stream, cuda.Event, cuda.Device = Stream, Event, Device
    cuda.get_current_stream = lambda: _state.current
    cuda.alloc_pinned_memory = _alloc_pinned
    cuda.using_allocator = _using_allocator
    cuda.set_allocator = lambda allocator=None: None
    cuda.runtime, cuda.nccl, cuda.device = runtime, nccl, device
    device.get_cublas_handle = lambda: 1
    runtime.memcpyAsync = _memcpy_async
    runtime.memcpyHostToDevice, runtime.memcpyDeviceToHost = 1, 2
    runtime.getDeviceCount = _device_count
    runtime.memGetInfo = lambda: (1 << 30, 1 << 30)
    runtime.CUDARuntimeError = CUDARuntimeError
    runtime.CUDA_R_32F, runtime.CUDA_R_64F, runtime.CUDA_R_16F, runtime.CUDA_R_16BF = 0, 1, 2, 14
    runtime.getDeviceProperties = lambda dev: {"name": b"fake GPU (tests/fake_cupy.py)",
                                               "multiProcessorCount": 132, "clockRate": 1980000,
                                               "major": 9, "minor": 0}
    runtime.runtimeGetVersion = lambda: 0
    runtime.deviceSynchronize = lambda: Device().synchronize()
    nccl.available = True
    nccl.NCCL_UINT8 = 7
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = lambda: os.urandom(16)
    nccl.groupStart, nccl.groupEnd = _group_start, _group_end
    nccl.get_version = lambda: 0
    cublas.gemmStridedBatchedEx = _gemm_strided_batched_ex
    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_COMPUTE_64F = CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F
    cublas.CUBLAS_COMPUTE_32F_FAST_TF32 = CUBLAS_COMPUTE_32F_FAST_TF32
    cublas.CUBLAS_GEMM_DEFAULT, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
    cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T = 0, 1
    backends.cuda, bcuda.libs, libs.cublas = bcuda, libs, cublas
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.nccl": nccl,
            "cupy.cuda.device": device, "cupy_backends": backends, "cupy_backends.cuda": bcuda,
            "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.cublas": cublas}


def install(monkeypatch: Any, device_count: int | Exception = 1, bus_id: str | None = None,
            jitter: float = 2e-4) -> types.ModuleType:
    """Put a fresh fake CuPy into ``sys.modules`` for one test; returns the ``cupy`` module."""
    global _state
    _saved.append(_state)
    _state = _State()
    _state.start()
    Stream.null = _state.null  # type: ignore[attr-defined]
    _state.device_count, _state.jitter = device_count, jitter
    if bus_id is not None:
        _state.bus_id = bus_id
    mods = build()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import fake_kernels  # noqa: F401 - registers the kernel twins

    return mods["cupy"]


def shutdown() -> None:
    """Stop the stream threads, free the fake NCCL communicators, restore the state that
    :func:`install` replaced; raise a stream's error."""
    global _state
    done = _state
    for s in list(done.by_sid.values()):
        s.stop()
    for c in done.nccl_comms:
        c.mpi.Free()
    done.nccl_comms.clear()
    if _saved:
        _state = _saved.pop()
    if done.errors:
        raise done.errors[0]


def _dev(x: Any) -> Any:
    """A host array as a device array (no counting: for test set-up)."""
    if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
        return ndarray(_a=np.array(x, copy=True))
    return x
