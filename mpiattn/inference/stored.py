"""A cache's file: read back at any rank count, written whole or not at all.

:meth:`KVCache.load <mpiattn.inference.cache.KVCache.load>`,
:meth:`~mpiattn.inference.cache.KVCache.target` and
:meth:`~mpiattn.inference.cache.KVCache.save` through :mod:`mpiattn.io.kvstore` (the file's
layout: rows at their global positions, the length, the page, the placement policy and the
writer's rows per rank) and :mod:`mpiattn.io.atomic` (published atomically; ``grow``
replaces only the very file that was read). On reading, rank ``r`` takes the ``r``-th of
``P`` contiguous ranges of positions (``numpy.array_split``'s sizes), so a cache saved at
one rank count loads at any other.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm
from ..comm.device import prepare
from ..io.atomic import Target, publish
from ..io.kvstore import cache_target, read_cache_meta, read_cache_rows
from ..io.naming import NEW, REPLACE, Rule
from ..io.publishing import Outputs
from ..io.writing import Rows
from ..layouts import all_segments
from ..strategies.spec import SKIP_FINITE
from .placement import POLICY, Placement, check_page
from .shard import Shard, nonfinite

__all__ = ["read", "target", "save"]


def read(c: Comm, path: str | os.PathLike, page: int | None, device: str,
         check_finite: bool) -> tuple[Shard, Placement, tuple]:
    """This rank's rows of the cache file ``path`` (collective): its shard, the placement every
    rank holds and the file's identity ``(device, inode, size, mtime_ns)``; ``page`` None keeps
    the saved one. Raises on every rank alike (see :meth:`KVCache.load
    <mpiattn.inference.cache.KVCache.load>`)."""
    path = os.fspath(path)
    with c.collective_errors():
        if device not in ("numpy", "cupy"):
            raise ValueError(f"device must be 'numpy' or 'cupy', got {device!r}")
        page = None if page is None else check_page(page)
    meta = read_cache_meta(c, path)
    M = meta["M"]
    seg = all_segments(M, c.size, "contiguous")[c.rank]
    start, stop = (seg[0][0], seg[0][0] + seg[0][1]) if seg else (0, 0)
    k, v = read_cache_rows(c, path, meta, start, stop)
    with c.collective_errors():
        if check_finite and nonfinite(np, ("k", k), ("v", v)):
            raise ValueError(f"the cache {path} holds NaN or Inf keys or values (near "
                             f"positions {start}..{stop - 1}; {SKIP_FINITE})")
    if device == "cupy":
        import cupy

        k, v = cupy.asarray(k), cupy.asarray(v)
    page = meta["page"] if page is None else page
    counts = [sum(n for _, n in s) for s in all_segments(M, c.size, "contiguous")]
    prepare(c, k, v)
    shard = Shard(backend.array_module(k), k.dtype, meta["B"], meta["Hkv"], meta["E"],
                  meta["Ev"], page)
    shard.adopt(k, v, np.arange(start, stop, dtype=np.int64))
    return shard, Placement.start(counts, page), tuple(meta["identity"])


def target(cache: Any, path: str | os.PathLike, rule: Rule = NEW, extra: dict | None = None,
           attrs: dict | None = None) -> Target:
    """``cache`` (a :class:`~mpiattn.inference.cache.KVCache`) as a file to publish under
    ``path`` by ``rule`` (collective: the layout of its rows is gathered)."""
    kx, vx, _ = cache.shard.whole()
    lay = cache.layout()
    meta = {"length": cache.length, "page": cache.page, "placement": POLICY,
            "ranks": cache.comm.size, "rows_per_rank": list(cache.placement.counts),
            **dict(attrs or {})}
    return cache_target(cache.comm, os.path.abspath(os.fspath(path)),
                        Rows(backend.to_host(kx), cache.length, 2, lay),
                        Rows(backend.to_host(vx), cache.length, 2, lay), meta, extra=extra,
                        rule=rule)


def save(cache: Any, path: str | os.PathLike, force: bool, grow: bool, extra: dict | None,
         attrs: dict | None, outputs: Outputs | None) -> None:
    """Write ``cache`` to ``path`` (collective): the path and the flags agreed, the naming rule
    (``grow``: only over the file it was read from), one atomic publication."""
    c = cache.comm
    path = os.path.abspath(os.fspath(path))
    c.agree(lambda: {"save's path": path, "save's force": bool(force), "save's grow": bool(grow)},
            call="KVCache.save")
    with errors.alike():
        if grow and cache.identity is None:
            raise ValueError("save(grow=True) replaces the file the cache was loaded from; this "
                             "cache was not loaded from a file")
    rule = Rule.grows(cache.identity) if grow else (REPLACE if force else NEW)
    publish(c, [cache.target(path, rule=rule, extra=extra, attrs=attrs)], outputs=outputs)
