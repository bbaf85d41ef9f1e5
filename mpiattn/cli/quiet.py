"""Hushing what h5py reports about the objects of a file whose write failed (the command line only).

After a failed HDF5 write (a full disk) the broken file's objects cannot be
released: each release retries the write, fails, and h5py reports the error
with a traceback through ``sys.unraisablehook`` (``sys.excepthook`` at
exit), one per object, burying the run's one error message. The library
leaves Python's hooks alone; the command line, which owns its process,
replaces them for the duration of a run with filters that drop exactly
these reports and pass everything else on, and restores them afterwards.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["QuietReleases"]


def _from_broken_file(exc: BaseException | None, where: str) -> bool:
    """An h5py report that an object of a file whose write failed cannot be released
    (a RuntimeError in h5py 3.8-3.12, an OSError with ``errno`` 28 in 3.16)."""
    return "ObjectID" in where and isinstance(exc, (RuntimeError, OSError)) and \
        "write failed" in str(exc)


class QuietReleases:
    """Within the block, h5py's release reports of broken files are dropped; the hooks come back after."""

    def __enter__(self) -> "QuietReleases":
        self._unraisable, self._except = sys.unraisablehook, sys.excepthook
        sys.unraisablehook, sys.excepthook = self._hush_unraisable, self._hush_except
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.unraisablehook, sys.excepthook = self._unraisable, self._except

    def _hush_unraisable(self, unraisable: Any) -> None:
        where = getattr(unraisable.object, "__qualname__", "") or repr(unraisable.object)
        if not _from_broken_file(unraisable.exc_value, where):
            self._unraisable(unraisable)

    def _hush_except(self, kind: type, value: BaseException, tb: types.TracebackType | None) -> None:
        where, last = "", tb
        while last is not None:
            where = f"{last.tb_frame.f_code.co_filename}:{last.tb_frame.f_code.co_name}"
            last = last.tb_next
        if not _from_broken_file(value, "ObjectID" if "_objects.pyx" in where else where):
            self._except(kind, value, tb)
