"""A watchdog for lost ranks: heartbeats between ranks, and an abort when one falls silent.

MPI waits for ever for a message that cannot come. When the network
between two hosts goes down in the middle of a ring step, every rank blocks
in its wait: TCP keeps retransmitting for many minutes, and the launcher's
own connections to the far host are cut too, so it notices nothing and an
``MPI_Abort`` on the far side reaches nobody. Measured on two hosts made
by ``jobs/two_hosts.sh`` (pip's MPICH 5.0.2 over TCP, 2026-12-02): with the
link down, no rank of either host ended in 40 s; once it came back up the
job went on.

:class:`Watchdog` makes that end: on every rank a thread sends a small
heartbeat to its peers every ``period`` seconds, on a communicator of its
own (a duplicate, so no message of the call can match them), and receives
theirs. The peers of rank ``r`` of ``P`` are ``r ± 1, r ± 2, r ± 4, ...``
(every other rank when ``P <= 4``; a silent rank is noticed by ``2 log2 P``
ranks, and their aborts reach the rest within as many hops). A rank that
has heard nothing from a peer for ``timeout`` seconds ends the job:

1. it runs the clean-ups registered on the Comm
   (:meth:`~mpiattn.comm.core.Comm.cleanup_on_abort`: the temporaries of the
   outputs being written are removed), writes one message naming the silent
   rank and its host, and calls ``MPI_Abort``
   (:func:`~mpiattn.comm.errors.abort_job`);
2. rank 0 speaks at once; any other rank waits
   :data:`~mpiattn.comm.errors.DEFER_S` seconds first, so that when rank 0
   notices too, its abort ends this rank silently and its message is the
   only one;
3. where ``MPI_Abort`` cannot reach the launcher (this rank is on the far
   side of the cut), the process ends itself :data:`ABORT_GRACE_S` seconds
   later.

So every rank is gone within about ``timeout + DEFER_S + ABORT_GRACE_S``
seconds of the cut.

What counts as word from a peer. The thread needs Python's lock (the GIL)
to send, and a rank's main thread may hold it while it *waits* in MPI:
mpi4py's pickle-based ``reduce`` and ``allreduce`` (mpiattn's collective
checks) duplicate their communicator the first time they run on it, a
collective ``MPI_Comm_dup`` made without releasing the lock. The first rank
there beats no more until the last one arrives: a rank merely waiting for a
slow peer. Measured (pip's MPICH 5.0.2, mpi4py 4.1.2, 2 ranks): a peer 1.5 s
late to such a call made a 1 s watchdog end a healthy job every time, as did
a rank 3 s late to ``run``'s first collective check. Hence:

* heartbeats are synchronous sends (``MPI_Issend``) into receives that each
  rank keeps posted for each peer (:data:`DEPTH` of them, posted before
  :meth:`Watchdog.start` returns on any rank). One completes
  once the peer's MPI library has matched it, which any of the peer's
  threads waiting in MPI brings about, its watchdog's or not: a heartbeat
  the peer took is word from it, as is each heartbeat it sends. While a
  peer's own heartbeats stay away, it gets one every ``timeout / 2``
  seconds, so its posted receives last ``DEPTH / 2`` timeouts of such a wait;
* silence is counted in the time this rank's thread was watching: of a
  pause of the thread itself (its own main thread held the lock, a loaded
  node), one ``period`` at most counts, so a peer paused at the same time
  (every rank loading the same extension module) is not blamed for it;
* a timeout under :data:`MIN_TIMEOUT_S` is refused.

A rank kept longer than ``timeout`` from both (its Python held *outside*
MPI by a C extension that keeps the lock) cannot be told from a stopped
one, and is taken for one: the timeout must exceed such pauses.

Starting and stopping are collective: :meth:`Watchdog.start` duplicates the
communicator; :meth:`Watchdog.stop` tells every peer that this rank stops
(a last message) and waits, still watching, until each peer has said the
same, so a rank that finishes early is never taken for a lost one. The
library starts no watchdog itself; the command line does with
``--watchdog SECONDS``, from before the command's first step until after
its output is published.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

import numpy as np

from . import errors

__all__ = ["Watchdog", "peers_of", "ABORT_GRACE_S", "EXIT_CODE", "DEPTH", "MIN_TIMEOUT_S"]

#: Seconds a rank gives ``MPI_Abort`` to end the job before it ends its own process.
ABORT_GRACE_S = 5.0

#: The exit code of a job the watchdog ends.
EXIT_CODE = 1

#: Receives each rank keeps posted for each peer's heartbeats.
DEPTH = 16

#: The shortest timeout accepted, in seconds.
MIN_TIMEOUT_S = 1.0

_BEAT, _BYE = 1, 2
_TAG = 7601


def peers_of(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` watches (and that watch it): ``rank ± 2^k`` modulo ``size``, itself excluded."""
    out, d = set(), 1
    while d < size:
        out.update(((rank + d) % size, (rank - d) % size))
        d *= 2
    out.discard(rank)
    return sorted(out)


class _Link:
    """This rank's watch on one peer (the watchdog's thread only).

    Parameters
    ----------
    mpi : mpi4py.MPI.Intracomm
        The watchdog's own communicator.
    peer : int
        The peer's rank in it.
    """

    def __init__(self, mpi: Any, peer: int) -> None:
        self.mpi, self.peer = mpi, peer
        self.slots = np.zeros(DEPTH, np.int32)
        self.posted = collections.deque(self._post(i) for i in range(DEPTH))  # in posting order
        self.sending: list = []  # our messages to the peer it has not matched yet
        self.quiet = 0.0  # seconds watched without word from the peer
        self.spoke = time.monotonic()  # when its last message came
        self.next_beat = 0.0
        self.done = False  # it said goodbye

    def _post(self, slot: int) -> tuple[int, Any]:
        return slot, self.mpi.Irecv(self.slots[slot:slot + 1], self.peer, _TAG)

    def receive(self, now: float) -> None:
        """Take the peer's messages that came, in their order; its goodbye ends the watch."""
        while not self.done and self.posted[0][1].Test():
            slot, _ = self.posted.popleft()
            self.quiet, self.spoke = 0.0, now
            if self.slots[slot] == _BYE:
                self._close()
            else:
                self.posted.append(self._post(slot))

    def _close(self) -> None:
        """The peer said goodbye: nothing more comes from it; the other receives are withdrawn."""
        self.done = True
        for _, request in self.posted:
            request.Cancel()
        for _, request in self.posted:
            request.Wait()
        self.posted.clear()

    def matched(self) -> None:
        """Drop our messages the peer's MPI has matched: each is word from it."""
        left = [request for request in self.sending if not request.Test()]
        if len(left) < len(self.sending):
            self.quiet = 0.0
        self.sending = left

    def send(self, message: np.ndarray) -> None:
        """A heartbeat or the goodbye: a synchronous send, complete once the peer matched it."""
        self.sending.append(self.mpi.Issend(message, self.peer, _TAG))

    def beat_due(self, now: float, period: float, timeout: float) -> bool:
        """Whether to send a heartbeat now (none in flight, its time come); schedules the next.

        Every ``period``; every ``timeout / 2`` while the peer's own heartbeats stay
        away (each of ours takes one of its posted receives).
        """
        if self.sending or now < self.next_beat:
            return False
        heard_lately = now - self.spoke <= 2 * period
        self.next_beat = now + (period if heard_lately else max(period, timeout / 2))
        return True

    @property
    def finished(self) -> bool:
        """The peer said goodbye and has matched all we sent it."""
        return self.done and not self.sending


class Watchdog:
    """Heartbeats between the ranks of a Comm; an abort when a peer falls silent (see the module).

    Parameters
    ----------
    comm : mpiattn.comm.core.Comm
        The ranks to watch; its clean-ups on abort run before an abort.
    timeout : float
        Seconds of silence from a peer after which the job is ended; at least
        :data:`MIN_TIMEOUT_S`.
    period : float, optional
        Seconds between heartbeats (default ``timeout / 5``, at most 1 s).

    Raises
    ------
    ValueError
        A timeout under :data:`MIN_TIMEOUT_S` (the same on every rank given the same one).
    """

    def __init__(self, comm: Any, timeout: float, period: float | None = None):
        with errors.alike():
            if not timeout > 0:
                raise ValueError(f"the watchdog's timeout must be > 0 seconds, got {timeout}")
            if timeout < MIN_TIMEOUT_S:
                raise ValueError(f"the watchdog's timeout must be at least {MIN_TIMEOUT_S:g} s "
                                 f"(shorter pauses of a rank are ordinary), got {timeout:g}")
        self.comm = comm
        self.timeout = float(timeout)
        self.period = float(period) if period else min(1.0, self.timeout / 5)
        self._mpi: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._hosts: list[str] = []

    # ------------------------------------------------------------- lifetime
    def start(self) -> "Watchdog":
        """Begin watching (collective on the Comm). One rank: nothing to watch."""
        from mpi4py import MPI

        if self.comm.size == 1:
            return self
        with errors.alike():
            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                raise RuntimeError("the watchdog needs MPI initialised with MPI_THREAD_MULTIPLE "
                                   "(mpi4py's default); this process has a lower thread level")
        self._mpi = self.comm.mpi.Dup()
        me = self._mpi.Get_rank()
        links = [_Link(self._mpi, p) for p in peers_of(me, self._mpi.Get_size())]
        # every rank's receives are posted once this returns: a rank that goes on at once into
        # a wait that holds Python's lock (its thread not yet run) still has its heartbeats taken
        self._hosts = self._mpi.allgather(MPI.Get_processor_name())
        self._thread = threading.Thread(target=self._run, args=(links,), name="mpiattn-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (collective): returns once every peer has stopped too."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None
        self._mpi.Free()
        self._mpi = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------- the thread
    def _run(self, links: list[_Link]) -> None:
        """The thread: watch; should the watching itself fail, end the job (the peers would
        otherwise take this rank for a lost one, with a misleading message)."""
        try:
            self._watch(links)
        except Exception as exc:  # noqa: BLE001 - reported, then the job ends
            errors.abort_job(self.comm.mpi, EXIT_CODE,
                             f"mpiattn: error: the watchdog of rank {self.comm.rank} failed "
                             f"({type(exc).__name__}: {exc}); aborting the job",
                             hooks=list(self.comm._abort_hooks))

    def _watch(self, links: list[_Link]) -> None:
        me = self._mpi.Get_rank()
        beat, bye = np.array([_BEAT], np.int32), np.array([_BYE], np.int32)
        tick = min(0.05, self.period / 4)
        said_bye, last = False, time.monotonic()
        while True:
            now = time.monotonic()
            watched, last = min(now - last, self.period), now  # a pause of this thread: one period
            if self._stopping.is_set() and not said_bye:
                for link in links:
                    link.send(bye)
                said_bye = True
            for link in links:
                link.quiet += watched
                link.receive(now)
                link.matched()
                if not said_bye and link.beat_due(now, self.period, self.timeout):
                    link.send(beat)
            if said_bye and all(link.finished for link in links):
                return
            silent = [link for link in links if not link.done and link.quiet > self.timeout]
            if silent:
                self._abort(me, silent[0].peer, silent[0].quiet)
            time.sleep(tick)

    def _abort(self, me: int, peer: int, quiet_s: float) -> None:
        """End the job: rank 0 at once, another rank after DEFER_S; our own exit if MPI cannot."""
        if me:
            time.sleep(errors.DEFER_S)
        ender = threading.Timer(ABORT_GRACE_S, os._exit, (EXIT_CODE,))
        ender.daemon = True
        ender.start()
        errors.abort_job(
            self.comm.mpi, EXIT_CODE,
            f"mpiattn: error: rank {me} ({self._hosts[me]}) has heard nothing from rank {peer} "
            f"({self._hosts[peer]}) for {quiet_s:.0f} s (watchdog timeout {self.timeout:g} s): "
            "that rank or the network between them is gone; aborting the job",
            hooks=list(self.comm._abort_hooks))
