"""Temporary outputs that name their writer: reserved, locked, removable after a crash.

An output ``NAME`` is written inside a private temporary directory beside it,
``.NAME.mpiattn-XXXXXXXXXX.tmp/``, which holds two files:

``lock``
    created and locked (``fcntl.flock``, exclusive) by the writer (rank 0)
    before anything else, and kept locked until the directory is gone;
``data``
    the file being written, published as ``NAME`` when complete
    (:mod:`mpiattn.io.publishing`).

Why a directory: once it is removed, nothing can be created inside it any
more (``open(O_CREAT)`` of ``DIR/data`` fails with ENOENT), so a rank that
goes on writing after a signal handler (possibly another rank's) removed
the temporary cannot bring it back. Why a separate lock file: HDF5 takes its
own ``flock`` on the files it opens, and MPI-IO (ROMIO on NFS) takes
``fcntl`` byte-range locks on the data file; a lock of ours there would
collide with either.

The kernel drops the lock when the writer dies, however it dies (SIGKILL,
out of memory, node reboot), so a later run can tell the temporaries of
dead writers (lock free) from those of live ones (lock held) and remove
only the former (:func:`remove_stale`). A writer creates the directory and
the lock file, locks it, then checks that the name still refers to the file
it locked (a cleaner may have removed it in between; the writer then starts
over with a new name), so a name that matches is never removed while its
writer lives. Where the file system has no locks (some Lustre/GPFS mounts)
nothing is locked, and the cleaner, which cannot tell, keeps everything.

Temporaries of an older mpiattn (a data file ``.NAME.mpiattn-X.tmp`` with a
lock file ``.NAME.mpiattn-X.tmp.lock`` beside it) are recognised and
cleaned the same way.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import time
import uuid
from typing import NamedTuple

from .naming import publish_file

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["Temporary", "Stale", "remove_stale", "temporary_name"]

#: ``.NAME.mpiattn-XXXXXXXXXX.tmp`` (a directory; an older mpiattn: a data file, with
#: ``... .tmp.lock`` beside it).
_PATTERN = re.compile(r"\..+\.mpiattn-[0-9a-f]{10}\.tmp(\.lock)?")
#: The probe files of :func:`mpiattn.io.atomic.check_output` (live for microseconds).
_PROBE = re.compile(r"\.mpiattn-probe-[0-9a-f]{12}")
#: A data file of an mpiattn older than the locks, with no lock file, counts as
#: abandoned only once it has not been modified for this long.
ORPHAN_AGE_S = 600.0
#: A temporary directory with no lock file (its writer creates the lock right after
#: the directory, microseconds later; a removal cut short on NFS, where a file still
#: open is renamed ``.nfsXXXX``) counts as abandoned after this long.
LOCKLESS_DIR_AGE_S = 60.0
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def temporary_name(path: str) -> str:
    """A fresh temporary name ``.NAME.mpiattn-XXXXXXXXXX.tmp`` beside ``path`` (nothing is made)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.mpiattn-{uuid.uuid4().hex[:10]}.tmp")


def _lock(fd: int, block: bool) -> bool | None:
    """flock ``fd`` exclusively: True, False (held by another), None (no locks here)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
    return True


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlink(path: str) -> bool:
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def _remove_tree(directory: str) -> bool:
    """Remove a temporary directory and what is in it (flat); True when it existed.

    Retries while something appears inside meanwhile (a rank creating its
    data file at that moment): once the directory is gone, nothing can be
    created in it any more.
    """
    existed = False
    for _ in range(100):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return existed
        existed = True
        for n in names:
            try:
                _unlink(os.path.join(directory, n))
            except IsADirectoryError:  # pragma: no cover - never made by mpiattn
                pass
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            time.sleep(0.001)
    return existed  # pragma: no cover - NFS: an open file renamed .nfsXXXX keeps it until closed


class Temporary:
    """A temporary directory beside a target, reserved by a lock held by its owner.

    Parameters
    ----------
    dir : str
        Absolute path of the temporary directory (it need not exist yet).
    fd : int, optional
        The open, locked lock file (the owner only; other ranks pass None).
    """

    def __init__(self, dir: str, fd: int | None = None):
        self.dir, self.fd = dir, fd
        #: Reserved by this process (it holds the lock and publishes); False where adopted.
        self.owner = fd is not None

    @property
    def data(self) -> str:
        """Path of the data file, published as the target."""
        return os.path.join(self.dir, "data")

    @property
    def lock(self) -> str:
        """Path of the lock file."""
        return os.path.join(self.dir, "lock")

    @classmethod
    def reserve(cls, target: str) -> "Temporary":
        """Create the directory and its locked lock file for a fresh name beside ``target`` (local).

        Raises
        ------
        OSError
            The directory or the lock file cannot be created.
        """
        for _ in range(100):
            tmp = cls(temporary_name(target))
            os.mkdir(tmp.dir)
            try:
                fd = os.open(tmp.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                continue  # a cleaner removed the fresh directory: new name
            except BaseException:
                _remove_tree(tmp.dir)
                raise
            try:
                locked = _lock(fd, block=True)  # waits while a cleaner inspects it
                if locked is not None and not _same_file(tmp.lock, fd):
                    os.close(fd)  # a cleaner removed it before we held the lock: new name
                    continue
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            except BaseException:
                os.close(fd)
                _remove_tree(tmp.dir)
                raise
            tmp.fd, tmp.owner = fd, True
            return tmp
        raise OSError(f"cannot reserve a temporary file beside {target}")  # pragma: no cover

    def remove(self) -> bool:
        """Remove the directory with its data and lock files (any rank); True when it existed."""
        try:
            return _remove_tree(self.dir)
        finally:
            self.close()

    def publish(self, path: str, *, replace: bool) -> None:
        """Publish the data file as ``path`` (:func:`mpiattn.io.naming.publish_file`), then remove
        the rest (the owner)."""
        publish_file(self.data, path, replace=replace)
        self.remove()

    def close(self) -> None:
        """Close the lock file, which releases the lock (the owner)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


# ------------------------------------------------------------- temporaries of dead writers
class Stale(NamedTuple):
    """What :func:`remove_stale` found.

    Attributes
    ----------
    removed : list of (str, int)
        Temporaries of dead writers that were removed, with the sizes of
        their data in bytes.
    kept : list of (str, str)
        Temporaries left alone, with the reason (a live writer holds the
        lock, or this file system cannot tell).
    """

    removed: list
    kept: list


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _age(path: str) -> float | None:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _inspect(name: str, lock: str, data: str, remove, removed: list, kept: list,
             age_limit: float) -> None:
    """Remove the temporary ``name`` (``remove()``) when its writer is dead; else say why not."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        age = _age(name)
        if age is None:
            return
        if age >= age_limit:
            size = _size(data)
            if remove():
                removed.append((name, size))
        else:
            kept.append((name, "no lock file (being created, or an older mpiattn?); removed "
                               f"once unchanged for {age_limit / 60:.0f} minute(s)"))
        return
    try:
        locked = _lock(fd, block=False)
        if locked is False:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
            kept.append((name, f"its writer is alive ({owner or 'lock held'})"))
        elif locked is None:
            kept.append((name, "this file system has no file locks: cannot tell whether its "
                               "writer is alive"))
        elif _same_file(lock, fd):  # we hold the lock of a dead writer
            size = _size(data)
            if remove():
                removed.append((name, size))
    finally:
        os.close(fd)


def remove_stale(directory: str, keep: frozenset = frozenset()) -> Stale:
    """Remove the temporaries of dead mpiattn writers in ``directory`` (local; never a live one's).

    A temporary counts as dead when its lock file exists and nobody holds
    its lock; one with no lock file when it has not changed for
    :data:`LOCKLESS_DIR_AGE_S` seconds (an older mpiattn's data file:
    :data:`ORPHAN_AGE_S`). Probe files older than a minute go too.

    Parameters
    ----------
    directory : str
    keep : set of str
        Temporary paths this process is writing (on NFS ``flock`` is a POSIX
        lock, which never stops its own process).

    Returns
    -------
    Stale

    Raises
    ------
    FileNotFoundError
        ``directory`` is not a directory.
    """
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory")
    names = os.listdir(directory)
    removed: list = []
    kept: list = []
    found = sorted({os.path.join(directory, n[:-5] if n.endswith(".lock") else n)
                    for n in names if _PATTERN.fullmatch(n)})
    for name in found:
        if name in keep:
            kept.append((name, "this process is writing it"))
            continue
        try:
            if os.path.isdir(name):
                tmp = Temporary(name)
                _inspect(name, tmp.lock, tmp.data, lambda t=tmp: _remove_tree(t.dir), removed, kept,
                         LOCKLESS_DIR_AGE_S)
            else:  # an older mpiattn's data file, its lock file beside it
                _inspect(name, name + ".lock", name,
                         lambda n=name: (_unlink(n), _unlink(n + ".lock"))[0], removed, kept,
                         ORPHAN_AGE_S)
        except OSError as exc:
            kept.append((name, f"cannot inspect it: {exc.strerror or exc}"))
    now = time.time()
    for n in names:
        if _PROBE.fullmatch(n):
            path = os.path.join(directory, n)
            try:
                if now - os.stat(path).st_mtime > 60:
                    _unlink(path)
            except OSError:
                pass
    return Stale(removed, kept)
