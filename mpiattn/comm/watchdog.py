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
seconds of the cut. A rank that is merely slow (computing a long block,
waiting for a slow peer) keeps beating: its thread needs neither the main
thread nor its peers' progress, only the GIL now and then and MPI's thread
support (``MPI_THREAD_MULTIPLE``, mpi4py's default).

Starting and stopping are collective: :meth:`Watchdog.start` duplicates the
communicator; :meth:`Watchdog.stop` tells every peer that this rank stops
(a last message) and waits, still watching, until each peer has said the
same, so a rank that finishes early is never taken for a lost one. The
library starts no watchdog itself; the command line does with
``--watchdog SECONDS``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from . import errors

__all__ = ["Watchdog", "peers_of", "ABORT_GRACE_S", "EXIT_CODE"]

#: Seconds a rank gives ``MPI_Abort`` to end the job before it ends its own process.
ABORT_GRACE_S = 5.0

#: The exit code of a job the watchdog ends.
EXIT_CODE = 1

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


class Watchdog:
    """Heartbeats between the ranks of a Comm; an abort when a peer falls silent (see the module).

    Parameters
    ----------
    comm : mpiattn.comm.core.Comm
        The ranks to watch; its clean-ups on abort run before an abort.
    timeout : float
        Seconds of silence from a peer after which the job is ended.
    period : float, optional
        Seconds between heartbeats (default ``timeout / 5``, at most 1 s).
    """

    def __init__(self, comm: Any, timeout: float, period: float | None = None):
        if not timeout > 0:
            raise ValueError(f"the watchdog's timeout must be > 0 seconds, got {timeout}")
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
        self._hosts = self._mpi.allgather(MPI.Get_processor_name())
        self._thread = threading.Thread(target=self._watch, name="mpiattn-watchdog", daemon=True)
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
    def _watch(self) -> None:
        mpi, me = self._mpi, self._mpi.Get_rank()
        peers = peers_of(me, self._mpi.Get_size())
        inbox = {p: np.zeros(1, np.int32) for p in peers}
        recvs = {p: mpi.Irecv(inbox[p], p, _TAG) for p in peers}
        beat, bye = np.array([_BEAT], np.int32), np.array([_BYE], np.int32)
        sends: list = []
        heard = dict.fromkeys(peers, time.monotonic())
        done: set[int] = set()
        said_bye, next_beat = False, 0.0
        while True:
            now = time.monotonic()
            if self._stopping.is_set() and not said_bye:
                sends += [mpi.Isend(bye, p, _TAG) for p in peers]
                said_bye = True
            elif not said_bye and now >= next_beat:
                sends += [mpi.Isend(beat, p, _TAG) for p in peers]
                next_beat = now + self.period
            sends = [s for s in sends if not s.Test()]
            for p in [p for p in recvs if recvs[p].Test()]:
                heard[p] = now
                if int(inbox[p][0]) == _BYE:
                    done.add(p)
                    del recvs[p]
                else:
                    recvs[p] = mpi.Irecv(inbox[p], p, _TAG)
            if said_bye and len(done) == len(peers) and not sends:
                return
            silent = [p for p in peers if p not in done and now - heard[p] > self.timeout]
            if silent:
                self._abort(me, silent[0], now - heard[silent[0]])
            time.sleep(min(0.05, self.period / 4))

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
