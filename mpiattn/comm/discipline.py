"""Collective discipline: every rank reaches the same collectives, from one thread, while alive.

A collective call waits for every rank of its communicator. Three mistakes turn
that wait into a hang, and this module turns each into an error instead:

* **Ranks at different collectives** (a decision only some ranks' data made, a
  rank that raised alone). In the *checking mode* (the environment variable
  :data:`CHECK_VARIABLE`, for tests and debugging; off by default) every
  collective of a :class:`~mpiattn.comm.core.Comm` first exchanges its call site,
  the library's line that asked for it, with every rank on a communicator of its
  own (:meth:`Discipline.point`), as MPI correctness checkers do: ranks at
  different sites raise one :class:`~mpiattn.comm.errors.CallMismatch` naming
  both sites, and a rank that waits longer than the variable's seconds for the
  others raises instead of waiting on.
* **A rank that has ended** (its program finished, or failed alone, while another
  still makes calls): at the interpreter's exit each live Comm sends a
  *departure notice* to its successor in rank order (:meth:`Discipline.depart`);
  a rank waiting at the entry check of a public call (or, in the checking mode, at
  any collective) polls for it, passes it on to its own successor and raises a
  RuntimeError naming the rank that ended. O(P) messages in all. Each rank, at its
  own exit, then receives its predecessor's notice (waiting as MPI's finalize would
  wait for that rank anyway), so no message is left unmatched at ``MPI_Finalize``
  (UCX warns of every one: "unexpected tag-receive descriptor ... was not matched").
* **Two threads on one communicator** at once: MPI needs a communicator's
  collectives to come from one thread at a time (or from threads that order them
  alike on every rank, which nothing checks). The public calls claim their Comm
  for their thread (:meth:`Discipline.claim`); a second thread that finds it
  claimed ends the job with a message saying so (one rank: raises), instead of
  MPI's "See the MPI_ERROR field".

A freed communicator (the user freed theirs, so mpiattn freed its duplicate) is
refused with a ValueError at the same points.

These are the only polled waits of the package; every other collective is MPI's
own blocking call. Host work only; ``mpi4py.MPI`` is imported on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np

from . import errors

__all__ = ["Discipline", "CHECK_VARIABLE", "DEPART_TAG", "checking_timeout", "call_site"]

#: The environment variable of the checking mode: unset, empty or ``0`` is off; ``1`` is on
#: (waits of up to :data:`CHECK_DEFAULT_S` seconds); a number is on with that many seconds.
CHECK_VARIABLE = "MPIATTN_CHECK_COLLECTIVES"
#: The checking mode's longest wait for the other ranks at one collective, by default.
CHECK_DEFAULT_S = 120.0
#: The tag of the departure notices (no other message of the library's uses it).
DEPART_TAG = 7701
#: The longest wait at the interpreter's exit for the predecessor's own notice (seconds).
EXIT_WAIT_S = 300.0
#: Bytes of one rank's call site in the checking mode's exchange.
SITE_BYTES = 512

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
#: Files whose frames are the collective machinery, not its call site.
_MACHINERY = {os.path.join(_HERE, name) for name in ("core.py", "discipline.py", "errors.py", "ring.py")}


def checking_timeout(environ: Any = None) -> float | None:
    """The checking mode's seconds from :data:`CHECK_VARIABLE`, or None when it is off.

    Raises ValueError for a value that is neither a flag nor a positive number of seconds.
    """
    raw = (os.environ if environ is None else environ).get(CHECK_VARIABLE, "").strip()
    if raw in ("", "0"):
        return None
    if raw == "1":
        return CHECK_DEFAULT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{CHECK_VARIABLE}={raw!r}: expected 0 (off), 1 (on) or a positive number "
                         "of seconds")
    return seconds


def call_site() -> tuple[str, str, int]:
    """``(file, function, line)`` of the first frame outside the collective machinery (the
    library's line that asked for a collective, or the ring for it; a file of the package
    relative to it)."""
    frame = sys._getframe(1)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) in _MACHINERY
                                 or frame.f_code.co_filename.endswith("contextlib.py")):
        frame = frame.f_back
    if frame is None:
        return ("?", "?", 0)
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(_PACKAGE + os.sep):
        path = "mpiattn/" + os.path.relpath(path, _PACKAGE).replace(os.sep, "/")
    code = frame.f_code
    return (path, getattr(code, "co_qualname", code.co_name), frame.f_lineno)


def _site_text(site: list) -> str:
    what, path, func, line = site
    return f"{what} from {path}:{line} ({func})"


class Discipline:
    """The collective discipline of one Comm (see the module docstring).

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Intracomm
        The Comm's communicator (made collectively: in the checking mode this makes one
        more, its duplicate for the call sites, at the same point).
    timeout : float or None
        The checking mode's seconds (:func:`checking_timeout`), None: off.
    """

    def __init__(self, mpi_comm: Any, timeout: float | None = None):
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.timeout = timeout
        self._sites = mpi_comm.Dup() if timeout is not None and self.size > 1 else None
        self._departed: int | None = None  # the rank that ended, once a notice came
        self._pred_ended = False           # the predecessor's own notice was received
        self._forwarded = False
        self._lock = threading.Lock()
        self._owner: int | None = None     # the thread that holds the Comm, and how deep
        self._depth = 0
        self._holding = ""
        self._closed = False
        if self.size > 1:
            atexit.register(self.depart)

    # ----------------------------------------------------------------- life
    def close(self) -> None:
        """The Comm is freed: no notice at exit, the sites' communicator freed (local)."""
        if self._closed:
            return
        self._closed = True
        if self.size > 1:
            atexit.unregister(self.depart)
        from mpi4py import MPI

        if self._sites is not None and not MPI.Is_finalized():
            self._sites.Free()
        self._sites = None

    def live(self, what: str) -> None:
        """Raise (every rank alike: freeing is collective) when the communicator was freed, and
        RuntimeError when a departure notice came earlier."""
        if self._closed:
            raise errors.mark(ValueError(
                f"{what}: its communicator was freed (the communicator it was made on, or planned "
                "for, was freed with comm.Free()): make the call or the plan on a live communicator"))
        if self._departed is not None:
            self._raise_departed(what)

    def depart(self) -> None:
        """At the interpreter's exit: tell the successor that this rank has ended (a notice it
        polls for while it waits), then take the predecessor's own notice (and any it passed on
        before), so none is left unmatched. Never raises; waits at most :data:`EXIT_WAIT_S`."""
        self._notify(self.rank)
        try:
            if self._gone():
                return
            end = time.monotonic() + EXIT_WAIT_S
            while not self._pred_ended and time.monotonic() < end:
                if self._take() is None:
                    time.sleep(1e-3)
        except Exception:  # noqa: BLE001 - a notice is a courtesy, never a failure
            pass

    def _take(self) -> int | None:
        """Receive one waiting notice (the rank it names), or None when none has come."""
        from mpi4py import MPI

        status = MPI.Status()
        if not self.mpi.Iprobe(source=MPI.ANY_SOURCE, tag=DEPART_TAG, status=status):
            return None
        got = np.zeros(1, dtype=np.int64)
        source = status.Get_source()  # always the predecessor: notices go to the successor
        self.mpi.Recv([got, MPI.INT64_T], source=source, tag=DEPART_TAG)
        who = int(got[0])
        if who == source:
            self._pred_ended = True
        return who

    def _gone(self) -> bool:
        """No message may use the communicator: closed, freed underneath the Comm (mpi4py's
        ``Free()`` leaves ``COMM_NULL``: any call on it aborts the job under Open MPI), or MPI
        not running."""
        from mpi4py import MPI

        return (self._closed or not MPI.Is_initialized() or MPI.Is_finalized()
                or self.mpi == MPI.COMM_NULL)

    def _notify(self, who: int) -> None:
        try:
            from mpi4py import MPI

            if self._gone():
                return
            req = self.mpi.Isend([np.array([who], dtype=np.int64), MPI.INT64_T],
                                 dest=(self.rank + 1) % self.size, tag=DEPART_TAG)
            end = time.monotonic() + 1.0
            while not req.Test() and time.monotonic() < end:
                time.sleep(1e-4)
        except Exception:  # noqa: BLE001 - a notice is a courtesy, never a failure
            pass

    def _heed(self, what: str) -> None:
        """Raise when a departure notice has come (passing it on to the successor first)."""
        who = self._take()
        if who is None:
            return
        self._departed = who
        if not self._forwarded and (self.rank + 1) % self.size != self._departed:
            self._forwarded = True
            self._notify(self._departed)
        self._raise_departed(what)

    def _raise_departed(self, what: str) -> None:
        raise RuntimeError(
            f"rank {self._departed} of this communicator has ended (its program finished, or "
            f"failed alone) while rank {self.rank} waits for it in {what}: every rank must make "
            "the same mpiattn calls on a communicator, in the same order (e.g. a backward that "
            "runs on some ranks only)")

    # ---------------------------------------------------------------- waits
    def wait(self, req: Any, what: str) -> None:
        """Wait for the MPI request ``req`` of a collective, polling for departure notices (and, in
        the checking mode, raising after :attr:`timeout` seconds)."""
        if req.Test():
            return
        t0 = time.monotonic()
        nap = 0.0
        while True:
            self._heed(what)
            if req.Test():
                return
            waited = time.monotonic() - t0
            if self.timeout is not None and waited > self.timeout:
                raise RuntimeError(
                    f"rank {self.rank} waited {waited:.0f} s in {what} for the other ranks of its "
                    f"communicator ({CHECK_VARIABLE}={os.environ.get(CHECK_VARIABLE)}): some rank "
                    "never reached a collective of mpiattn (stuck, or in another program's part)")
            time.sleep(nap)  # yield at first (prompt peers), then nap up to 1 ms
            nap = 0.0 if waited < 2e-3 else min(1e-3, max(5e-5, 2 * nap))

    def allgather(self, obj: Any, what: str) -> list:
        """Every rank's small object ``obj`` (pickled), the wait polling for departure notices:
        the allgather of the entry check of every public call."""
        from mpi4py import MPI

        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self.wait(self.mpi.Iallgather([np.array([data.size], dtype=np.int64), MPI.INT64_T],
                                      [sizes, MPI.INT64_T]), what)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        every = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.mpi.Allgatherv([data, MPI.BYTE], [every, (sizes.tolist(), displs.tolist()), MPI.BYTE])
        return [pickle.loads(every[d:d + n].tobytes()) for d, n in zip(displs, sizes)]

    def point(self, what: str) -> None:
        """A collective is about to run: in the checking mode, compare every rank's call site
        first (raise :class:`~mpiattn.comm.errors.CallMismatch` on every rank when they
        differ); refuse a freed communicator or a departed rank in any mode."""
        self.live(what)
        if self._sites is None:
            return
        from mpi4py import MPI

        here = [what, *call_site()]
        raw = json.dumps(here).encode()[:SITE_BYTES]
        mine = np.zeros(SITE_BYTES, dtype=np.uint8)
        mine[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        every = np.empty((self.size, SITE_BYTES), dtype=np.uint8)
        self.wait(self._sites.Iallgather([mine, MPI.BYTE], [every, MPI.BYTE]), what)
        sites = [json.loads(row.tobytes().rstrip(b"\0") or b"null") for row in every]
        for r, site in enumerate(sites):
            if site != sites[0]:
                exc = errors.CallMismatch(
                    f"ranks reach different collectives of mpiattn ({CHECK_VARIABLE}): rank 0 is at "
                    f"{_site_text(sites[0])}, rank {r} at {_site_text(site)}; a decision that only "
                    "some ranks' data made chose whether (or which) collective runs")
                exc.tags = sites
                raise errors.mark(exc)

    # -------------------------------------------------------------- threads
    @contextlib.contextmanager
    def claim(self, what: str) -> Iterator[None]:
        """Hold the Comm for this thread inside the block (reentrant); another thread that holds
        it already ends the job (raises with one rank): see the module docstring."""
        me = threading.get_ident()
        with self._lock:
            other = self._owner is not None and self._owner != me
            if not other:
                self._owner, self._depth = me, self._depth + 1
                if self._depth == 1:
                    self._holding = what
            holding = self._holding
        if other:
            self._conflict(what, holding)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner, self._holding = None, ""

    def _conflict(self, what: str, holding: str) -> None:
        message = (f"mpiattn: two threads of rank {self.rank} use one communicator at once ({what} "
                   f"while another thread is in {holding}): MPI needs the collectives of a "
                   "communicator to come from one thread at a time; give each thread a "
                   "communicator of its own (comm.Dup()) and a plan made on it")
        if self.size == 1:
            raise RuntimeError(message)
        errors.abort_job(self.mpi, 1, message)
