"""Giving finished files their names: never over another file, over any, or over the one that was read.

A finished file (the ``data`` file of a :class:`~mpiattn.io.temporaries.Temporary`)
becomes its target in one of three ways, a :class:`Rule` each:

``NEW``
    an atomic no-clobber: ``os.link`` (fails if the name exists, whoever
    made it, however late), else ``renameat2(RENAME_NOREPLACE)``;
``REPLACE``
    an atomic ``os.replace``: an existing file is swapped in one step;
``Rule.grows(identity)``
    ``os.replace`` only while the target is still the very file this run
    read (``(device, inode, size, mtime_ns)``, :func:`identity_of`): what
    ``decode --append`` does to its cache, so that of two runs growing one
    file at once the second is refused instead of losing the first's rows.

:func:`publish_together` names several files at once (an output and the
cache it was computed from): it holds an ``flock`` on each target's
directory (never on a file HDF5 may lock itself) while it checks every
target and renames, so two mpiattn runs cannot interleave a check and a
rename; it names the no-clobber files first and removes them again if a
later one fails, so the group is published whole or not at all (a crash
between two renames excepted). A replaced file's permission bits go to its
successor.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["Rule", "NEW", "REPLACE", "identity_of", "publish_file", "publish_together",
           "check_target", "ChangedError", "LOCK_WAIT_S"]

#: ``renameat2`` flag: fail with EEXIST when the target exists (Linux >= 3.15).
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
#: Seconds :func:`publish_together` waits for another run's lock on a directory.
LOCK_WAIT_S = 60.0
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


@dataclass(frozen=True)
class Rule:
    """How a finished file takes its name (see the module docstring).

    Attributes
    ----------
    replace : bool
        An existing target may be replaced.
    identity : tuple or None
        Replace only this file ``(device, inode, size, mtime_ns)``; it must exist.
    """

    replace: bool
    identity: tuple | None = None

    @classmethod
    def grows(cls, identity: Sequence[int]) -> "Rule":
        """Replace the target only while it is still the file of ``identity``."""
        return cls(True, tuple(int(x) for x in identity))


NEW = Rule(False)
REPLACE = Rule(True)


class ChangedError(OSError):
    """The file a run would replace is no longer the one it read (another run replaced it)."""


def identity_of(path: str) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of ``path`` (following links)."""
    st = os.stat(path)
    return (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))


def check_target(path: str, rule: Rule) -> None:
    """Raise when ``rule`` cannot name a file ``path`` now (local; the existence rules only).

    Raises
    ------
    FileExistsError
        ``path`` exists and the rule replaces nothing (``filename`` is ``path``).
    ChangedError
        The rule grows a file that is gone or is another file now.
    PermissionError
        The rule grows a file that is read-only (no write permission bit).
    """
    if rule.identity is None:
        if not rule.replace and os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "already exists", path)
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ChangedError(errno.ENOENT, f"{path} was removed while this run was using it; "
                           "nothing was written") from None
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(errno.EACCES, f"{path} is read-only (mode {stat.S_IMODE(st.st_mode):o}):"
                              " not replaced; make it writable (chmod u+w) to grow it")
    now = (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))
    if now != rule.identity:
        how = "replaced by another file" if now[:2] != rule.identity[:2] else "modified"
        raise ChangedError(errno.ESTALE, f"{path} was {how} while this run was using it (another "
                           "run appending to it at the same time?); this run's result was not "
                           "published, and the file is left as the other writer made it: run again")


def publish_file(src: str, dst: str, *, replace: bool) -> None:
    """Give the complete file ``src`` the name ``dst`` atomically (same directory).

    ``replace``: ``os.replace`` (an existing ``dst`` is swapped in one step).
    Otherwise an atomic no-replace: ``os.link`` (fails with EEXIST if ``dst``
    exists, whoever made it, however late), then ``src`` is unlinked; where
    the file system has no hard links, ``renameat2(RENAME_NOREPLACE)``.

    Raises
    ------
    FileExistsError
        ``dst`` exists and ``replace`` is False.
    OSError
        The file system offers neither primitive (then nothing is renamed).
    """
    if replace:
        os.replace(src, dst)
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK,
                             errno.EACCES, errno.EXDEV):
            raise
        _rename_noreplace(src, dst, exc)
        return
    try:
        os.remove(src)
    except FileNotFoundError:
        pass


def _rename_noreplace(src: str, dst: str, cause: OSError) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), dst)
    raise OSError(errno.EOPNOTSUPP,
                  f"cannot publish {dst} without the risk of replacing a file that appears at "
                  f"the same moment: this file system has neither hard links "
                  f"({cause.strerror}) nor renameat2(RENAME_NOREPLACE); pass --force "
                  "(force=True) to replace atomically instead")


@contextlib.contextmanager
def _locked_dirs(dirs: Sequence[str], wait_s: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on each directory (in sorted order: no deadlock between runs).

    Where a file system has no locks on directories (NFS), nothing is held:
    the identity checks then narrow the race to the moment between a check
    and its rename.
    """
    fds: list[int] = []
    try:
        for d in sorted(set(dirs)):
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            if fcntl is None:
                continue
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(errno.ETIMEDOUT, f"another mpiattn run has held the lock "
                                           f"of {d} for {wait_s:g} s while publishing its output; "
                                           "nothing was published") from None
                    time.sleep(0.01)
                except OSError as exc:
                    if exc.errno in _NO_LOCKS:
                        break
                    raise
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (closing releases the lock)


def publish_together(items: Sequence[tuple[str, str, Rule]], wait_s: float = LOCK_WAIT_S) -> None:
    """Name finished files ``(src, dst, rule)`` all together, or none of them (local, rank 0).

    Under the directories' locks: every target is checked
    (:func:`check_target`), the no-clobber ones are named first, then the
    replacements; a failure removes the files this call named and raises.
    A replaced file's permission bits are given to its successor.

    Raises
    ------
    FileExistsError, ChangedError, PermissionError, TimeoutError, OSError
        Nothing was published (a replacement that failed after another
        replacement succeeded excepted: give a group at most one).
    """
    order = sorted(items, key=lambda it: it[2].replace)  # no-clobber first: they can be undone
    with _locked_dirs([os.path.dirname(dst) or "." for _, dst, _ in order], wait_s):
        for _, dst, rule in order:
            check_target(dst, rule)
        named: list[tuple[str, int]] = []
        try:
            for src, dst, rule in order:
                if rule.replace and os.path.exists(dst):
                    os.chmod(src, stat.S_IMODE(os.stat(dst).st_mode))
                ino = os.stat(src).st_ino
                try:
                    publish_file(src, dst, replace=rule.replace)
                except FileExistsError:
                    raise FileExistsError(errno.EEXIST, "already exists", dst) from None
                if not rule.replace:
                    named.append((dst, ino))
        except BaseException:
            for dst, ino in named:
                with contextlib.suppress(OSError):
                    if os.stat(dst).st_ino == ino:
                        os.remove(dst)
            raise
