"""Atomic outputs: a file appears complete under its name, or not at all.

Every output (attention results, layer checkpoints) is written to a
temporary file ``.NAME.mpiattn-XXXX.tmp`` in the target directory and
renamed to ``NAME`` by rank 0 only after every rank has reported success
(:func:`write_atomically`). A failure leaves no partial file under ``NAME``
and a previous ``NAME`` untouched, and the temporary file is removed.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from ..comm.core import Comm, get_comm

__all__ = ["on_rank0", "check_output", "temp_path", "write_atomically"]


def on_rank0(c: Any, fn: Callable[[], Any]) -> Any:
    """Run the local ``fn`` on rank 0; its error is raised on every rank, its result broadcast."""
    result = None
    with c.collective_errors():
        if c.rank == 0:
            result = fn()
    return c.bcast_obj(result) if c.size > 1 else result


def _output_problem(path: str, force: bool) -> None:
    """Raise when ``path`` cannot be (over)written: local checks plus a probe file."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"output directory {directory} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"output {path} is a directory")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"output {path} already exists (overwrite with force=True, "
                              "--force on the command line)")
    probe = os.path.join(directory, f".mpiattn-probe-{uuid.uuid4().hex[:12]}")
    try:
        with open(probe, "x"):
            pass
    except OSError as exc:
        raise PermissionError(f"cannot create files in output directory {directory}: "
                              f"{exc.strerror or exc}") from None
    os.remove(probe)


def check_output(path: str, comm: Any = None, *, force: bool = False) -> None:
    """Check, before computing, that ``path`` can be written (rank 0 checks; same error everywhere).

    Raises
    ------
    FileNotFoundError
        The directory does not exist.
    PermissionError
        No file can be created in the directory.
    FileExistsError
        ``path`` exists and ``force`` is False.
    IsADirectoryError
        ``path`` is a directory.
    """
    c = get_comm(comm)
    on_rank0(c, lambda: _output_problem(os.path.abspath(path), force))


def _remove(path: str | None) -> None:
    if path is not None and os.path.lexists(path):
        os.remove(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str) -> str:
    """A fresh temporary name ``.NAME.mpiattn-XXXX.tmp`` beside ``path`` (local: no communication)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.mpiattn-{uuid.uuid4().hex[:10]}.tmp")


def write_atomically(c: Comm, path: str, write: Callable[[str], None], *, force: bool = False) -> None:
    """Run the collective ``write(tmp)``, then publish ``tmp`` as ``path`` (collective).

    Parameters
    ----------
    c : Comm
    path : str
        The final name (absolute or relative).
    write : callable(tmp)
        Writes the whole file under the temporary name ``tmp`` (the same on
        every rank); called on every rank. It must raise the same exception
        on every rank or none (or abort the job).
    force : bool
        Replace an existing ``path``.

    Raises
    ------
    Exception
        Whatever ``write`` raised, or the publishing error, on every rank;
        ``path`` is then unchanged and the temporary file removed.
    """
    path = os.path.abspath(path)
    check_output(path, c, force=force)
    tmp = c.bcast_obj(temp_path(path)) if c.size > 1 else temp_path(path)

    def publish() -> None:
        if not force and os.path.lexists(path):
            raise FileExistsError(f"output {path} appeared while writing; not replaced")
        _fsync(tmp)
        os.replace(tmp, path)

    try:
        write(tmp)
        on_rank0(c, publish)
    except Exception:  # raised identically on every rank: clean up, then let everyone raise
        if c.rank == 0:
            _remove(tmp)
        c.barrier()  # nobody returns before the temporary file is gone
        raise
    except BaseException:
        if c.rank == 0:
            _remove(tmp)
        raise
