"""Ending a job on SIGINT, SIGTERM or SIGHUP: clean up, one message, every rank gone.

Installed by :func:`mpiattn.cli.main.main` when it runs as the program
(``python -m mpiattn``), never by the library. Launchers forward these
signals to every rank (``mpiexec`` on Ctrl-C, SLURM at the time limit and
on ``scancel``), but a rank may then be anywhere: computing, writing, or
blocked inside MPI waiting for a peer, where a Python signal handler would
never run (the interpreter runs handlers between bytecodes only), and the
old behaviour was a hang. So the Python-level handler does nothing; the
interpreter's C-level handler also writes the signal number to a wakeup
pipe (:func:`signal.set_wakeup_fd`), and a watcher thread reading that pipe
ends the process whatever the main thread is doing:

1. it removes this process's temporary files
   (:func:`mpiattn.io.temporaries.remove_registered`; every rank knows the
   names, so any rank can), leaving an existing output as it was;
2. rank 0 prints one message and aborts the job (``MPI_Abort`` with exit
   code ``128 + signal number``; Hydra's ``mpiexec`` and ``srun`` pass it
   on); another rank first waits :data:`mpiattn.comm.errors.DEFER_S`
   seconds, since when every rank got the signal rank 0's abort ends it
   silently, and only a rank signalled alone speaks and aborts (under Open
   MPI rank 0 too waits, :data:`CASCADE_S`);
3. no Python or C exit handler runs (:func:`mpiattn.comm.errors.abort_job`):
   no HDF5 collective after an abort.

No collective is ever started from here.

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
import threading
import time
from typing import Any

from .. import io
from ..comm import errors

__all__ = ["SIGNALS", "Guard", "install", "set_phase"]

#: The signals that end a run cleanly.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Seconds rank 0 waits before it speaks when Open MPI launched the job. When
#: one rank aborts, Open MPI's prterun ends the others with SIGCONT, then
#: SIGTERM, then SIGKILL, about 0.25 s apart (Open MPI 5.0.11, PRRTE 3.0.11):
#: rank 0 would report that SIGTERM as if it were the user's signal; waiting,
#: it is killed silently, and a signal meant for it alone is reported late.
CASCADE_S = 1.0

_PHASE = ["while starting"]


def set_phase(text: str) -> None:
    """What the run is doing now, for the message (e.g. ``"while writing out.h5"``)."""
    _PHASE[0] = text


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: the watcher thread does the work."""


def _open_mpi_launch() -> bool:
    """True when Open MPI's launcher (prterun/mpirun, or ``srun`` with Open MPI) started us."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ


def _world() -> tuple[Any, int, int]:
    """(COMM_WORLD or None, rank, size), without initialising MPI."""
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            w = MPI.COMM_WORLD
            return w, w.Get_rank(), w.Get_size()
    except Exception:  # noqa: BLE001 - an ending process must not fail here
        pass
    return None, 0, 1


class Guard:
    """The installed handlers, wakeup pipe and watcher thread (see :func:`install`)."""

    def __init__(self) -> None:
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
            if data[0] in SIGNALS:
                self.end(data[0])

    def end(self, signum: int) -> None:
        """Clean up and end this process and the job with ``128 + signum`` (never returns)."""
        code = 128 + signum
        pending = io.temporaries.registered()
        io.remove_registered()  # (another rank may have been quicker: gone either way)
        world, rank, size = _world()
        if rank != 0 and size > 1:
            time.sleep(errors.DEFER_S)  # rank 0, when signalled too, ends the job meanwhile
        elif size > 1 and _open_mpi_launch():
            time.sleep(CASCADE_S)  # a SIGTERM sent by prterun to end an aborting job: SIGKILL follows
        name = signal.Signals(signum).name
        gone = [os.path.basename(p) for p in pending if not os.path.lexists(p)]
        done = f"removed {', '.join(gone)}" if gone else "no temporary file was open"
        who = "" if size == 1 else f" on rank {rank} of {size}"
        ending = "ending every rank" if size > 1 else "stopping"
        errors.abort_job(world, code, f"mpiattn: {name} received{who} {_PHASE[0]}: {done}; "
                                      f"existing outputs untouched; {ending} (exit code {code})")

    def uninstall(self) -> None:
        """Restore the previous handlers and wakeup fd; stop the watcher."""
        for s, old in self._old.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)
        self._thread.join(timeout=5)
        os.close(self._read)


def install() -> Guard | None:
    """Install the handlers (main thread only; returns None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return Guard()
