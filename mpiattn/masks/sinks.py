"""Learnable attention sinks: one more term of every query row's softmax.

With sink ``σ_h`` of query head ``h`` (gpt-oss; FlashAttention 4's ``learnable_sink``)::

    p_ij = exp(y_ij) / (exp(σ_h) + sum_j exp(y_ij)),   lse_i = log(exp(σ_h) + sum_j exp(y_ij))

a key of score ``σ_h`` and value 0. It changes neither which pairs are
visible nor how a block is attended, only each row's normaliser, once: so it
is applied where a row's result is whole (:func:`add_sinks`, after any
strategy has merged its blocks) and ``out``, ``lse`` include it. A query that
sees no key gets ``out = 0``, ``lse = σ_h``. The backward of the blocks is
unchanged given that ``lse`` (``P = exp(y - lse)``, ``D = rowsum(dO * O)``
with the sink-including ``O``); the sinks' own gradient is::

    dσ_h = -sum_{b, i} exp(σ_h - lse_{b,h,i}) D_{b,h,i}

summed over every rank's rows (:func:`sink_gradient`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend

__all__ = ["check_sinks", "add_sinks", "sink_gradient", "local_sink_gradient"]


def check_sinks(sinks: Any, H: int) -> np.ndarray:
    """The sinks ``(H,)`` as a host float64 array; TypeError / ValueError otherwise."""
    a = backend.to_host(sinks)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"sinks must hold real numbers, got dtype {a.dtype}")
    if a.shape != (H,):
        raise ValueError(f"sinks must have shape (H,) = ({H},), got {a.shape}")
    a = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError("sinks contains NaN or Inf")
    return a


def add_sinks(out: Any, lse: Any, sinks: np.ndarray) -> tuple[Any, Any]:
    """``out (B, H, n, Ev)``, ``lse (B, H, n)`` of the scores alone -> with the sinks ``(H,)``.

    ``lse' = logaddexp(lse, σ_h)``, ``out' = exp(lse - lse') out`` (in ``lse``'s dtype; the
    arrays' device). Rows with ``lse = -inf`` get ``out' = 0``, ``lse' = σ_h``.
    """
    xp = backend.array_module(out, lse)
    s = backend.to_device(sinks.astype(lse.dtype), xp)[None, :, None]
    new = xp.logaddexp(lse, s)
    w = xp.exp(lse - new)
    return (out * w[..., None].astype(out.dtype, copy=False)), new


def local_sink_gradient(sinks: np.ndarray, lse: Any, D: Any) -> Any:
    """This rank's part of ``dσ``: ``-sum_{b,i} exp(σ_h - lse) D`` over its ``lse``, ``D``
    ``(B, H, n)`` (the sink-including ``lse``), ``(H,)`` in ``lse``'s dtype and device."""
    xp = backend.array_module(lse, D)
    s = backend.to_device(sinks.astype(lse.dtype), xp)[None, :, None]
    return -(xp.exp(s - lse) * D.astype(lse.dtype, copy=False)).sum(axis=(0, 2))


def sink_gradient(c: Any, sinks: np.ndarray, lse: Any, D: Any) -> np.ndarray:
    """``dσ (H,)``, float64 host, the same on every rank of ``c`` (collective): the sum of every
    rank's :func:`local_sink_gradient`."""
    part = local_sink_gradient(sinks, lse, D)
    return c.allreduce_(np.ascontiguousarray(backend.to_host(part), dtype=np.float64))
