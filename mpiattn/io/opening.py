"""Opening a file to read it, and knowing that it stays the file opened.

An input is opened with a precise error when it cannot be (missing, a
dangling link, a link loop, a directory, not HDF5). A file is known by its
identity ``(device, inode, size, mtime_ns)``, taken from the descriptor of
the file actually opened (:func:`identity`); the identities the ranks saw
are compared with the one its metadata was read from (``_same_input``), so
a file replaced or written while a run reads it is an error, never a
result computed from two files. Root attributes come back as plain Python
values (:func:`read_attributes`).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import numpy as np

from ..comm.core import get_comm
from .atomic import on_rank0
from .paths import missing

__all__ = ["file_info", "identity", "read_attributes"]


def file_info(path: str, identity: tuple | None = None) -> dict:
    """``{"path", "size", "mtime", "identity"}`` of a file.

    The absolute path, bytes, ISO-8601 UTC modification time, and the
    identity ``(device, inode, size, mtime_ns)`` (:func:`identity`; by
    default that of ``path`` now).
    """
    if identity is None:
        st = os.stat(path)
        identity = (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))
    mtime = datetime.datetime.fromtimestamp(identity[3] / 1e9, tz=datetime.timezone.utc)
    return {"path": os.path.abspath(path), "size": identity[2],
            "mtime": mtime.isoformat(timespec="seconds"), "identity": identity}


def identity(f: Any) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of the file an open h5py ``File`` reads.

    From its file descriptor, so it names the file actually opened even if
    the path now leads elsewhere.
    """
    try:
        st = os.fstat(f.id.get_vfd_handle())
    except Exception:  # noqa: BLE001 - a driver without a descriptor: the path, at once
        st = os.stat(f.filename)
    return (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))


def _same_input(path: str, want: tuple, got: list) -> None:
    """Raise unless every rank's identities in ``got`` equal ``want`` (every rank decides alike)."""
    for r, ids in enumerate(got):
        for seen in ids:
            if tuple(seen) != tuple(want):
                what = ("another file (device, inode " f"{seen[0]}, {seen[1]})"
                        if tuple(seen[:2]) != tuple(want[:2]) else
                        f"the same file changed (size {seen[2]} bytes, modified "
                        f"{seen[3] / 1e9:.3f}; first seen: {want[2]} bytes, {want[3] / 1e9:.3f})")
                raise ValueError(f"input file {path} changed while this run was reading it: rank "
                                 f"{r} found {what}; nothing was computed. Run again once nothing "
                                 "replaces or writes the input")


def _open_read(path: str) -> Any:
    import h5py

    problem = missing(path, "input file")
    if problem is not None:
        raise problem
    if os.path.isdir(path):
        raise IsADirectoryError(f"input {path} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise OSError(f"cannot open {path} as an HDF5 file: {exc}") from None


def _plain(value: Any) -> Any:
    """HDF5 attribute value -> plain Python scalar/str."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def read_attributes(path: str, comm: Any = None) -> dict | None:
    """The root attributes of an HDF5 file (plain Python values), or None when it is not one.

    Rank 0 reads; every rank receives the result (or the same error).
    """
    c = get_comm(comm)

    def attrs() -> dict | None:
        try:
            f = _open_read(path)
        except OSError:
            return None
        with f:
            return {k: _plain(v) for k, v in f.attrs.items()}

    return on_rank0(c, attrs)
