"""Random inputs of the benchmark cases: every rank draws only its own rows.

A generator per (seed, rank count, rank) makes each rank's shard without any
global array (except for the single-process peers, which hold the whole
problem by definition); the arrays are drawn on the host and moved to the
device once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..layouts import local_length
from .tasks import Task

__all__ = ["draw", "local_qkv", "local_dout"]


def draw(xp: Any, rng: np.random.Generator, shape: tuple, dtype: str) -> Any:
    """Standard normal numbers of ``shape`` in ``dtype``, in namespace ``xp``."""
    dt = np.dtype(dtype)
    x = rng.standard_normal(shape, dtype=dt if dt in (np.float32, np.float64) else np.float32)
    if x.dtype != dt:
        x = x.astype(dt)
    return backend.to_device(x, xp)


def local_qkv(xp: Any, t: Task, rank: int, P: int, seed: int) -> tuple[Any, Any, Any]:
    """This rank's q, k, v rows of attention task ``t`` (all of them for a single-process peer)."""
    n = t.N if t.single_process else local_length(t.N, rank, P, t.layout)
    m = t.M if t.single_process else local_length(t.M, rank, P, t.layout)
    rng = np.random.default_rng([seed, P, rank])
    return (draw(xp, rng, (t.B, t.H, n, t.E), t.dtype),
            draw(xp, rng, (t.B, t.Hkv, m, t.E), t.dtype),
            draw(xp, rng, (t.B, t.Hkv, m, t.Ev), t.dtype))


def local_dout(xp: Any, q: Any, t: Task, rank: int, seed: int) -> Any:
    """A random ``dout`` shaped like this rank's output ``(B, H, n_r, Ev)``."""
    rng = np.random.default_rng([seed, 99, rank])
    return draw(xp, rng, tuple(q.shape[:3]) + (t.Ev,), t.dtype)
