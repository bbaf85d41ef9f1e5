"""Collective error agreement: one rank's failure becomes the same error on every rank.

Two ways for a job to end cleanly when some rank fails:

* :func:`agree` / :func:`allgather_checked` around purely local work: every
  rank learns whether any rank failed and then raises the exception of the
  lowest failing rank (same type and message), so every rank takes the same
  branch and nobody waits in a collective the others never reach.
* :func:`abort_on_error` around communication: a rank that fails there may
  leave its peers blocked inside MPI, so it aborts the whole job.

These functions take an ``mpi4py.MPI.Intracomm`` and never import
``mpi4py.MPI`` at module import.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Any, Callable, Iterator

__all__ = ["CollectiveError", "agree", "allgather_checked", "abort_on_error", "raise_first"]


class CollectiveError(RuntimeError):
    """Raised on every rank when a rank failed with an exception that cannot be rebuilt."""


def _report(err: BaseException | None) -> tuple[type, str] | None:
    return None if err is None else (type(err), str(err))


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
        exc = cls(msg)
    except Exception:  # noqa: BLE001 - exotic constructor
        exc = CollectiveError(f"{cls.__name__}: {msg}")
    if err is not None:
        raise exc from err
    raise exc


@contextlib.contextmanager
def agree(mpi_comm: Any) -> Iterator[None]:
    """Make an exception raised inside the block be raised on every rank.

    The block must be purely local (no communication): a rank that raises
    skips the rest of it. At the end every rank learns whether any rank
    failed (one small allreduce) and, if so, every rank raises the exception
    of the lowest failing rank.
    """
    err: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised collectively below
        err = exc
    if mpi_comm.Get_size() == 1:
        if err is not None:
            raise err
        return
    from mpi4py import MPI

    if mpi_comm.allreduce(0 if err is None else 1, op=MPI.SUM):
        raise_first(mpi_comm.allgather(_report(err)), err)


def allgather_checked(mpi_comm: Any, fn: Callable[[], Any]) -> list:
    """Run the local function ``fn`` on every rank and allgather its results.

    One collective serves both: if ``fn`` raised on any rank, every rank
    raises the exception of the lowest failing rank (as :func:`agree` does);
    otherwise every rank gets the list of all ranks' results (small, pickled).
    """
    err: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised collectively below
        err = exc
    if mpi_comm.Get_size() == 1:
        if err is not None:
            raise err
        return [result]
    reports = mpi_comm.allgather((_report(err), result))
    if any(rep is not None for rep, _ in reports):
        raise_first([rep for rep, _ in reports], err)
    return [res for _, res in reports]


@contextlib.contextmanager
def abort_on_error(mpi_comm: Any) -> Iterator[None]:
    """Abort the whole job when the block raises on any rank (more than one rank).

    Used around communication-heavy sections, where a rank that stops early
    would leave its peers blocked in MPI forever. With one rank the exception
    propagates normally.
    """
    try:
        yield
    except BaseException as exc:
        size = mpi_comm.Get_size()
        if size == 1:
            raise
        sys.stderr.write(
            f"mpiattn: rank {mpi_comm.Get_rank()} of {size} failed during communication: "
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            "mpiattn: aborting the job so no rank waits forever\n")
        sys.stderr.flush()
        mpi_comm.Abort(1)
