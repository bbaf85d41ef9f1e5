"""The outputs a program is making, and the veto of a signal that ends it.

An output goes through four states on every rank (:func:`mpiattn.io.atomic.publish`
drives them; several files of one group move together):

``writing``
    its temporary (:class:`~mpiattn.io.temporaries.Temporary`) is reserved
    (rank 0, the *owner*) or adopted by name (the other ranks) and being
    written;
``voting``
    this rank has voted to publish it, inside a collective agreement whose
    outcome it does not know yet;
``committed``
    this rank has learnt that every rank voted (the agreement returned);
``published`` or discarded
    the owner gave it its name (or failed to); every rank learns which.

Only the owner publishes, so the owner's view decides: the *commit point*
is the moment the owner learns that every rank voted. :meth:`Outputs.stop`
is what a signal handler calls, from any thread: from then on this process
reserves, adopts, votes and publishes nothing (the main thread blocks for
good at its next such step, and the handler's thread ends the process), and
every temporary still being written is removed. The owner also *revokes* a
group it voted for but has not seen committed: it removes it, and its main
thread, when the agreement returns, blocks instead of publishing. So a
signal the owner handles before the commit point leaves every existing
file as it was (given a ``sync``, each rank handles the signals it has
received before it votes, and the owner again before it takes the votes as
committed: a signal that reached a process before those steps never comes
too late, however busy its main thread kept the handler's); one it handles after it comes too late to matter: the
group is published (the stop waits for it), and :class:`Stopped` says so.
A rank that is not the owner leaves what it voted for to the owner (it
reports it as ``undecided``), or, when the owner cannot answer, removes it
itself (:meth:`Outputs.give_up`) and reports what the target then is.

The CLI makes one :class:`Outputs` per run and hands it to every write; the
library makes a private one per call when given none (nothing can stop it
then). No process-wide state is kept here.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, NamedTuple, Sequence

from .naming import Rule, publish_together
from .temporaries import Temporary

__all__ = ["Outputs", "Stopped", "park"]


def park() -> None:
    """Block the calling thread for good: the process is being ended by another thread."""
    threading.Event().wait()


class Stopped(NamedTuple):
    """What :meth:`Outputs.stop` (or :meth:`Outputs.give_up`) did.

    Attributes
    ----------
    removed : list of str
        Temporaries (directories) removed, unpublished.
    published : list of str
        Outputs this program published, before the stop or, already
        committed, while it waited.
    pending : list of str
        Committed outputs whose publication did not settle in time.
    undecided : list of str
        Targets this rank voted for and left to the owner (not the owner).
    """

    removed: list
    published: list
    pending: list
    undecided: list = []


class Outputs:
    """The outputs one program is making on this rank (see the module docstring).

    Parameters
    ----------
    sync : callable, optional
        Called by the main thread, holding no lock, before it votes and (the
        owner) before it takes a group as committed; returns once every signal this process
        received so far has been handled (the CLI's
        :meth:`mpiattn.cli.signals.Guard.sync`).
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync
        self._cond = threading.Condition()
        self._writing: dict[str, Temporary] = {}
        self._voting: dict[str, tuple[Temporary, str, int | None]] = {}
        self._committed: dict[str, tuple[Temporary, str, int | None]] = {}
        self._revoked: set[str] = set()
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
        """Reserve and lock a temporary beside ``target`` (the owner, rank 0)."""
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

    def vote(self, group: Sequence[tuple[Temporary, str]]) -> None:
        """This rank's vote to publish ``group`` (``(tmp, target)`` pairs; call it inside the
        collective agreement that counts the votes). Never once stopped."""
        if self._sync is not None:
            self._sync()
        with self._step():
            for tmp, target in group:
                self._writing.pop(tmp.dir, None)
                try:
                    ino: int | None = os.stat(tmp.data).st_ino
                except OSError:
                    ino = None
                self._voting[tmp.dir] = (tmp, target, ino)

    def decided(self, group: Sequence[tuple[Temporary, str]]) -> None:
        """Every rank voted for ``group`` (the agreement returned): it is committed, unless the
        owner revoked it meanwhile (then this blocks for good: the stop's thread speaks). The
        owner handles its signals first (``sync``); another rank must not wait for its own
        handler here: that one may be waiting for the owner, which waits for this rank."""
        if self._sync is not None and any(tmp.owner for tmp, _ in group):
            self._sync()
        self._cond.acquire()
        if any(tmp.dir in self._revoked for tmp, _ in group):
            self._cond.release()
            park()
        try:
            for tmp, target in group:
                self._committed[tmp.dir] = self._voting.pop(tmp.dir, (tmp, target, None))
        finally:
            self._cond.release()

    def publish(self, items: Sequence[tuple[Temporary, str, Rule]]) -> None:
        """Name the committed files of a group together (the owner; :func:`publish_together`),
        then remove their temporaries. Raises as that does; nothing is then published."""
        with self._cond:
            publish_together([(tmp.data, path, rule) for tmp, path, rule in items])
            for tmp, _, _ in items:
                tmp.remove()

    def settle(self, group: Sequence[tuple[Temporary, str]]) -> None:
        """Every rank, once all know that ``group`` was published."""
        with self._cond:
            for tmp, path in group:
                self._writing.pop(tmp.dir, None)
                self._voting.pop(tmp.dir, None)
                self._committed.pop(tmp.dir, None)
                self._published.append(path)
            self._cond.notify_all()

    def discard(self, tmp: Temporary, remove: bool) -> None:
        """Forget ``tmp`` after a failure, removing its files with ``remove``."""
        with self._cond:
            self._writing.pop(tmp.dir, None)
            self._voting.pop(tmp.dir, None)
            self._committed.pop(tmp.dir, None)
            self._cond.notify_all()
        if remove:
            tmp.remove()

    def active(self) -> frozenset:
        """The temporaries this rank is writing or publishing now."""
        with self._cond:
            return frozenset(self._writing) | frozenset(self._voting) | frozenset(self._committed)

    def _remove(self, tmps: Sequence[Temporary]) -> list[str]:
        """Remove temporaries (never raises); those now gone are added to :attr:`removed`."""
        gone = []
        for tmp in tmps:
            try:
                tmp.remove()
            except OSError:
                pass
            if not os.path.lexists(tmp.dir):
                gone.append(tmp.dir)
        with self._cond:
            self._removed += gone
        return gone

    def remove_all(self) -> list[str]:
        """Remove every temporary being written (for an emergency abort; never raises).

        Returns those now gone (another rank may have removed one first);
        :attr:`removed` lists every one removed so far.
        """
        with self._cond:
            pending = list(self._writing.values())
            self._writing.clear()
        return self._remove(pending)

    @property
    def published(self) -> list[str]:
        """Every output this program published (every rank learns it)."""
        with self._cond:
            return list(self._published)

    @property
    def removed(self) -> list[str]:
        """Every temporary removed so far (:meth:`remove_all`, a stopped :meth:`adopt`, a stop)."""
        with self._cond:
            return list(self._removed)

    def stop(self, reason: str, wait_s: float = 10.0) -> Stopped:
        """Veto every further step and remove the unpublished temporaries (any thread, never raises).

        The owner also revokes what it voted for and has not seen committed;
        outputs already committed are given up to ``wait_s`` seconds to be
        published (or to fail) by the main thread. Another rank leaves what
        it voted for to the owner (``undecided``).
        """
        with self._cond:
            if self._stopped is None:
                self._stopped = reason
            revoke = [tmp for tmp, _, _ in self._voting.values() if tmp.owner]
            for tmp in revoke:
                del self._voting[tmp.dir]
                self._revoked.add(tmp.dir)
        self.remove_all()
        self._remove(revoke)
        with self._cond:
            self._cond.wait_for(lambda: not self._committed, timeout=wait_s)
            return Stopped(list(self._removed), list(self._published), sorted(self._committed),
                           sorted(target for _, target, _ in self._voting.values()))

    def give_up(self) -> tuple[list[str], list[str]]:
        """Remove what this rank voted for or saw committed, when the owner cannot decide.

        For a stopped rank whose owner does not answer. Returns
        ``(removed, published)``: the temporaries now gone unpublished, and
        the targets that the owner had already named (the target is the
        file this rank saw voted for, complete).
        """
        with self._cond:
            left = list(self._voting.values()) + list(self._committed.values())
            self._voting.clear()
        removed, published = [], []
        for tmp, target, ino in left:
            with contextlib.suppress(OSError):
                tmp.remove()  # from now on the owner cannot name it any more: what is, stays
            try:
                if ino is not None and os.stat(target).st_ino == ino:
                    published.append(target)
                    continue
            except OSError:
                pass
            removed.append(tmp.dir)
        with self._cond:
            self._removed += removed
        return removed, published
