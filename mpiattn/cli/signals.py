"""Ending a job on SIGINT, SIGTERM or SIGHUP: clean up, one message, every rank gone.

The program's :class:`~mpiattn.cli.startup.Watcher` (installed before
anything else, :mod:`mpiattn.cli.startup`) hands its signals to a
:class:`Guard` once MPI runs. Launchers forward these signals to every rank
(``mpiexec`` on Ctrl-C, SLURM at the time limit and on ``scancel``), but a
rank may then be anywhere: computing, writing, or blocked inside MPI
waiting for a peer, where a Python signal handler would never run. The
watcher's thread acts whatever the main thread is doing.

**Who decides, who speaks.** Rank 0 owns every output (it reserves and
publishes them, :mod:`mpiattn.io.publishing`), so rank 0 decides what a
signal did and is the one rank that speaks:

* rank 0, signalled, stops its outputs (:meth:`mpiattn.io.Outputs.stop`:
  nothing more is reserved, voted or published; temporaries being written
  are removed; a group voted for but not yet seen committed is revoked;
  a committed one is published first);
* another rank, signalled, stops its own outputs (removing what it writes,
  leaving its votes to rank 0) and sends rank 0 a *request* on the guard's
  own communicator (a duplicate of ``COMM_WORLD``); rank 0's watcher thread
  polls for requests every :data:`POLL_S` seconds and treats one as its own
  signal;
* once rank 0 has decided to end the job, it offers to speak to every
  rank that asked, and tells every other rank that it speaks; a rank that
  asked answers *agreed* and waits silently for the end. Rank 0 speaks
  once every rank that asked has agreed, then aborts the job
  (``MPI_Abort``, exit code ``128 + N``);
* a rank whose request rank 0 does not answer within :data:`DEFER_S`
  seconds (rank 0 stuck, e.g. inside HDF5 with Python's lock held) tells
  rank 0 it speaks *alone*, then removes what it voted for, tells what the
  target files now are, speaks and aborts; rank 0, learning it, stays
  silent. One rank's decision (agree, or speak alone) settles each
  request, so exactly one message is printed in every interleaving;
* a signal that comes after rank 0's commit point is too late to matter:
  rank 0 answers *late*, the output is published, the run ends normally with
  exit code 0, and one line says so at the end.

Where MPI does not allow calls from a second thread (``MPI_THREAD_MULTIPLE``),
every rank decides alone: rank 0 at once, the others after :data:`DEFER_S`
seconds (by then rank 0's abort has usually ended them). No Python or C exit
handler runs during an abort (:func:`mpiattn.comm.errors.abort_job`): no
HDF5 collective after an abort.

Open MPI's ``mpirun``/``prterun`` does not forward SIGINT or SIGTERM: it
ends its ranks itself (SIGCONT, SIGTERM, SIGKILL within about half a
second) and stops relaying their output first. The temporary files are
still removed, but the message is lost and the job's exit code is
prterun's 1. Under ``srun`` (SLURM sends every task the signal, then waits
``KillWait`` seconds) and Hydra everything above holds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from .. import io
from ..comm import errors
from .startup import SIGNALS, Watcher

__all__ = ["SIGNALS", "Guard", "install", "DEFER_S", "POLL_S"]

#: Seconds rank 0 waits before it speaks when Open MPI launched the job. When
#: one rank aborts, Open MPI's prterun ends the others with SIGCONT, then
#: SIGTERM, then SIGKILL, about 0.25 s apart (Open MPI 5.0.11, PRRTE 3.0.11):
#: rank 0 would report that SIGTERM as if it were the user's signal; waiting,
#: it is killed silently, and a signal meant for it alone is reported late.
CASCADE_S = 1.0

#: Seconds a rank other than 0 waits for rank 0's answer before it speaks alone.
DEFER_S = 10.0

#: Seconds between rank 0's looks for other ranks' requests.
POLL_S = 0.05

#: Seconds rank 0 waits for the answers of the ranks it offered to speak for.
ANSWER_S = DEFER_S + 20.0

#: Seconds a run whose output was published before a signal has to finish
#: normally before the signal ends it anyway.
LATE_GRACE_S = 30.0

#: Seconds a silent rank waits to be ended by rank 0's abort before it aborts itself.
SILENT_S = 60.0

# the guard's messages: tag, and what they carry
_REQUEST, _REPLY, _ANSWER = 1, 2, 3  # (signum) r -> 0; "speak" | "late" 0 -> r; "agreed" | "alone"


def _open_mpi_launch() -> bool:
    """True when Open MPI's launcher (prterun/mpirun, or ``srun`` with Open MPI) started us."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ


class Guard:
    """What signals do during one run (see the module docstring); made by :func:`install`.

    Attributes
    ----------
    outputs : mpiattn.io.Outputs
        The run's outputs: every write of the run goes through it.
    phase : str
        What the run is doing, for the message (e.g. ``"while writing the output"``).
    fired : int or None
        The signal that is ending the process (the main thread then only waits).
    late : int or None
        A signal that came after the run's output was published.
    """

    def __init__(self, world: Any, watcher: Watcher) -> None:
        from mpi4py import MPI

        self.world, self.rank, self.size = world, world.Get_rank(), world.Get_size()
        self.watcher = watcher
        self.outputs = io.Outputs(sync=watcher.sync)
        self.phase = "while starting"
        self.fired: int | None = None
        self.late: int | None = None
        self.finished = threading.Event()
        self._code = 0
        self._ending = False  # rank 0: decided to end the job
        self._heard: dict[int, int] = {}  # rank 0: who got which signal
        self._requests: set[int] = set()  # rank 0: the ranks that asked it to decide
        self._told: set[int] = set()  # rank 0: the ranks it told that it speaks
        self._sent: list = []  # the requests of the messages sent (kept until the process ends)
        threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        #: The guard's own communicator (collective to make: every rank is here), or None.
        self.line = world.Dup() if self.size > 1 and threads else None
        self.poll_s = POLL_S if self.line is not None and self.rank == 0 else None
        watcher.hand_over(self)

    # ------------------------------------------------------------ the watcher's calls
    def on_signal(self, signum: int) -> None:
        """A signal reached this rank (the watcher's thread)."""
        if self.finished.is_set():  # the run is over: the process exits normally
            if self.rank == 0:
                print(f"{self._signalled(signal.Signals(signum).name, [0])} after the run had "
                      f"finished: nothing to undo (exit code {self._code})", file=sys.stderr,
                      flush=True)
            return
        if self.rank == 0 or self.line is None:
            self._decide(signum, self.rank)
        else:
            self._ask(signum)

    def poll(self) -> None:
        """Rank 0: answer the requests of the other ranks (the watcher's thread)."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.line.Iprobe(MPI.ANY_SOURCE, _REQUEST, status):
            r = status.Get_source()
            signum = self.line.recv(source=r, tag=_REQUEST)
            self._decide(signum, r)

    # ------------------------------------------------------------------- rank 0
    def _decide(self, signum: int, who: int) -> None:
        """Rank 0 (or any rank without a guard line): the signal ``signum`` reached rank ``who``."""
        name = signal.Signals(signum).name
        self._heard.setdefault(who, signum)
        if who != self.rank:
            self._requests.add(who)
        if self._ending:
            self._reply(who, "speak")
            return
        stopped = self.outputs.stop(name, wait_s=10.0)
        if stopped.published and not stopped.removed and not stopped.pending:
            self._reply(who, "late")
            if who == self.rank:
                self._too_late(signum, name)
            return
        self._ending = True
        self.fired = signum  # from now on the main thread says nothing
        if not errors.claim_ending():
            return  # this process is already ending (its own error): that one speaks
        if self.line is None:
            self._alone_defer()
        elif _open_mpi_launch() and who == self.rank:
            time.sleep(CASCADE_S)  # a SIGTERM sent by prterun to end an aborting job: SIGKILL follows
        if self.line is not None:
            for s in self.watcher.pending():  # this rank's own signals, arrived meanwhile
                self._heard.setdefault(self.rank, s)
            if not self._all_agree():
                self._silent(signum)  # another rank speaks, and ends the job
        self.outputs.remove_all()
        published = []
        if stopped.pending or stopped.undecided:  # remove them: from then on, what is stays
            published = self.outputs.give_up()[1]
        self._abort(signum, self._words(name, sorted(self._heard), "", published))

    def _reply(self, r: int, what: str) -> None:
        if r != self.rank and self.line is not None:
            self._send(what, r, _REPLY)
            if what == "speak":
                self._told.add(r)

    def _send(self, what: Any, dest: int, tag: int) -> None:
        self._sent.append(self.line.isend(what, dest=dest, tag=tag))  # (its buffer lives on)

    def _all_agree(self) -> bool:
        """Rank 0, ending: tell every rank it speaks; True once every rank that asked agreed.

        The requests that arrived while this thread was busy (its own signal's handling, Open
        MPI's cascade wait) are taken first: an asker whose deadline passed meanwhile has told
        this rank it speaks alone, and this rank must then stay silent.
        """
        from mpi4py import MPI

        status = MPI.Status()
        while self.line.Iprobe(MPI.ANY_SOURCE, _REQUEST, status):
            r = status.Get_source()
            self._heard.setdefault(r, self.line.recv(source=r, tag=_REQUEST))
            self._requests.add(r)
        for r in range(1, self.size):
            if r not in self._told:
                self._reply(r, "speak")  # asked or not: a later request of theirs is answered
        waiting, answered = set(self._requests), set()
        deadline = time.monotonic() + ANSWER_S
        while waiting and time.monotonic() < deadline:
            if self.line.Iprobe(MPI.ANY_SOURCE, _ANSWER, status):
                r = status.Get_source()
                if self.line.recv(source=r, tag=_ANSWER) == "alone":
                    return False
                answered.add(r)
                waiting.discard(r)
            elif self.line.Iprobe(MPI.ANY_SOURCE, _REQUEST, status):
                r = status.Get_source()
                self._heard.setdefault(r, self.line.recv(source=r, tag=_REQUEST))
                self._requests.add(r)
                if r not in answered:  # (its answer may be matched before its request: tags differ)
                    waiting.add(r)  # it was told already: its answer comes
            else:
                time.sleep(0.005)
        return not waiting

    def _too_late(self, signum: int, name: str) -> None:
        self.late = signum  # the main thread finishes normally and says so
        text = (f"{self._signalled(name, [self.rank])} after the output was published; the run "
                f"did not finish within {LATE_GRACE_S:g} s")
        timer = threading.Timer(LATE_GRACE_S, self._late_timeout, (signum, text))
        timer.daemon = True
        timer.start()

    def _late_timeout(self, signum: int, text: str) -> None:
        if not self.finished.is_set() and errors.claim_ending():
            self._alone_defer()
            self._abort(signum, text)

    # ------------------------------------------------------------- other ranks
    def _ask(self, signum: int) -> None:
        """A rank other than 0: stop, ask rank 0, and do as it says (or speak alone)."""
        from mpi4py import MPI

        name = signal.Signals(signum).name
        self.outputs.stop(name, wait_s=0.0)
        self._send(signum, 0, _REQUEST)
        deadline = time.monotonic() + DEFER_S
        while time.monotonic() < deadline:
            if self.line.Iprobe(0, _REPLY, MPI.Status()):
                answer = self.line.recv(source=0, tag=_REPLY)
                if answer == "late":
                    self._too_late(signum, name)
                    return
                self.fired = signum
                self._send("agreed", 0, _ANSWER)
                self._silent(signum)
            time.sleep(0.005)
        self._send("alone", 0, _ANSWER)  # rank 0 will stay silent
        self._speak_alone(signum, name, "rank 0 did not answer within "
                                        f"{DEFER_S:g} s")

    def _speak_alone(self, signum: int, name: str, why: str) -> None:
        self.outputs.remove_all()
        removed, published = self.outputs.give_up()
        if not removed and not self.outputs.removed and (published or self.outputs.published):
            self._too_late(signum, name)  # rank 0 had published it: the run ends normally
            return
        self.fired = signum
        if not errors.claim_ending():
            return
        self._abort(signum, self._words(name, [self.rank], f" ({why})", published))

    def _silent(self, signum: int) -> None:
        """Wait for the speaking rank's abort; should it not come, end the job without a word."""
        time.sleep(SILENT_S)
        if errors.claim_ending():
            errors.abort_job(self.world, 128 + signum, "", claimed=True)
        io.publishing.park()

    def _alone_defer(self) -> None:
        """Without a guard line: a rank other than 0 waits, so that rank 0 speaks first."""
        if self.rank != 0 and self.size > 1:
            time.sleep(DEFER_S)  # rank 0, when signalled too, ends the job meanwhile

    # ------------------------------------------------------------------ words
    def _words(self, name: str, ranks: list, why: str, published: list) -> str:
        """The one message: who got the signal, what the run was doing, what became of the files."""
        gone = [os.path.basename(p) for p in self.outputs.removed]
        done = f"removed {', '.join(gone)}" if gone else "no temporary file was open"
        if published:  # (an owner that could not be stopped in time named them first)
            return (f"{self._signalled(name, ranks)} {self.phase}{why}: {done}; "
                    f"{', '.join(published)} had been published already and is complete")
        return f"{self._signalled(name, ranks)} {self.phase}{why}: {done}; existing outputs untouched"

    def _signalled(self, name: str, ranks: list) -> str:
        if self.size == 1:
            return f"mpiattn: {name} received"
        if len(ranks) == self.size:
            return f"mpiattn: {name} received on every rank ({self.size})"
        which = f"rank {ranks[0]}" if len(ranks) == 1 else \
            f"ranks {', '.join(str(r) for r in ranks)}"
        return f"mpiattn: {name} received on {which} of {self.size}"

    def _abort(self, signum: int, text: str) -> None:
        code = 128 + signum
        ending = "ending every rank" if self.size > 1 else "stopping"
        errors.abort_job(self.world, code, f"{text}; {ending} (exit code {code})", claimed=True)

    # ------------------------------------------------------------ the main thread
    def sync(self) -> None:
        """Return once every signal received so far has been handled."""
        self.watcher.sync()

    def hold(self) -> None:
        """In the main thread: wait for good when a signal is ending the process."""
        if self.fired is not None:
            io.publishing.park()

    def settle(self) -> None:
        """In the main thread, before rank 0 reports an environmental error: such an error is
        often the echo of another rank's signal (its clean-up removed a temporary file this rank
        was writing); wait until rank 0 has heard of it, then wait for good if it did."""
        if self.rank == 0 and self.size > 1:
            time.sleep(errors.SETTLE_S)
        self.sync()
        self.yield_to_a_signal()

    def yield_to_a_signal(self) -> None:
        """Before this rank reports an error (an abort's first clean-up, or the run's error line):
        when a signal is being handled, on this rank or (rank 0) asked for by another rank whose
        request this rank's watcher has not read yet, wait: that signal's message is the one,
        and its decision ends the job (the error is its echo: the signal's clean-up removed a
        file this rank was writing). Returns at once when there is none; after
        :data:`SILENT_S` in any case."""
        from mpi4py import MPI

        asked = self.rank == 0 and self.line is not None and self.line.Iprobe(MPI.ANY_SOURCE, _REQUEST)
        if asked or self.fired is not None or self._ending or self.outputs.stopped is not None:
            time.sleep(SILENT_S)  # the signal's thread ends the process meanwhile

    def finish(self, late: list, code: int) -> None:
        """The main thread's last step, ``late`` every rank's :attr:`late` (rank 0 prints one line)."""
        self._code = code
        self.finished.set()
        got = [(r, s) for r, s in enumerate(late) if s is not None]
        if got and self.rank == 0:
            ranks = "" if self.size == 1 else f" (rank {', '.join(str(r) for r, _ in got)})"
            print(f"mpiattn: {signal.Signals(got[0][1]).name} received{ranks} after the output "
                  f"was published: it is complete and kept, the signal came too late to matter "
                  f"(exit code {code})", file=sys.stderr, flush=True)

    def ignore(self) -> None:
        """From now on the signals are ignored (as the process exits)."""
        self.watcher.ignore()


def install(watcher: Watcher | None = None) -> Guard | None:
    """The run's guard (main thread only, MPI initialised; None otherwise), on ``watcher``
    (made now when the program did not make one first)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return Guard(MPI.COMM_WORLD, watcher or Watcher())
