"""The program's first steps: catch signals from the first instruction on, then start MPI.

``python -m mpiattn`` and the ``mpiattn`` script (:func:`mpiattn.__main__.program`)
take these steps before the command line's heavy imports (NumPy, h5py, the
library):

1. a :class:`Watcher` is installed: the signals of
   :data:`mpiattn.cli.signals.SIGNALS` get a Python-level handler that does
   nothing, the interpreter's C-level handler writes each signal's number
   to a pipe (:func:`signal.set_wakeup_fd`), and a thread reading the pipe
   acts on it whatever the main thread is doing. Until MPI runs, it ends the
   process at once: exit code ``128 + N``, and one line from the launcher's
   rank 0 ("received while starting: nothing was written"), never a
   ``KeyboardInterrupt`` traceback per rank;
2. the imports run (a signal meanwhile: step 1);
3. MPI is initialised (:func:`init_mpi`) through the MPI library's own
   ``MPI_Init_thread`` called by :mod:`ctypes`, which releases Python's
   lock while it waits, so the watcher thread can still end a process
   whose peers never come (mpi4py's own initialisation holds the lock:
   the thread could not run, and the process would ignore SIGTERM);
4. :func:`mpiattn.cli.dispatch.main` runs; it hands the watcher to the run's
   :class:`mpiattn.cli.signals.Guard`, which from then on decides what a
   signal does (clean up, one message, end every rank).

Nothing here is imported by the library. Only the standard library is used.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from typing import Any

__all__ = ["SIGNALS", "Watcher", "NoMPI", "init_mpi"]

#: The signals that end a run cleanly.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Bytes in the pipe that are no signal number: a sync request, a wake-up.
_SYNC, _WAKE = 0, 255


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: the watcher thread does the work."""


def _launcher_rank() -> int | None:
    """This process's rank by the launcher's environment (None: unknown; no MPI call)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        text = os.environ.get(var, "").strip()
        if text.isdigit():
            return int(text)
    return None


class Starting:
    """What a signal does before MPI runs: one line from the launcher's rank 0, exit ``128 + N``."""

    def on_signal(self, signum: int) -> None:
        if _launcher_rank() in (None, 0):
            try:
                sys.stderr.write(f"mpiattn: {signal.Signals(signum).name} received while starting: "
                                 f"nothing was written; stopping (exit code {128 + signum})\n")
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - the exit code still tells
                pass
        os._exit(128 + signum)

    def poll(self) -> None:
        """Nothing to poll before MPI."""

    poll_s: float | None = None


class Watcher:
    """The signal pipe and the thread that reads it; the *handler* decides what a signal does.

    The handler is an object with ``on_signal(signum)`` (called in the
    watcher's thread), ``poll()`` and ``poll_s`` (seconds between calls of
    ``poll`` while no signal comes; None: never). :meth:`hand_over` replaces
    it atomically with respect to the thread. Only the main thread can make one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handler: Any = Starting()
        self._synced = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, _ignore) for s in SIGNALS}
        self._thread = threading.Thread(target=self._watch, name="mpiattn-signals", daemon=True)
        self._thread.start()

    def hand_over(self, handler: Any) -> None:
        """From now on ``handler`` acts on the signals (and is polled)."""
        with self._lock:
            self.handler = handler
        os.write(self._write, bytes([_WAKE]))  # the thread takes the new handler's poll interval

    def _watch(self) -> None:
        while True:
            with self._lock:
                handler = self.handler
            try:
                ready, _, _ = select.select([self._read], [], [], handler.poll_s)
                data = os.read(self._read, 64) if ready else b""
            except OSError:
                return
            if ready and not data:
                return  # the pipe was closed
            for byte in data:
                if byte == _SYNC:  # :meth:`sync`
                    self._synced.set()
                elif byte in SIGNALS:
                    with self._lock:
                        handler = self.handler
                    handler.on_signal(byte)
            if not data:
                handler.poll()

    def pending(self) -> list[int]:
        """Take the signals waiting in the pipe now (in the watcher's thread only)."""
        got: list[int] = []
        while select.select([self._read], [], [], 0)[0]:
            data = os.read(self._read, 64)
            if not data:
                break
            for byte in data:
                if byte == _SYNC:
                    self._synced.set()
                elif byte in SIGNALS:
                    got.append(byte)
        return got

    def sync(self) -> None:
        """In the main thread: return once every signal received so far has been handled."""
        self._synced.clear()
        os.write(self._write, bytes([_SYNC]))  # after the signal numbers already in the pipe
        self._synced.wait()

    def ignore(self) -> None:
        """From now on the signals are ignored (as the process exits: Python's finalisation
        would give them back their default action, which kills the process, exit 128 + N).
        Those received until now are handled first."""
        self.sync()
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


class NoMPI(RuntimeError):
    """mpi4py cannot load an MPI library (the program's one error line, exit code 1)."""


def _load_mpi() -> Any:
    """``mpi4py.MPI``, imported to leave MPI's initialisation to :func:`init_mpi` (unless imported
    before), or :class:`NoMPI` saying how to get an MPI library (no traceback: a venv without the
    ``mpich`` extra and no site MPI fails here, in mpi4py's import)."""
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = True
        from mpi4py import MPI
    except (ImportError, OSError, RuntimeError) as exc:
        why = "; ".join(line.strip() for line in str(exc).splitlines()
                        if line.strip() and line.strip() != "cannot load MPI library")
        raise NoMPI(f"mpi4py cannot load an MPI library ({why or type(exc).__name__}): install one "
                    "with `pip install mpich` (or build mpi4py against your site MPI)") from None
    return MPI


def init_mpi() -> None:
    """Initialise MPI (``MPI_THREAD_MULTIPLE``) with Python's lock released, unless it runs already.

    mpi4py then works as if it had initialised MPI itself: it finalises MPI
    at exit (``mpi4py.rc.finalize``) and its communicators raise Python
    exceptions on MPI errors. Where the MPI library's symbol cannot be found,
    mpi4py initialises MPI as usual (a signal during that step then waits
    for it to end). Raises :class:`NoMPI` when mpi4py finds no MPI library.
    """
    MPI = _load_mpi()
    if MPI.Is_initialized():
        return
    try:
        import ctypes

        init = ctypes.CDLL(MPI.__file__).MPI_Init_thread  # CDLL: the call releases the GIL
        provided = ctypes.c_int(0)
        init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        code = init(None, None, int(MPI.THREAD_MULTIPLE), ctypes.byref(provided))
    except (OSError, AttributeError):
        code = None
    if code is None or not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):  # as mpi4py's own start-up does
        comm.Set_errhandler(MPI.ERRORS_RETURN)
