"""The row-local arithmetic of a projection layer: ``x W + b`` in the accumulation dtype, heads
split from and merged into the last axis.

A layer's rows are ``(batch*rows, width)`` matrices; a projection's last axis splits as
``(heads, D)`` in that order (the convention of :class:`mpiattn.MultiheadAttention` and of
torch's ``nn.MultiheadAttention``). Nothing here communicates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend

__all__ = ["linear", "split_heads", "merge_heads"]


def linear(x2: Any, w: Any, b: Any | None, acc: np.dtype) -> Any:
    """``x2 @ w + b`` computed in the accumulation dtype ``acc``.

    x2 (rows, d_in), w (d_in, d_out), b (d_out,) or None -> (rows, d_out) in ``acc``.
    """
    y = x2.astype(acc, copy=False) @ w.astype(acc, copy=False)
    if b is not None:
        y += b.astype(acc, copy=False)
    return y


def split_heads(y2: Any, batch: int, rows: int, heads: int, dtype: np.dtype) -> Any:
    """(batch*rows, heads*D) -> contiguous (batch, heads, rows, D) in ``dtype``."""
    xp = backend.array_module(y2)
    y4 = y2.reshape(batch, rows, heads, y2.shape[1] // heads).transpose(0, 2, 1, 3)
    return xp.ascontiguousarray(y4, dtype=dtype)


def merge_heads(y4: Any) -> Any:
    """(batch, heads, rows, D) -> (batch*rows, heads*D) (a copy)."""
    b, h, rows, d = y4.shape
    return y4.transpose(0, 2, 1, 3).reshape(b * rows, h * d)  # explicit sizes: rows may be 0
