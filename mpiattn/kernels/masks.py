"""Which (query, key) pairs a block of attention may use, decided per tile.

Every rule is written in *global* positions (``i`` a query row, ``j`` a key
row), so it holds whatever the layout, and all rules combine by AND::

    causal:   j <= i
    padding:  not pad[b, j]               (per batch entry b)

A :class:`BlockMask` describes one query shard against one key/value block.
Engines ask it, tile by tile, whether a tile of queries ``i0:i1`` and keys
``j0:j1`` has no visible pair (skip it), only visible pairs (no mask needed
except padding), or some (apply :meth:`BlockMask.bias` or
:meth:`BlockMask.visible`). The positional rules are decided on the host
from positions alone (no device work, no synchronisation); padding, which
lives on the device with the keys, is always applied as a bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend

__all__ = ["BlockMask", "padding_bias"]


def padding_bias(pad: Any, dtype: Any) -> Any:
    """``(B, k)`` bool padding (True = ignore) -> additive bias ``(B, 1, 1, k)``: 0 or -inf."""
    xp = backend.array_module(pad)
    bias = xp.zeros(pad.shape, dtype=dtype)
    bias[pad] = -np.inf
    return bias[:, None, None, :]


@dataclass
class BlockMask:
    """The visibility rules of one query shard against one key/value block.

    Attributes
    ----------
    q_pos : (n,) int64 numpy array
        Global positions of the queries (local order).
    k_pos : (k,) int64 numpy array
        Global positions of the block's keys.
    causal : bool
        Hide key ``j`` from query ``i`` when ``j > i``.
    pad : (B, k) bool array or None
        Key padding of the block (True = hidden), on the keys' device.
    """

    q_pos: np.ndarray
    k_pos: np.ndarray
    causal: bool = False
    pad: Any = None

    def __post_init__(self) -> None:
        self._pad_bias: dict = {}

    @property
    def positional(self) -> bool:
        """True when some rule depends on positions (so tiles may be skipped)."""
        return self.causal

    def visibility(self, i0: int, i1: int, j0: int, j1: int) -> str:
        """``"none"``, ``"all"`` or ``"some"`` pairs visible in queries ``i0:i1`` x keys ``j0:j1``.

        Padding is not counted here (it is applied to every tile as a bias).
        """
        if not self.causal or i1 <= i0 or j1 <= j0:
            return "all"
        q, k = self.q_pos[i0:i1], self.k_pos[j0:j1]
        if q.max() < k.min():
            return "none"
        if q.min() >= k.max():
            return "all"
        return "some"

    def visible_pairs(self, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """Host bool ``(i1-i0, j1-j0)``: the positional rules (True = visible), padding excluded."""
        q, k = self.q_pos[i0:i1], self.k_pos[j0:j1]
        ok = np.ones((q.size, k.size), dtype=bool)
        if self.causal:
            ok &= k[None, :] <= q[:, None]
        return ok

    def padding(self, xp: Any, j0: int, j1: int, dtype: Any) -> Any:
        """Additive padding bias ``(B, 1, 1, j1-j0)`` of keys ``j0:j1``, or None without padding."""
        if self.pad is None:
            return None
        key = np.dtype(dtype).str
        full = self._pad_bias.get(key)
        if full is None:
            full = self._pad_bias[key] = padding_bias(self.pad, dtype)
        return full[..., j0:j1]

    def bias(self, xp: Any, i0: int, i1: int, j0: int, j1: int, dtype: Any, group: int = 1,
             vis: str | None = None) -> Any:
        """Additive bias (0 or -inf) for queries ``i0:i1`` x keys ``j0:j1``, or None when nothing is hidden.

        Broadcastable to ``(B, Hkv, (i1-i0)*group, j1-j0)``: with ``group``
        each query row is repeated ``group`` times (the folded rows of
        :mod:`mpiattn.kernels.native`, row ``i*group + g``).
        """
        vis = self.visibility(i0, i1, j0, j1) if vis is None else vis
        out = self.padding(xp, j0, j1, dtype)
        if vis == "some":
            hidden = ~self.visible_pairs(i0, i1, j0, j1)
            if group > 1:
                hidden = np.repeat(hidden, group, axis=0)
            pos = np.zeros(hidden.shape, dtype=dtype)
            pos[hidden] = -np.inf
            pos = backend.to_device(pos, xp)
            out = pos if out is None else out + pos
        return out

    def visible(self, xp: Any, i0: int, i1: int, j0: int, j1: int, vis: str | None = None) -> Any:
        """Bool ``(B or 1, 1, i1-i0, j1-j0)`` on ``xp`` (True = visible), or None when all are visible."""
        vis = self.visibility(i0, i1, j0, j1) if vis is None else vis
        out = None
        if self.pad is not None:
            out = ~self.pad[:, None, None, j0:j1]
        if vis == "some":
            pos = backend.to_device(self.visible_pairs(i0, i1, j0, j1), xp)[None, None]
            out = pos if out is None else out & pos
        return out
