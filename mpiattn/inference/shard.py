"""One rank's rows of a key/value cache: blocks of keys and values with their global positions.

A :class:`Shard` keeps its rows in *blocks*: the arrays a rank adopted (a
prefill's shard, a chunk's rows; kept as they are, not copied) and pages of
``page`` rows allocated as appended rows arrive (a page is filled by
successive appends; a new one is allocated only when the last is full). So
growing never copies what is stored, and the storage exceeds the rows by
less than one page. Every row carries its global position (host ``int64``),
so masks decide on positions whatever the order the rows arrived in.

Arrays are NumPy or CuPy (:mod:`mpiattn.backend`): one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .. import backend

__all__ = ["Block", "Shard", "nonfinite"]


@dataclass
class Block:
    """Keys ``k (B, Hkv, cap, E)``, values ``v (B, Hkv, cap, Ev)``, positions ``pos (cap,)``;
    the first ``used`` rows are filled."""

    k: Any
    v: Any
    pos: np.ndarray
    used: int

    @property
    def room(self) -> int:
        return self.k.shape[2] - self.used


class Shard:
    """This rank's rows of one cache (see the module docstring).

    Parameters
    ----------
    xp : module
        ``numpy`` or ``cupy``.
    dtype : numpy.dtype
    B, Hkv, E, Ev : int
        Batch, key/value heads, key and value head dims.
    page : int
        Rows of an allocated page.
    """

    def __init__(self, xp: Any, dtype: Any, B: int, Hkv: int, E: int, Ev: int, page: int):
        self.xp, self.dtype = xp, np.dtype(dtype)
        self.B, self.Hkv, self.E, self.Ev, self.page = B, Hkv, E, Ev, page
        self.blocks: list[Block] = []
        self._open: list[Block] = []  # pages with room, in the order appends fill them

    # ----------------------------------------------------------------- size
    @property
    def rows(self) -> int:
        """Rows held."""
        return sum(b.used for b in self.blocks)

    @property
    def nbytes(self) -> int:
        """Bytes of key/value storage allocated (filled or not)."""
        return sum(int(b.k.nbytes) + int(b.v.nbytes) for b in self.blocks)

    def positions(self) -> np.ndarray:
        """Global positions of the rows, in storage order, ``(rows,)`` int64."""
        if not self.blocks:
            return np.zeros(0, np.int64)
        return np.concatenate([b.pos[:b.used] for b in self.blocks])

    # --------------------------------------------------------------- growing
    def adopt(self, k: Any, v: Any, pos: np.ndarray) -> None:
        """Keep ``k (B, Hkv, m, E)``, ``v (B, Hkv, m, Ev)`` at positions ``pos (m,)`` as one block.

        The arrays are kept (C-contiguous ones are not copied); rows are put
        in increasing position first when they are not (a copy).
        """
        pos = np.asarray(pos, dtype=np.int64)
        if pos.size == 0:
            return
        if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
            order = np.argsort(pos, kind="stable")
            idx = backend.to_device(order, self.xp)
            k, v, pos = k[:, :, idx], v[:, :, idx], pos[order]
        k, v = self.xp.ascontiguousarray(k), self.xp.ascontiguousarray(v)
        self.blocks.append(Block(k, v, pos.copy(), int(pos.size)))

    def reserve(self, t: int) -> list:
        """Allocate the pages that ``t`` more appended rows need (MemoryError: nothing changes);
        returns the new pages (for :meth:`unreserve`)."""
        room = sum(b.room for b in self._open)
        new = []
        xp = self.xp
        while room + len(new) * self.page < t:
            new.append(Block(xp.empty((self.B, self.Hkv, self.page, self.E), self.dtype),
                             xp.empty((self.B, self.Hkv, self.page, self.Ev), self.dtype),
                             np.zeros(self.page, np.int64), 0))
        self._open += new
        self.blocks += new
        return new

    def unreserve(self, pages: list) -> None:
        """Forget ``pages`` reserved but never filled (an append that was refused)."""
        ids = {id(b) for b in pages if b.used == 0}
        self._open = [b for b in self._open if id(b) not in ids]
        self.blocks = [b for b in self.blocks if id(b) not in ids]

    def extend(self, k: Any, v: Any, pos: np.ndarray) -> None:
        """Copy the rows ``k (B, Hkv, t, E)``, ``v``, at positions ``pos (t,)``, into pages."""
        done, t = 0, int(pos.size)
        self.reserve(t)
        while done < t:
            while self._open[0].room == 0:
                self._open.pop(0)
            b = self._open[0]
            take = min(b.room, t - done)
            b.k[:, :, b.used:b.used + take] = k[:, :, done:done + take]
            b.v[:, :, b.used:b.used + take] = v[:, :, done:done + take]
            b.pos[b.used:b.used + take] = pos[done:done + take]
            b.used += take
            done += take
        self._open = [b for b in self._open if b.room]

    # --------------------------------------------------------------- reading
    def views(self) -> Iterator[tuple[Any, Any, np.ndarray]]:
        """``(k, v, pos)`` of every block's filled rows (views, no copy)."""
        for b in self.blocks:
            if b.used:
                yield b.k[:, :, :b.used], b.v[:, :, :b.used], b.pos[:b.used]

    def whole(self) -> tuple[Any, Any, np.ndarray]:
        """All rows in increasing position as one ``(k, v, pos)`` (a copy unless one block)."""
        parts = list(self.views())
        pos = self.positions()
        if len(parts) == 1 and (pos.size < 2 or bool(np.all(pos[1:] > pos[:-1]))):
            return parts[0]
        xp = self.xp
        if not parts:
            return (xp.zeros((self.B, self.Hkv, 0, self.E), self.dtype),
                    xp.zeros((self.B, self.Hkv, 0, self.Ev), self.dtype), pos)
        k = xp.concatenate([p[0] for p in parts], axis=2)
        v = xp.concatenate([p[1] for p in parts], axis=2)
        order = np.argsort(pos, kind="stable")
        if not bool(np.all(order == np.arange(order.size))):
            idx = backend.to_device(order, xp)
            k, v, pos = k[:, :, idx], v[:, :, idx], pos[order]
        return xp.ascontiguousarray(k), xp.ascontiguousarray(v), pos


def nonfinite(xp: Any, *named: tuple[str, Any]) -> str | None:
    """The name of the first of the ``(name, array)`` pairs whose array holds NaN or Inf, or None
    (rows refused before they join a shard)."""
    return next((name for name, x in named if x.size and not bool(xp.isfinite(x).all())), None)
