"""The outputs a program is making, and the veto of a signal that ends it.

An output goes through three states on every rank (:func:`mpiattn.io.atomic.write_atomically`
drives them):

``writing``
    its temporary (:class:`~mpiattn.io.temporaries.Temporary`) is reserved
    (rank 0) or adopted by name (the other ranks) and being written;
``committed``
    every rank has voted to publish it (a collective: the *commit point*);
``published`` or discarded
    rank 0 gave it its name (or failed to); every rank learns which.

:meth:`Outputs.stop` is what a signal handler calls, from any thread: from
that moment this process reserves, adopts, commits and publishes nothing
(the main thread blocks for good at its next such step, and the handler's
thread ends the process), every temporary still being written is removed,
and the outputs already committed are left to finish (a commit is a
promise made to the other ranks). Since a commit needs every rank's vote, a
rank that was stopped before voting keeps every rank from publishing. So a
signal received before the commit point leaves an existing output exactly
as it was; one received after it comes too late to matter: the output is
published, and :class:`Stopped` says so.

The CLI makes one :class:`Outputs` per run and hands it to every write; the
library makes a private one per call when given none (nothing can stop it
then). No process-wide state is kept here.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, NamedTuple

from .temporaries import Temporary

__all__ = ["Outputs", "Stopped", "park"]


def park() -> None:
    """Block the calling thread for good: the process is being ended by another thread."""
    threading.Event().wait()


class Stopped(NamedTuple):
    """What :meth:`Outputs.stop` did.

    Attributes
    ----------
    removed : list of str
        Temporaries (directories) removed, unpublished.
    published : list of str
        Outputs this program published, before the stop or, already
        committed, while it waited.
    pending : list of str
        Committed outputs whose publication did not settle in time.
    """

    removed: list
    published: list
    pending: list


class Outputs:
    """The outputs one program is making on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writing: dict[str, Temporary] = {}
        self._committed: dict[str, Temporary] = {}
        self._published: list[str] = []
        self._removed: list[str] = []
        self._stopped: str | None = None

    @property
    def stopped(self) -> str | None:
        """Why :meth:`stop` was called (e.g. ``"SIGTERM"``), or None."""
        return self._stopped

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """A step of the main thread that creates or publishes: never once stopped."""
        self._cond.acquire()
        if self._stopped is not None:
            self._cond.release()
            park()
        try:
            yield
        finally:
            self._cond.release()

    def reserve(self, target: str) -> Temporary:
        """Reserve and lock a temporary beside ``target`` (the writer, rank 0)."""
        with self._step():
            tmp = Temporary.reserve(target)
            self._writing[tmp.dir] = tmp
            return tmp

    def adopt(self, directory: str) -> Temporary:
        """Take note of the temporary ``directory`` rank 0 reserved (the other ranks).

        Once stopped, this rank removes it instead (so that nothing is left
        when rank 0, not signalled itself, is ended by this rank's abort),
        and blocks.
        """
        with self._cond:
            tmp = self._writing[directory] = Temporary(directory)
            stopped = self._stopped is not None
        if stopped:
            self.remove_all()
            park()
        return tmp

    def commit(self, tmp: Temporary) -> None:
        """This rank's vote to publish ``tmp`` (call it inside a collective agreement)."""
        with self._step():
            self._committed[tmp.dir] = self._writing.pop(tmp.dir)

    def publish(self, tmp: Temporary, path: str, *, replace: bool) -> None:
        """Give the committed ``tmp`` the name ``path`` (rank 0; see :meth:`Temporary.publish`)."""
        with self._cond:
            tmp.publish(path, replace=replace)

    def settle(self, tmp: Temporary, path: str) -> None:
        """Every rank, once all know that ``tmp`` was published as ``path``."""
        with self._cond:
            self._writing.pop(tmp.dir, None)
            self._committed.pop(tmp.dir, None)
            self._published.append(path)
            self._cond.notify_all()

    def discard(self, tmp: Temporary, remove: bool) -> None:
        """Forget ``tmp`` after a failure, removing its files with ``remove``."""
        with self._cond:
            self._writing.pop(tmp.dir, None)
            self._committed.pop(tmp.dir, None)
            self._cond.notify_all()
        if remove:
            tmp.remove()

    def active(self) -> frozenset:
        """The temporaries this rank is writing or publishing now."""
        with self._cond:
            return frozenset(self._writing) | frozenset(self._committed)

    def remove_all(self) -> list[str]:
        """Remove every temporary being written (for an emergency abort; never raises).

        Returns those now gone (another rank may have removed one first);
        :attr:`removed` lists every one removed so far.
        """
        with self._cond:
            pending = list(self._writing.values())
            self._writing.clear()
        gone = []
        for tmp in pending:
            try:
                tmp.remove()
            except OSError:
                pass
            if not os.path.lexists(tmp.dir):
                gone.append(tmp.dir)
        with self._cond:
            self._removed += gone
        return gone

    @property
    def removed(self) -> list[str]:
        """Every temporary :meth:`remove_all` (or a stopped :meth:`adopt`) removed."""
        with self._cond:
            return list(self._removed)

    def stop(self, reason: str, wait_s: float = 10.0) -> Stopped:
        """Veto every further step and remove the unpublished temporaries (any thread, never raises).

        Outputs already committed are given up to ``wait_s`` seconds to be
        published (or to fail) by the main thread.
        """
        with self._cond:
            if self._stopped is None:
                self._stopped = reason
        self.remove_all()
        with self._cond:
            self._cond.wait_for(lambda: not self._committed, timeout=wait_s)
            return Stopped(list(self._removed), list(self._published), sorted(self._committed))
