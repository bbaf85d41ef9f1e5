"""Key/value caches in HDF5: written row by row by their owners, read back at any rank count.

A cache file holds the datasets ``k (B, Hkv, M, E)`` and ``v (B, Hkv, M,
Ev)`` in global position order (row ``j`` is position ``j``, whichever rank
held it) and root attributes: ``format`` (:data:`FORMAT`),
``format_version``, ``axes`` (:data:`AXES`), ``length`` (``M``), ``page``
and ``placement`` (the append policy), ``ranks`` and ``rows_per_rank`` (the
writer's shards). Other datasets may travel beside them (the prompt's
attention ``out`` and ``lse`` written by ``mpiattn prefill``, and the score
modifiers it used, as :mod:`mpiattn.masks.stored` holds them: per-head
datasets and root attributes).

:func:`save_cache` writes through :func:`mpiattn.io.writing.write_rows`
(each rank its own rows; published atomically, vetoed by a signal).
:func:`read_cache_meta` checks a file on rank 0 (one error on every rank);
:func:`read_cache_rows` reads any range of positions on every rank, each
rank checking that it reads the very file rank 0 checked.
:func:`read_replicated` reads small datasets whole on every rank (the new
tokens of a decode step).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .. import backend
from ..comm.core import Comm
from ..masks import stored
from .atomic import Target, on_rank0, publish
from .naming import NEW, REPLACE, Rule
from .publishing import Outputs
from .opening import _open_read, _plain, identity
from .schema import _scale_attribute, read_whole_datasets, window_from_attribute
from .writing import Rows, rows_target

__all__ = ["FORMAT", "VERSION", "AXES", "save_cache", "cache_target", "read_cache_meta",
           "read_cache_rows", "read_replicated"]

#: The largest ``page`` attribute (:data:`mpiattn.inference.placement.MAX_PAGE_ROWS`).
MAX_PAGE_ROWS = 1 << 20

#: The ``format`` attribute of a cache file, its version and its axes.
FORMAT, VERSION, AXES = "mpiattn-kv-cache", 1, "batch,kv_heads,position,feature"


def cache_target(c: Comm, path: str, k: Rows, v: Rows, attrs: Mapping[str, Any], *,
                 extra: Mapping[str, Rows] | None = None, rule: Rule = NEW) -> Target:
    """A cache file as a :class:`~mpiattn.io.atomic.Target` (collective): this rank's ``k`` and
    ``v`` rows, ``attrs``, and ``extra`` datasets, named by ``rule``.

    ``k`` and ``v`` carry their :class:`~mpiattn.layouts.Layout` (the
    positions each rank holds, increasing in its local order).
    """
    datasets = {"k": k, "v": v, **dict(extra or {})}
    meta = {"format": FORMAT, "format_version": VERSION, "axes": AXES, **dict(attrs)}
    return rows_target(path, datasets, c, layout="contiguous", attrs=meta, rule=rule)


def save_cache(c: Comm, path: str, k: Rows, v: Rows, attrs: Mapping[str, Any], *,
               extra: Mapping[str, Rows] | None = None, force: bool = False,
               outputs: Outputs | None = None) -> None:
    """Write a cache (collective; :func:`cache_target`), atomically. Raises the same error on
    every rank, ``path`` then unchanged."""
    target = cache_target(c, path, k, v, attrs, extra=extra, rule=REPLACE if force else NEW)
    publish(c, [target], outputs=outputs)


def _meta(path: str) -> dict:
    """The checked metadata of a cache file (one rank reads)."""
    f = _open_read(path)
    with f:
        attrs = {key: _plain(value) for key, value in f.attrs.items()}
        if attrs.get("format") != FORMAT:
            raise ValueError(f"{path} is not an mpiattn key/value cache (its 'format' attribute is "
                             f"{attrs.get('format')!r}, expected {FORMAT!r})")
        version = attrs.get("format_version")
        if not isinstance(version, int) or not 1 <= version <= VERSION:
            raise ValueError(f"{path} has cache format version {version!r}; this mpiattn reads "
                             f"1..{VERSION}")
        if attrs.get("axes") != AXES:
            raise ValueError(f"{path} stores its cache with axes {attrs.get('axes')!r}; this mpiattn "
                             f"reads {AXES!r} (another layout of the cache)")
        shapes, dtypes = {}, {}
        for name in ("k", "v"):
            ds = f.get(name)
            if ds is None or not hasattr(ds, "shape"):
                raise ValueError(f"{path} lacks the cache dataset {name!r}")
            if len(ds.shape) != 4:
                raise ValueError(f"{path}: dataset {name!r} has shape {ds.shape}; expected (B, Hkv, M, "
                                 "E)")
            shapes[name] = tuple(int(s) for s in ds.shape)
            dtypes[name] = np.dtype(ds.dtype).newbyteorder("=")
        if shapes["k"][:3] != shapes["v"][:3] or dtypes["k"] != dtypes["v"]:
            raise ValueError(f"{path}: k {shapes['k']} {dtypes['k']} and v {shapes['v']} {dtypes['v']} "
                             "must agree in batch, heads, length and dtype")
        backend.check_dtype(dtypes["k"], f"{path}: dataset 'k'")
        length, page = attrs.get("length"), attrs.get("page")
        if length != shapes["k"][2]:
            raise ValueError(f"{path}: attribute 'length' is {length!r} but the datasets hold "
                             f"{shapes['k'][2]} rows (a damaged or unfinished cache)")
        if not isinstance(page, int) or isinstance(page, bool) or not 1 <= page <= MAX_PAGE_ROWS:
            raise ValueError(f"{path}: attribute 'page' must be an integer from 1 to "
                             f"{MAX_PAGE_ROWS}, got {page!r}")
        try:
            window = window_from_attribute(attrs.get("window"))
        except ValueError as exc:
            raise ValueError(f"{path}: attribute 'window': {exc}") from None
        scale = _scale_attribute(path, attrs.get("scale"))
        score = stored.from_file(read_whole_datasets(f, path), stored.read_attributes(attrs, path))
        B, Hkv, M, E = shapes["k"]
        return {"B": B, "Hkv": Hkv, "M": M, "E": E, "Ev": shapes["v"][3], "dtype": dtypes["k"].str,
                "page": page, "window": window, "scale": scale, "score": score,
                "attrs": attrs, "identity": identity(f),
                "extra": {name: tuple(int(x) for x in f[name].shape) for name in sorted(f.keys())
                          if name not in ("k", "v") and hasattr(f[name], "shape")}}


def read_cache_meta(c: Comm, path: str) -> dict:
    """The metadata of the cache at ``path`` (rank 0 checks; the same dict or error on every rank).

    Returns
    -------
    dict
        ``B, Hkv, M, E, Ev`` (int), ``dtype`` (str), ``page`` (int),
        ``window`` (``(left, right)`` or None), ``scale`` (float or None)
        as the file's attributes say, ``score`` (the
        :class:`~mpiattn.masks.score.Score` of the modifiers it keeps:
        :func:`mpiattn.masks.stored.from_file`), ``attrs`` (the
        root attributes), ``identity`` (the file read), ``extra`` (the
        datasets other than ``k`` and ``v``: their shapes, by name).

    Raises
    ------
    FileNotFoundError, OSError, ValueError, TypeError
        A missing or unreadable file, one that is no cache of this format
        and version, or whose datasets disagree with its attributes.
    """
    return on_rank0(c, lambda: _meta(os.path.abspath(path)))


def read_cache_rows(c: Comm, path: str, meta: dict, start: int, stop: int,
                    names: tuple = ("k", "v"), axis: int = 2) -> tuple:
    """Positions ``start:stop`` (along ``axis``) of the datasets ``names`` (every rank its own
    range; collective), as C-contiguous NumPy arrays in native byte order.

    Every rank checks it opened the file :func:`read_cache_meta` checked
    (device, inode, size, modification time). Raises the same error on every
    rank (a truncated or replaced file included).
    """
    out: tuple = ()
    with c.collective_errors():
        try:
            f = _open_read(os.path.abspath(path))
            with f:
                if tuple(identity(f)) != tuple(meta["identity"]):
                    raise ValueError(f"the cache {path} changed while it was being read; nothing "
                                     "was loaded")
                cut = (slice(None),) * axis + (slice(start, stop),)
                out = tuple(np.ascontiguousarray(f[name][cut],
                                                 dtype=np.dtype(f[name].dtype).newbyteorder("="))
                            for name in names)
        except (OSError, KeyError, RuntimeError) as exc:
            raise ValueError(f"cannot read the cache {path} (damaged or truncated?): {exc}") from None
    return out


def read_replicated(c: Comm, path: str, names: tuple, optional: tuple = (), *,
                    whole: bool = False, refused: Mapping[str, str] | None = None) -> dict:
    """Datasets ``names`` (and those of ``optional`` present) of ``path``, whole, on every rank.

    With ``whole``, also the score modifiers' per-head datasets the file holds
    (:func:`~mpiattn.io.schema.read_whole_datasets`: checked, float64).
    ``refused`` maps names the file must not hold to the end of the error (``PATH holds 'NAME', ``
    then that text).

    Every rank reads and checks it read the file rank 0 saw first. Raises
    the same error on every rank when the file or a required dataset is
    missing or unreadable, or the file holds a refused dataset.
    """
    seen = on_rank0(c, lambda: _identity_of(os.path.abspath(path)))
    out: dict = {}
    with c.collective_errors():
        try:
            f = _open_read(os.path.abspath(path))
            with f:
                if tuple(identity(f)) != tuple(seen):
                    raise ValueError(f"{path} changed while it was being read")
                for name, why in (refused or {}).items():
                    if name in f:
                        raise ValueError(f"{path} holds {name!r}, {why}")
                if whole:
                    out.update(read_whole_datasets(f, path))
                for name in (*names, *optional):
                    ds = f.get(name)
                    if ds is None and name in names:
                        raise ValueError(f"{path} has no dataset {name!r}")
                    if ds is not None:
                        out[name] = np.ascontiguousarray(ds[()], dtype=np.dtype(ds.dtype).newbyteorder("="))
        except (OSError, KeyError, RuntimeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
    return out


def _identity_of(path: str) -> tuple:
    with _open_read(path) as f:
        return identity(f)
