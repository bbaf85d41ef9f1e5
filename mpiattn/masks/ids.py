"""Document ids and key padding as every rank needs them: checked, then gathered whole.

The ids of every rank are gathered once per call, as host int64 arrays in
global order, so that every key/value block, wherever it comes from (ring,
all-gather, all-to-all), finds its ids by its global positions, and tiles
are classified on the host without touching the device. Memory: ``B (N + M)``
int64 words per rank, small beside the ``B Hkv M (E + Ev)`` words of the keys
and values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..sharding import gather

__all__ = ["local_ids", "global_rows"]


def local_ids(name: str, ids: Any, shape: tuple[int, int], xp: Any) -> np.ndarray:
    """This rank's ids checked against ``shape`` ``(B, rows)``, as a host int64 array (local).

    Raises
    ------
    TypeError
        Not an integer array, or on another device than the inputs (``xp``).
    ValueError
        Of another shape.
    """
    try:
        mod = backend.array_module(ids)
    except TypeError:
        raise TypeError(f"{name} must be an integer array of shape (B, rows) = {shape}, got "
                        f"{type(ids).__name__}") from None
    if mod is not np and mod is not xp:
        raise TypeError(f"{name} is a {mod.__name__} array but q, k, v are {xp.__name__} arrays")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (document ids), got dtype {ids.dtype}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape (B, rows) = {shape}, got {tuple(ids.shape)}")
    return np.ascontiguousarray(backend.to_host(ids)).astype(np.int64, copy=False)


def global_rows(c: Any, x: Any, n: int, layout: Any) -> Any:
    """Every rank's ``(B, n_r)`` rows (ids or padding) -> the global ``(B, n)`` array on every rank.

    A collective (:func:`mpiattn.gather` to every rank); ``x`` stays on its
    device. ``n`` is checked against the layout there.
    """
    out = gather(x, c, axis=-1, layout=layout, root=None)
    if out.shape[-1] != n:  # pragma: no cover - gather checked the shares
        raise ValueError(f"gathered {out.shape[-1]} rows, expected {n}")
    return out
