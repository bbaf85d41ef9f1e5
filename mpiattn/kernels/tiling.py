"""The kernels' shared ground: folded query rows, scratch buffers, the walk over visible tiles.

Used by the native engine's host loops (:mod:`mpiattn.kernels.native`,
:mod:`mpiattn.kernels.native_backward`) and its device loops
(:mod:`mpiattn.kernels.native_cuda`); nothing here computes a score.

Row layout
----------
Queries are kept "folded": ``q`` of shape ``(B, H, n, E)`` with
``H = G * Hkv`` query heads per key/value head becomes ``qs`` of shape
``(B, Hkv, n*G, E)``, row ``i*G + g`` holding query position ``i`` of query
head ``kv*G + g`` (torch's ``repeat_interleave`` convention), multiplied by the
softmax scale ``s`` and cast to the accumulation dtype. One GEMM then serves
all ``G`` query heads of a key/value head, and blocks of consecutive rows are
blocks of consecutive query positions (what causal skipping needs).

A block of keys is cut into score tiles of :data:`DEFAULT_TILE` rows (or the tile the
call names) each way; :func:`key_tiles` yields only the key tiles that some query sees,
each with the query tiles that see it (:func:`query_tiles`), as the block's
:class:`~mpiattn.masks.BlockMask` tells, so a tile or a whole block with no visible pair
costs host checks only.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator

from .. import backend
from ..masks import BlockMask

__all__ = ["DEFAULT_TILE", "fold_queries", "unfold_rows", "Workspace", "query_tiles", "key_tiles"]

#: Default tile edge (rows of queries x rows of keys) for the score block.
DEFAULT_TILE = 512


def fold_queries(q: Any, hkv: int, scale: float | None, dtype: Any, pad: int = 0) -> Any:
    """``(B, H, n, F)`` -> ``(B, Hkv, n*G, F + pad)`` in ``dtype``, times ``scale`` if given.

    The ``pad`` extra columns are left uninitialised (the kernels use them to
    fold a per-row shift into a GEMM).
    """
    xp = backend.array_module(q)
    B, H, n, F = q.shape
    if H == hkv and not pad and scale is None and q.dtype == dtype:
        return q  # nothing to fold, scale or cast: the caller's array (read only)
    G = H // hkv
    out = xp.empty((B, hkv, n, G, F + pad), dtype=dtype)
    body = out[..., :F] if pad else out
    body[...] = q.reshape(B, hkv, G, n, F).transpose(0, 1, 3, 2, 4)
    if scale is not None:
        body *= scale
    return out.reshape(B, hkv, n * G, F + pad)


def unfold_rows(x: Any, h: int) -> Any:
    """Inverse of :func:`fold_queries` for ``(B, Hkv, n*G, ...)`` -> ``(B, H, n, ...)`` (a copy)."""
    xp = backend.array_module(x)
    B, hkv, nG = x.shape[:3]
    rest = x.shape[3:]
    G = h // hkv
    n = nG // G if G else 0
    y = x.reshape((B, hkv, n, G) + rest)
    y = xp.moveaxis(y, 3, 2)
    return xp.ascontiguousarray(y).reshape((B, h, n) + rest)


class Workspace:
    """Reusable scratch buffers, so the tile loop allocates nothing.

    ``get(name, shape, dtype)`` returns a C-contiguous array of ``shape``
    carved from a grow-only flat buffer kept under ``name`` (its contents are
    whatever was there before).
    """

    def __init__(self, xp: Any):
        self.xp = xp
        self._bufs: dict[str, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        size = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.xp.empty(max(size, 1), dtype=dtype)
            self._bufs[name] = buf
        return buf[:size].reshape(shape)

    def with_ones(self, name: str, x: Any, k0: int, k1: int, dtype: Any) -> Any:
        """``[x[k0:k1], 1]``: ``(B, Hkv, k1-k0, F+1)`` in ``dtype`` (the ones column sums a GEMM's rows)."""
        F = x.shape[-1]
        xo = self.get(name, x.shape[:2] + (k1 - k0, F + 1), dtype)
        xo[..., :F] = x[..., k0:k1, :]
        xo[..., F] = 1
        return xo

    def transposed(self, name: str, x: Any, k0: int, k1: int, dtype: Any) -> Any:
        """``[x[k0:k1]^T ; 1]``: ``(B, Hkv, F+1, k1-k0)`` in ``dtype`` (the ones row carries a GEMM shift)."""
        F = x.shape[-1]
        xt = self.get(name, x.shape[:2] + (F + 1, k1 - k0), dtype)
        xt[..., :F, :] = x[..., k0:k1, :].swapaxes(-1, -2)
        xt[..., F, :] = 1
        return xt


def _tiles(n: int, t: int) -> range:
    return range(0, n, max(1, t))


def query_tiles(mask: BlockMask, j0: int, j1: int, group: int,
                tile: int) -> Iterator[tuple[int, int, int, int, str]]:
    """Query tiles that see at least one key of ``j0:j1``: ``(i0, i1, r0, r1, visibility)``.

    ``i0:i1`` are query rows, ``r0:r1`` the same as folded rows (``group`` per query).
    """
    n = mask.q_pos.size
    for i0 in _tiles(n, tile):
        i1 = min(i0 + tile, n)
        vis = mask.visibility(i0, i1, j0, j1)
        if vis != "none":
            yield i0, i1, i0 * group, i1 * group, vis


def key_tiles(mask: BlockMask, group: int, tile: int) -> Iterator[tuple[int, int, Iterator]]:
    """Key tiles ``j0:j1`` that some query sees, each with its :func:`query_tiles`.

    A key tile's operands are prepared only for these, so a key tile (or a
    whole block) with no visible pair costs host checks only.
    """
    n, nk = mask.q_pos.size, mask.k_pos.size
    for j0 in _tiles(nk, tile):
        j1 = min(j0 + tile, nk)
        if mask.visibility(0, n, j0, j1) == "none":
            continue
        tiles = query_tiles(mask, j0, j1, group, tile)
        first = next(tiles, None)
        if first is not None:
            yield j0, j1, itertools.chain((first,), tiles)
