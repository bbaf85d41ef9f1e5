"""Ending a job on SIGINT, SIGTERM or SIGHUP: clean up, one message, every rank gone.

Installed by :func:`mpiattn.cli.main.main` when it runs as the program
(``python -m mpiattn``), never by the library, and only once MPI is
initialised: until then a signal keeps its default action and ends the
process at once (nothing has been written yet), so a rank waiting in
``MPI_Init`` for peers that never come ends on SIGTERM like any program.

Launchers forward these signals to every rank (``mpiexec`` on Ctrl-C, SLURM
at the time limit and on ``scancel``), but a rank may then be anywhere:
computing, writing, or blocked inside MPI waiting for a peer, where a
Python signal handler would never run (the interpreter runs handlers
between bytecodes only). So the Python-level handler does nothing; the
interpreter's C-level handler also writes the signal number to a wakeup
pipe (:func:`signal.set_wakeup_fd`), and a watcher thread reading that pipe
ends the process whatever the main thread is doing:

1. it stops the run's outputs (:meth:`mpiattn.io.Outputs.stop`): from then
   on this rank reserves, commits and publishes nothing (the main thread
   blocks for good at its next such step), and every temporary being
   written is removed (every rank knows the names, so any rank can),
   leaving an existing output as it was;
2. rank 0 prints one message and aborts the job (``MPI_Abort`` with exit
   code ``128 + signal number``; Hydra's ``mpiexec`` and ``srun`` pass it
   on); another rank first waits :data:`DEFER_S` seconds, since when
   every rank got the signal rank 0's abort ends it silently, and only a
   rank signalled alone speaks and aborts (under Open MPI rank 0 too waits,
   :data:`CASCADE_S`); the main thread prints nothing more;
3. no Python or C exit handler runs (:func:`mpiattn.comm.errors.abort_job`):
   no HDF5 collective after an abort.

A signal that comes after the output's commit point (every rank has voted
to publish it) is too late to matter: the output is published, the run
ends normally with exit code 0, and one line says so. No collective is
ever started from here.

Open MPI's ``mpirun``/``prterun`` does not forward SIGINT or SIGTERM: it
ends its ranks itself (SIGCONT, SIGTERM, SIGKILL within about half a
second) and stops relaying their output first. Step 1 still runs (the
temporary file is removed), but the message is lost and the job's exit code
is prterun's 1. Under ``srun`` (SLURM sends every task the signal, then
waits ``KillWait`` seconds) and Hydra all three steps run.
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

__all__ = ["SIGNALS", "Guard", "install"]

#: The signals that end a run cleanly.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Seconds rank 0 waits before it speaks when Open MPI launched the job. When
#: one rank aborts, Open MPI's prterun ends the others with SIGCONT, then
#: SIGTERM, then SIGKILL, about 0.25 s apart (Open MPI 5.0.11, PRRTE 3.0.11):
#: rank 0 would report that SIGTERM as if it were the user's signal; waiting,
#: it is killed silently, and a signal meant for it alone is reported late.
CASCADE_S = 1.0

#: Seconds a rank other than 0 waits before it speaks and aborts the job. When
#: the signal reached every rank (a launcher forwarding it, SLURM), rank 0's
#: abort ends the job meanwhile and its message is the only one; on a loaded
#: machine MPICH 4's abort has been seen to take more than 3 s to arrive.
DEFER_S = 10.0

#: Seconds a run whose output was published before a signal has to finish
#: normally before the signal ends it anyway.
LATE_GRACE_S = 30.0


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: the watcher thread does the work."""


def _open_mpi_launch() -> bool:
    """True when Open MPI's launcher (prterun/mpirun, or ``srun`` with Open MPI) started us."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ


class Guard:
    """The installed handlers, wakeup pipe and watcher thread of one run (see :func:`install`).

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

    def __init__(self, world: Any) -> None:
        self.world, self.rank, self.size = world, world.Get_rank(), world.Get_size()
        self.outputs = io.Outputs()
        self.phase = "while starting"
        self.fired: int | None = None
        self.late: int | None = None
        self.finished = threading.Event()
        self._code = 0
        self._synced = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, _ignore) for s in SIGNALS}
        self._thread = threading.Thread(target=self._watch, name="mpiattn-signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 1)
            except OSError:
                return
            if not data:
                return  # uninstalled
            if data[0] == 0:  # :meth:`sync`
                self._synced.set()
            elif data[0] in SIGNALS:
                self.end(data[0])

    def sync(self) -> None:
        """In the main thread: return once every signal received so far has been handled."""
        self._synced.clear()
        os.write(self._write, b"\0")  # after the signal numbers already in the pipe
        self._synced.wait()

    def end(self, signum: int) -> None:
        """Stop the run's outputs; end the job with ``128 + signum`` unless the output is published."""
        name = signal.Signals(signum).name
        if self.finished.is_set():  # the run is over: the process exits normally
            if self.rank == 0:
                print(f"{self._signalled(name)} after the run had finished: nothing to undo "
                      f"(exit code {self._code})", file=sys.stderr, flush=True)
            return
        stopped = self.outputs.stop(name)
        if stopped.published and not stopped.removed and not stopped.pending:
            self.late = signum  # the main thread finishes normally and says so
            text = (f"{self._signalled(name)} after {', '.join(stopped.published)} was published; "
                    f"the run did not finish within {LATE_GRACE_S:g} s")
            timer = threading.Timer(LATE_GRACE_S, self._late_timeout, (signum, text))
            timer.daemon = True
            timer.start()
            return
        self.fired = signum  # from now on the main thread says nothing
        if not errors.claim_ending():
            return  # this process is already ending (its own error): that one speaks
        phase = self.phase
        self._defer()

        def said() -> str:  # after the pause: what was removed meanwhile counts too
            self.outputs.remove_all()
            gone = [os.path.basename(p) for p in self.outputs.removed]
            done = f"removed {', '.join(gone)}" if gone else "no temporary file was open"
            if stopped.pending:
                done += f"; {', '.join(stopped.pending)} was being published and may be complete"
            return f"{self._signalled(name)} {phase}: {done}; existing outputs untouched"
        self._abort(signum, said(), claimed=True)

    def _late_timeout(self, signum: int, text: str) -> None:
        if not self.finished.is_set() and errors.claim_ending():
            self._defer()
            self._abort(signum, text, claimed=True)

    def _signalled(self, name: str) -> str:
        who = "" if self.size == 1 else f" on rank {self.rank} of {self.size}"
        return f"mpiattn: {name} received{who}"

    def _defer(self) -> None:
        """Wait before speaking: rank 0 speaks first, and Open MPI's cascade goes silently."""
        if self.rank != 0 and self.size > 1:
            time.sleep(DEFER_S)  # rank 0, when signalled too, ends the job meanwhile
        elif self.size > 1 and _open_mpi_launch():
            time.sleep(CASCADE_S)  # a SIGTERM sent by prterun to end an aborting job: SIGKILL follows

    def _abort(self, signum: int, text: str, claimed: bool) -> None:
        code = 128 + signum
        ending = "ending every rank" if self.size > 1 else "stopping"
        errors.abort_job(self.world, code, f"{text}; {ending} (exit code {code})", claimed=claimed)

    def hold(self) -> None:
        """In the main thread: wait for good when a signal is ending the process."""
        if self.fired is not None:
            io.publishing.park()

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
        """From now on the signals are ignored (as the process exits: Python's finalisation
        would give them back their default action, which kills the process, exit 128 + N).
        Those received until now are handled first."""
        self.sync()
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def install() -> Guard | None:
    """Install the handlers (main thread only, MPI initialised; returns None otherwise)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return Guard(MPI.COMM_WORLD)
