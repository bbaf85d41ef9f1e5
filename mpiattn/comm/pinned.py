"""Reusable page-locked host buffers, handed back with the event that must complete first.

Device-to-host and host-to-device copies run asynchronously only from
page-locked (pinned) host memory, which is slow to allocate. The staged
transport (:mod:`mpiattn.comm.staged`) and :func:`mpiattn.gpu.upload` take
their host buffers from a :class:`PinnedPool` and give them back with the
event of the copy still using them; a buffer is handed out again only once
that event has completed.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

__all__ = ["PinnedPool"]

#: Free pinned bytes kept for reuse (in-flight buffers are not counted).
PINNED_KEEP_BYTES = 1 << 30


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
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 host array of ``nbytes`` that nothing else uses (thread-safe)."""
        with self._lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> np.ndarray:
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
        with self._lock:
            if self.kept + buf.nbytes <= self.keep_bytes:
                self._free.setdefault(buf.nbytes, collections.deque()).append((buf, after))
                self.kept += buf.nbytes
                return
        if after is not None:
            after.synchronize()  # freed memory may be handed out again at once
