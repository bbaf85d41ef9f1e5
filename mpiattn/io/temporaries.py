"""Temporary files that name their writer: reserved, locked, removable after a crash.

An output is written under a temporary name ``.NAME.mpiattn-XXXXXXXXXX.tmp``
beside ``NAME`` (:mod:`mpiattn.io.atomic`). Its writer (rank 0) first creates
and locks ``.NAME.mpiattn-XXXXXXXXXX.tmp.lock`` (``fcntl.flock``, exclusive)
and keeps the lock until the data file has been renamed or removed; then it
removes the lock file. The kernel drops the lock when the writer dies,
however it dies (SIGKILL, out of memory, node reboot), so a later run can
tell the temporaries of dead writers (lock file present, lock free) from
those of live ones (lock held) and remove only the former
(:func:`remove_stale`).

Why a separate lock file rather than a lock on the data file: HDF5 takes its
own ``flock`` on the files it opens, and MPI-IO (ROMIO on NFS) takes
``fcntl`` byte-range locks on the data file; a lock of ours there would
collide with either.

A writer creates the lock file, locks it, then checks that the name still
refers to the file it locked (a cleaner may have removed it in between;
the writer then starts over with a new name), so a name that matches is
never removed while its writer lives. Where the file system has no locks
(some Lustre/GPFS mounts) nothing is locked, and the cleaner, which cannot
tell, keeps everything.

Every process also keeps a registry of the temporaries it is writing, with
no communication involved, so that a signal handler or an emergency abort
can remove them (:func:`remove_registered`); the command line installs
such handlers, the library installs none.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
import uuid
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from ..comm import errors

__all__ = ["Temporary", "Stale", "register", "unregister", "registered", "remove_registered",
           "remove_stale", "temporary_name"]

#: ``.NAME.mpiattn-XXXXXXXXXX.tmp`` (data) and ``... .tmp.lock`` (its writer's lock).
_PATTERN = re.compile(r"\..+\.mpiattn-[0-9a-f]{10}\.tmp(\.lock)?")
#: The probe files of :func:`mpiattn.io.atomic.check_output` (live for microseconds).
_PROBE = re.compile(r"\.mpiattn-probe-[0-9a-f]{12}")
#: A data file without a lock file (from an mpiattn older than the locks) counts as
#: abandoned only once it has not been modified for this long.
ORPHAN_AGE_S = 600.0
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def temporary_name(path: str) -> str:
    """A fresh temporary name ``.NAME.mpiattn-XXXXXXXXXX.tmp`` beside ``path`` (no file is made)."""
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


class Temporary:
    """A temporary file name beside a target, reserved by a lock held by its owner.

    Parameters
    ----------
    data : str
        Absolute path of the temporary data file (it need not exist yet).
    fd : int, optional
        The open, locked lock file (the owner only; other ranks pass None).
    """

    def __init__(self, data: str, fd: int | None = None):
        self.data, self.fd = data, fd

    @property
    def lock(self) -> str:
        """Path of the lock file."""
        return self.data + ".lock"

    @classmethod
    def reserve(cls, target: str) -> "Temporary":
        """Create and lock a lock file for a fresh temporary name beside ``target`` (local).

        Raises
        ------
        OSError
            The lock file cannot be created.
        """
        for _ in range(100):
            tmp = cls(temporary_name(target))
            fd = os.open(tmp.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                locked = _lock(fd, block=True)  # waits while a cleaner inspects it
                if locked is not None and not _same_file(tmp.lock, fd):
                    os.close(fd)  # a cleaner removed it before we held the lock: new name
                    continue
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            except BaseException:
                os.close(fd)
                _unlink(tmp.lock)
                raise
            tmp.fd = fd
            return tmp
        raise OSError(f"cannot reserve a temporary file beside {target}")  # pragma: no cover

    def remove(self) -> list[str]:
        """Remove the data file and the lock file (the lock last); returns what was removed."""
        gone = [p for p in (self.data, self.lock) if _unlink(p)]
        self.close()
        return gone

    def publish(self, path: str) -> None:
        """Rename the data file to ``path`` (atomic), then drop the lock (the owner)."""
        os.replace(self.data, path)
        _unlink(self.lock)
        self.close()

    def close(self) -> None:
        """Close the lock file, which releases the lock (the owner)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


# ------------------------------------------------------------- this process's temporaries
_REGISTRY: dict[int, Temporary] = {}
_REGISTRY_LOCK = threading.Lock()


def register(tmp: Temporary) -> None:
    """Note that this process is writing ``tmp`` (for :func:`remove_registered`)."""
    with _REGISTRY_LOCK:
        _REGISTRY[id(tmp)] = tmp


def unregister(tmp: Temporary) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(id(tmp), None)


def registered() -> list[str]:
    """The data files of the temporaries this process is writing now."""
    with _REGISTRY_LOCK:
        return [tmp.data for tmp in _REGISTRY.values()]


def remove_registered() -> list[str]:
    """Remove every temporary file this process is writing; returns the removed paths.

    For signal handlers and emergency exits: no communication, safe from any
    thread, never raises. Any rank may call it (every rank knows the names).
    """
    with _REGISTRY_LOCK:
        pending = list(_REGISTRY.values())
        _REGISTRY.clear()
    removed: list[str] = []
    for tmp in pending:
        try:
            removed += [p for p in (tmp.data, tmp.lock) if _unlink(p)]
        except OSError:
            pass
    return removed


errors.at_abort(remove_registered)  # a rank that aborts the job removes them first


# ------------------------------------------------------------- temporaries of dead writers
class Stale(NamedTuple):
    """What :func:`remove_stale` found.

    Attributes
    ----------
    removed : list of (str, int)
        Data files of dead writers that were removed, with their sizes in
        bytes (lock files and old probes are removed too, not listed).
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


def _inspect(data: str, removed: list, kept: list) -> None:
    lock = data + ".lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        try:
            age = time.time() - os.stat(data).st_mtime
        except FileNotFoundError:
            return
        if age >= ORPHAN_AGE_S:
            size = _size(data)
            if _unlink(data):
                removed.append((data, size))
        else:
            kept.append((data, "no lock file (an older mpiattn?); removed once unchanged for "
                               f"{ORPHAN_AGE_S / 60:.0f} minutes"))
        return
    try:
        locked = _lock(fd, block=False)
        if locked is False:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
            kept.append((data, f"its writer is alive ({owner or 'lock held'})"))
        elif locked is None:
            kept.append((data, "this file system has no file locks: cannot tell whether its "
                               "writer is alive"))
        elif _same_file(lock, fd):  # we hold the lock of a dead writer
            size = _size(data)
            if _unlink(data):
                removed.append((data, size))
            _unlink(lock)
    finally:
        os.close(fd)


def remove_stale(directory: str) -> Stale:
    """Remove the temporaries of dead mpiattn writers in ``directory`` (local; never a live one's).

    A temporary counts as dead when its lock file exists and nobody holds
    its lock; a data file with no lock file when it has not changed for
    :data:`ORPHAN_AGE_S` seconds. Probe files older than a minute go too.

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
    data_files = sorted({os.path.join(directory, n[:-5] if n.endswith(".lock") else n)
                         for n in names if _PATTERN.fullmatch(n)})
    own = set(registered())  # (on NFS, flock is a POSIX lock: our own would not stop us)
    for data in data_files:
        if data in own:
            kept.append((data, "this process is writing it"))
            continue
        try:
            _inspect(data, removed, kept)
        except OSError as exc:
            kept.append((data, f"cannot inspect it: {exc.strerror or exc}"))
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
