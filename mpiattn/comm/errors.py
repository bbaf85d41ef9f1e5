"""Collective error agreement: one rank's failure becomes the same error on every rank.

Two ways for a job to end cleanly when some rank fails:

* :func:`agree` / :func:`allgather_checked` around purely local work: every
  rank learns whether any rank failed and then raises the exception of the
  lowest failing rank (same type and message), so every rank takes the same
  branch and nobody waits in a collective the others never reach. Checks on
  data every rank holds (gathered metadata) raise inside :func:`alike`, or
  through :func:`same_everywhere` / :func:`same_fields` ("ranks disagree on
  ..."). All these errors carry the marker :class:`Agreed`; anything else a
  rank raises is its own failure.
* :func:`abort_on_error` around communication: a rank that fails there may
  leave its peers blocked inside MPI, so it aborts the whole job.

An abort (:func:`abort_job`) first runs the clean-up hooks it is given (the
I/O layer's removal of the temporary files being written), and it never
runs C exit handlers: HDF5's, for one, would close files that are
still open, a collective call inside an abort (a hang or an assertion).

These functions take an ``mpi4py.MPI.Intracomm`` and never import
``mpi4py.MPI`` at module import.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import numpy as np

__all__ = ["CollectiveError", "CallMismatch", "Agreed", "mark", "alike", "same_everywhere", "same_fields", "agree",
           "allgather_checked", "abort_on_error", "raise_first", "claim_ending", "abort_job",
           "DEFER_S", "SETTLE_S"]

#: Seconds a rank other than 0 waits before it aborts a job: when every rank
#: fails (a full disk, a signal sent to all), rank 0's abort comes first and
#: its message is the only one.
DEFER_S = 3.0

#: Seconds rank 0 waits before it aborts a job over an environmental error
#: (``OSError``, ``MemoryError``). Such an error is often the echo of a
#: signal on another rank (whose handler removed the temporary file being
#: written collectively); when the signal reaches rank 0 meanwhile, its
#: handler ends the job and names the signal, and this error stays silent.
SETTLE_S = 1.0

#: Seconds between the last words of an aborting rank and the abort, so that the launcher
#: (which relays every rank's output) has passed them on before it kills the job.
FORWARD_S = 0.5

#: Held by the thread that ends this process (:func:`claim_ending`), for good.
_ENDING = threading.Lock()


class CollectiveError(RuntimeError):
    """Raised on every rank when a rank failed with an exception that cannot be rebuilt."""


class CallMismatch(RuntimeError):
    """Raised on every rank when the ranks are in different collective calls (:func:`allgather_checked`).

    ``tags`` holds every rank's tag.
    """

    tags: list = []


class Agreed:
    """The marker of an exception raised alike on every rank (mixed into its class).

    Every error that mpiattn decides collectively carries it: those of
    :func:`agree` and :func:`allgather_checked`, and those raised inside
    :func:`alike` from data every rank holds. ``isinstance(exc, Agreed)``
    tells a caller (the command line) that every rank raises the same
    exception, so nobody is left waiting; the exception keeps its own type
    (``except ValueError`` still catches it).
    """


def mark(exc: BaseException) -> BaseException:
    """``exc`` as an instance of a subclass of its own type that also is :class:`Agreed`.

    The message, arguments, cause and attributes are kept; ``exc`` itself
    when it is marked already.
    """
    if isinstance(exc, Agreed):
        return exc
    cls = type(exc)
    marked = type(cls.__name__, (cls, Agreed), {"__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
    try:
        new = cls.__new__(marked, *exc.args)
        new.args = exc.args
        new.__dict__.update(getattr(exc, "__dict__", {}))
        if isinstance(exc, OSError):
            for attr in ("errno", "strerror", "filename", "filename2"):
                if getattr(exc, attr) is not None:  # (None would change how it prints)
                    setattr(new, attr, getattr(exc, attr))
    except Exception:  # noqa: BLE001 - a class that cannot be derived: tell it as ours
        new = type("CollectiveError", (CollectiveError, Agreed), {})(f"{cls.__name__}: {exc}")
    new.__cause__, new.__context__ = exc.__cause__, exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    return new.with_traceback(exc.__traceback__)


def _plain(cls: type) -> type:
    """The user-visible class of a (possibly marked) exception class."""
    return next(c for c in cls.__mro__ if Agreed not in c.__mro__) if issubclass(cls, Agreed) else cls


@contextlib.contextmanager
def alike() -> Iterator[None]:
    """Mark the exceptions of a block that runs on data every rank holds (no communication).

    For checks on gathered metadata: every rank takes the same branch and
    raises the same exception, which this marks :class:`Agreed`.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised, marked
        marked = mark(exc)
        if marked is exc:
            raise
        raise marked from None


def same_everywhere(values: list, what: str, show: Callable[[Any], str] = repr) -> None:
    """Raise (marked, every rank alike) unless every rank's entry of ``values`` equals rank 0's.

    ``values`` is gathered (the same list on every rank); ``what`` names the
    thing compared, e.g. ``"the layout"``; the message names the first rank
    that differs: ``ranks disagree on the layout: rank 0 has X, rank 2 has Y``.
    """
    for r, value in enumerate(values):
        if value != values[0]:
            raise mark(ValueError(f"ranks disagree on {what}: rank 0 has {show(values[0])}, "
                                  f"rank {r} has {show(value)}"))


def same_fields(got: list, what: str = "") -> None:
    """Raise (marked, every rank alike) unless every rank's dict in the gathered ``got`` equals rank
    0's on each field whose name does not start with ``_`` (in the order of rank 0's dict).

    The message names the field (prefixed with ``what``) and the first rank that differs:
    ``ranks disagree on window: rank 0 has (1, 0), rank 2 has (2, 0)``.
    """
    for name in got[0]:
        if not name.startswith("_"):
            same_everywhere([g.get(name) for g in got], f"{what}{name}")


def _report(err: BaseException | None) -> tuple[type, str] | None:
    return None if err is None else (_plain(type(err)), str(err))


def raise_first(reports: list, err: BaseException | None) -> None:
    """Raise, identically on every rank, the first of the ranks' ``(type, message)`` reports.

    Parameters
    ----------
    reports : list of (type, str) or None
        One entry per rank, None where that rank succeeded; the same list on
        every rank.
    err : BaseException or None
        This rank's own exception, chained as the cause.
    """
    failed = sum(rep is not None for rep in reports)
    first = next(r for r, rep in enumerate(reports) if rep is not None)
    cls, msg = reports[first]
    if failed > 1 or first != 0:
        others = f" and {failed - 1} other rank(s)" if failed > 1 else ""
        msg = f"{msg} (raised on rank {first}{others})"
    try:
        exc = mark(cls(msg))
    except Exception:  # noqa: BLE001 - exotic constructor
        exc = mark(CollectiveError(f"{cls.__name__}: {msg}"))
    if err is not None:
        raise exc from err
    raise exc


@contextlib.contextmanager
def agree(mpi_comm: Any, before: Callable[[], Any] | None = None) -> Iterator[None]:
    """Make an exception raised inside the block be raised on every rank.

    The block must be purely local (no communication): a rank that raises
    skips the rest of it. At the end every rank learns whether any rank
    failed (one small allreduce) and, if so, every rank raises the exception
    of the lowest failing rank. A ``KeyboardInterrupt`` counts as a failure:
    every rank then raises ``KeyboardInterrupt`` (marked), so a program's own
    ``except KeyboardInterrupt`` and ``finally`` run on every rank. ``before()`` runs
    just before that allreduce (with more than one rank: a Comm's collective checks).
    """
    err: BaseException | None = None
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - re-raised collectively below
        err = exc
    if mpi_comm.Get_size() == 1:
        if err is not None:
            raise mark(err) from err.__cause__
        return
    from mpi4py import MPI

    if before is not None:
        before()
    failed = np.array([0 if err is None else 1], dtype=np.int64)
    # (a buffer Allreduce: it releases Python's lock while it waits, as mpi4py's pickled
    # allreduce does not the first time on a communicator, starving the watchdog's thread)
    mpi_comm.Allreduce(MPI.IN_PLACE, [failed, MPI.INT64_T], op=MPI.SUM)
    if failed[0]:
        raise_first(mpi_comm.allgather(_report(err)), err)


def allgather_checked(mpi_comm: Any, fn: Callable[[], Any], tag: Any = None,
                      gather: Callable[[Any], list] | None = None) -> list:
    """Run the local function ``fn`` on every rank and allgather its results.

    One collective serves both: if ``fn`` raised on any rank, every rank
    raises the exception of the lowest failing rank (as :func:`agree` does);
    otherwise every rank gets the list of all ranks' results (small, pickled).

    ``tag`` ``(call, number)`` names the collective call this check opens
    (:meth:`mpiattn.comm.core.Comm.allgather_checked` counts them per
    communicator): ranks whose tags differ are in different calls (a rank
    skipped one, or caught an error the others did not see), and every rank
    raises the same RuntimeError naming them, instead of going on with
    mismatched messages. A ``KeyboardInterrupt`` inside ``fn`` is agreed
    like an error: every rank raises ``KeyboardInterrupt`` (it cannot leave
    the others waiting here). ``gather(obj)``: the allgather of small objects to
    use (default ``mpi_comm.allgather``; a Comm passes its polled one).
    """
    err: BaseException | None = None
    result = None
    try:
        result = fn()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - re-raised collectively below
        err = exc
    if mpi_comm.Get_size() == 1:
        if err is not None:
            raise mark(err) from err.__cause__
        return [result]
    reports = (gather or mpi_comm.allgather)((tag, _report(err), result))
    tags = [t for t, _, _ in reports]
    for r, t in enumerate(tags):
        if t != tags[0]:
            exc = mark(CallMismatch(f"ranks are in different collective calls: rank 0 is in "
                                    f"{_call(tags[0])}, rank {r} in {_call(t)}; every rank must "
                                    "make the same mpiattn calls on a communicator, in the same "
                                    "order (a rank that skipped one, e.g. a backward that runs "
                                    "on some ranks only, or caught an error the others did not "
                                    "get)"))
            exc.tags = tags
            raise exc from err
    if any(rep is not None for _, rep, _ in reports):
        raise_first([rep for _, rep, _ in reports], err)
    return [res for _, _, res in reports]


def _call(tag: Any) -> str:
    if isinstance(tag, tuple) and len(tag) == 2:
        return f"{tag[0]} (its call {tag[1]} on this communicator)"
    return repr(tag)


@contextlib.contextmanager
def abort_on_error(mpi_comm: Any, hooks: Sequence[Callable[[], Any]] = ()) -> Iterator[None]:
    """Abort the whole job when the block raises on any rank (more than one rank).

    Used around communication-heavy sections, where a rank that stops early
    would leave its peers blocked in MPI forever. With one rank the exception
    propagates normally. The failing rank prints one message (with the
    traceback for errors that look like bugs); ranks other than 0 wait
    :data:`DEFER_S` seconds first, so that when every rank fails only rank
    0's message appears, and rank 0 waits :data:`SETTLE_S` seconds before
    reporting an environmental error, so that a signal arriving at the same
    time is what the message names. A ``KeyboardInterrupt`` (Ctrl-C) here
    ends the job with exit code 130: the other ranks may be inside MPI
    waiting for this one, where no Python exception can reach them. An
    :class:`Agreed` exception (raised alike on every rank at one collective
    point, e.g. the collective checking mode's :class:`CallMismatch`) needs no
    abort: it propagates.
    """
    try:
        yield
    except BaseException as exc:
        size = mpi_comm.Get_size()
        if size == 1 or isinstance(exc, Agreed):
            raise
        rank = mpi_comm.Get_rank()
        interrupted = isinstance(exc, KeyboardInterrupt)
        bug = not isinstance(exc, (OSError, MemoryError, KeyboardInterrupt))
        time.sleep(DEFER_S if rank else (0.0 if bug else SETTLE_S))
        if interrupted:
            abort_job(mpi_comm, 130, f"mpiattn: interrupted (KeyboardInterrupt) on rank {rank} of "
                                     f"{size} inside a collective call: ending every rank (exit code "
                                     "130), since the others may be waiting inside MPI for this one",
                      hooks=hooks)
        abort_job(mpi_comm, 1,
                  f"mpiattn: error: rank {rank} of {size} failed during communication: "
                  f"{type(exc).__name__}: {exc}; aborting the job so no rank waits forever\n"
                  + (traceback.format_exc() if bug else ""), hooks=hooks)


def claim_ending() -> bool:
    """Make the calling thread the one that ends this process (False: another thread is).

    A later :func:`abort_job` from any other thread then waits, silent, for
    the claimant to end the process; the claimant passes ``claimed=True``.
    """
    return _ENDING.acquire(blocking=False)


def _skip_exit_handlers(code: int) -> None:
    """Make a later C ``exit()`` end the process at once (glibc; best effort).

    MPI_Abort may end the process through ``exit()``, which runs the C exit
    handlers; HDF5's closes open files (collectively, for parallel HDF5). A
    handler registered now runs before those registered earlier, and calls
    ``_exit``.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: os._exit(code))
        _skip_exit_handlers.keep = hook  # type: ignore[attr-defined] - must outlive this call
        libc.__cxa_atexit(hook, None, None)
    except Exception:  # noqa: BLE001 - not glibc: nothing to do
        pass


def abort_job(mpi_comm: Any, code: int, message: str = "", *,
              hooks: Sequence[Callable[[], Any]] = (), claimed: bool = False) -> None:
    """End this process and, through ``MPI_Abort`` on ``COMM_WORLD``, the whole job; never returns.

    Runs ``hooks`` (local, quick clean-ups), writes ``message`` to stderr,
    and never runs Python's or C's exit handlers (no HDF5 collective after
    an abort). Safe from any thread: the first caller (or the thread that
    :func:`claim_ending` and passes ``claimed``) wins; later ones wait. The job
    is aborted through ``MPI_COMM_WORLD`` whatever ``mpi_comm`` is (MPICH
    merely exits a process that aborts a duplicate, and the launcher then
    kills its peers with SIGKILL). With one rank in ``mpi_comm``, or where
    MPI is not (or no longer) initialised, or MPI was not initialised for
    threads and this is not the main thread, the process just exits with
    ``code``.
    """
    if not claimed and not _ENDING.acquire(blocking=True, timeout=30):
        os._exit(code)
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - an abort must go on
            pass
    if message:
        try:
            sys.stderr.write(message if message.endswith("\n") else message + "\n")
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    _skip_exit_handlers(code)
    try:
        from mpi4py import MPI

        usable = MPI.Is_initialized() and not MPI.Is_finalized()
        if usable and threading.current_thread() is not threading.main_thread():
            usable = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if usable and mpi_comm is not None and mpi_comm.Get_size() > 1:
            if message:
                time.sleep(FORWARD_S)  # the launcher relays our stderr; an abort may cut it off
            MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)
