"""The mask rules materialised: a dense boolean matrix, for references and cross-checks.

Never used by the engines (they decide per tile, :mod:`mpiattn.masks.tiles`);
the library's float64 reference (:mod:`mpiattn.kernels.reference`) and the
materialized strategy use it. Memory ``Bs * n * k`` booleans.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from .spec import MaskSpec

__all__ = ["visible"]


def visible(mask: MaskSpec, q_pos: np.ndarray, k_pos: np.ndarray, seg_q: Any = None,
            seg_k: Any = None, pad: Any = None) -> np.ndarray:
    """Bool ``(Bs, n, k)``: True where query ``q_pos[i]`` may see key ``k_pos[j]``.

    Parameters
    ----------
    mask : MaskSpec
    q_pos, k_pos : (n,), (k,) integer arrays
        Global positions of the queries and of the keys.
    seg_q, seg_k : (B, n), (B, k) integer arrays, optional
        Document ids at those positions (both or neither).
    pad : (B, k) bool array, optional
        Key padding at those positions (True = hidden).

    Returns
    -------
    ndarray of bool, shape (Bs, n, k)
        ``Bs`` is the batch size when ids or padding are given, else 1.
    """
    q = np.asarray(q_pos, dtype=np.int64)[:, None]
    k = np.asarray(k_pos, dtype=np.int64)[None, :]
    lo, hi = mask.band()
    ok = np.ones((q.shape[0], k.shape[1]), dtype=bool)
    if lo > -np.inf:
        ok &= k - q >= lo
    if hi < np.inf:
        ok &= k - q <= hi
    ok = ok[None]
    if seg_q is not None:
        ok = ok & (backend.to_host(seg_q)[:, :, None] == backend.to_host(seg_k)[:, None, :])
    if pad is not None:
        ok = ok & ~backend.to_host(pad).astype(bool, copy=False)[:, None, :]
    return ok
