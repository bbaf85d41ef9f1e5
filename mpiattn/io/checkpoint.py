"""Checkpoints of replicated parameters (e.g. a layer's weights) in HDF5.

A checkpoint is a file with root attributes (``format``, ``format_version``
and whatever the owner records) and one dataset per array under the group
``params``. Parameters are replicated, so rank 0 writes (through
:func:`mpiattn.io.atomic.write_atomically`: a crash never leaves a
half-written file) and every rank reads.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from ..comm.core import get_comm
from .atomic import write_atomically

__all__ = ["save_params", "load_params"]


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def save_params(path: str | os.PathLike, params: Mapping[str, np.ndarray], attrs: Mapping[str, Any],
                comm: Any = None) -> None:
    """Write ``params`` (NumPy arrays, rank 0's) and root ``attrs`` to ``path`` (collective).

    An existing ``path`` is replaced. Every rank returns once the file is
    complete, so any rank may read it right after.

    Raises
    ------
    OSError, ValueError, TypeError
        The same error on every rank; ``path`` is then unchanged.
    """
    c = get_comm(comm)

    def write(tmp: str) -> None:
        with c.collective_errors():
            if c.rank == 0:
                import h5py

                with h5py.File(tmp, "w-") as f:
                    f.attrs.update(dict(attrs))
                    grp = f.create_group("params")
                    for name, value in params.items():
                        grp.create_dataset(name, data=np.asarray(value))

    nbytes = sum(int(np.asarray(value).nbytes) for value in params.values()) if c.rank == 0 else 0
    write_atomically(c, os.fspath(path), write, force=True, nbytes=nbytes)


def load_params(path: str | os.PathLike, fmt: str, max_version: int,
                comm: Any = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a checkpoint written by :func:`save_params` (every rank reads).

    Parameters
    ----------
    path : path-like
    fmt : str
        The expected ``format`` attribute.
    max_version : int
        The newest ``format_version`` the caller understands.

    Returns
    -------
    (attrs, params) : (dict, dict of numpy.ndarray)

    Raises
    ------
    FileNotFoundError, ValueError
        On every rank, when the file is missing, is not such a checkpoint, or
        is newer than ``max_version``.
    """
    c = get_comm(comm)
    path = os.fspath(path)
    out: tuple[dict, dict] = ({}, {})
    with c.collective_errors():
        out = _read(path, fmt, max_version)
    return out


def _read(path: str, fmt: str, max_version: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import h5py

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"cannot read {path!r} as HDF5: {exc}") from exc
    with f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        if attrs.get("format") != fmt:
            raise ValueError(f"{path!r} is not a saved {fmt} (no matching format attribute)")
        version = int(attrs.get("format_version", 0))
        if version > max_version:
            raise ValueError(f"{path!r} has format version {version}; this mpiattn reads up to {max_version}")
        grp = f.get("params")
        if not isinstance(grp, h5py.Group):
            raise ValueError(f"{path!r} lacks the 'params' group of a saved {fmt}")
        params = {name: grp[name][()] for name in grp.keys() if isinstance(grp[name], h5py.Dataset)}
    return attrs, params
