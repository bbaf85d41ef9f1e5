"""Atomic outputs: a file appears complete under its name, or not at all.

Every output (attention results, layer checkpoints) is written inside a
temporary directory ``.NAME.mpiattn-XXXX.tmp/`` beside ``NAME`` and given
its name by rank 0 only after every rank has reported success and voted to
publish (:func:`write_atomically`). A failure leaves no partial file under
``NAME`` and a previous ``NAME`` untouched, and the temporary is removed.
Without ``force`` an existing ``NAME`` is never replaced, even one that
appears while the output is written (a hard link, not a check and a
rename). The temporary is locked by its writer while it exists, so the
temporaries of writers that died (SIGKILL) can be told apart and removed
later (:mod:`mpiattn.io.temporaries`); a signal handler removes those of
its own run (:mod:`mpiattn.io.publishing`). The free space is checked first
when the size of the output is known.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..comm import errors
from ..comm.core import Comm, get_comm
from .naming import NEW, REPLACE, Rule, check_target
from .paths import missing
from .publishing import Outputs

__all__ = ["on_rank0", "check_output", "check_space", "check_targets", "write_atomically", "publish",
           "Target",
           "space_needed", "NoSpaceError"]


def on_rank0(c: Any, fn: Callable[[], Any], *, share: bool = True) -> Any:
    """Run the local ``fn`` on rank 0; its error is raised on every rank.

    Returns its result, broadcast to every rank (``share``), or on rank 0
    only (None elsewhere).
    """
    result = None
    with c.collective_errors():
        if c.rank == 0:
            result = fn()
    return c.bcast_obj(result) if c.size > 1 and share else result


def _output_problem(path: str, force: bool) -> None:
    """Raise when ``path`` cannot be (over)written: local checks plus a probe file."""
    directory = os.path.dirname(path) or "."
    problem = missing(directory, "output directory")
    if problem is not None:
        raise problem
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"output directory {directory} is not a directory")
    if os.path.isdir(path):
        raise IsADirectoryError(f"output {path} is a directory")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"output {path} already exists (overwrite with force=True, "
                              "--force on the command line)")
    probe = os.path.join(directory, f".mpiattn-probe-{uuid.uuid4().hex[:12]}")
    try:
        with open(probe, "x"):
            pass
    except OSError as exc:
        raise PermissionError(f"cannot create files in output directory {directory}: "
                              f"{exc.strerror or exc}") from None
    os.remove(probe)


class NoSpaceError(OSError):
    """Not enough free space for an output (``errno.ENOSPC``), found before or while writing."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def space_needed(nbytes: int) -> int:
    """Bytes of free space required for an output of ``nbytes`` bytes of data.

    The data plus 5 % and 4 MiB for HDF5's metadata (chunk indexes, headers);
    an output being replaced is kept until the new one is complete, so its
    space does not count as free.
    """
    return int(nbytes) + int(nbytes) // 20 + (4 << 20)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _space_problem(path: str, nbytes: int) -> None:
    directory = os.path.dirname(path) or "."
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    need = space_needed(nbytes)
    if need > free:
        raise NoSpaceError(f"not enough free space for {path}: the output needs about "
                           f"{_fmt(need)} ({_fmt(nbytes)} of data plus a margin), {directory} "
                           f"has {_fmt(free)} free")


def check_space(path: str, nbytes: int, comm: Any = None) -> None:
    """Check that ``path``'s directory has room for ``nbytes`` of output (rank 0 checks).

    Raises
    ------
    NoSpaceError
        On every rank, naming the sizes.
    """
    c = get_comm(comm)
    on_rank0(c, lambda: _space_problem(os.path.abspath(path), nbytes))


def check_output(path: str, comm: Any = None, *, force: bool = False,
                 nbytes: int | None = None) -> None:
    """Check, before computing, that ``path`` can be written (rank 0 checks; same error everywhere).

    Parameters
    ----------
    path : str
    comm : mpi4py.MPI.Intracomm, optional
    force : bool
        An existing ``path`` may be replaced.
    nbytes : int, optional
        The size of the output's data, when known: also check the free
        space (:func:`space_needed`).

    Raises
    ------
    FileNotFoundError
        The directory does not exist.
    PermissionError
        No file can be created in the directory.
    FileExistsError
        ``path`` exists and ``force`` is False.
    IsADirectoryError
        ``path`` is a directory.
    NoSpaceError
        Not enough free space for ``nbytes``.
    """
    c = get_comm(comm)
    path = os.path.abspath(path)

    def problem() -> None:
        _output_problem(path, force)
        if nbytes is not None:
            _space_problem(path, nbytes)
    on_rank0(c, problem)


def _disk_full(exc: BaseException) -> bool:
    """An ENOSPC error (also as rebuilt on other ranks from its message) not yet explained."""
    if not isinstance(exc, OSError) or isinstance(exc, NoSpaceError):
        return False
    return exc.errno == errno.ENOSPC or str(exc).startswith(f"[Errno {errno.ENOSPC}]")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Target:
    """One file of an atomic publication (:func:`publish`).

    Attributes
    ----------
    path : str
        The final name (made absolute).
    write : callable(tmp) or None
        Writes the whole file under the temporary name ``tmp`` (the same on
        every rank); called on every rank. It must raise the same exception
        on every rank or none (or abort the job through the Comm). None for
        a target that is only checked (:func:`check_targets`).
    rule : mpiattn.io.naming.Rule
        How it takes its name: never over an existing file (``NEW``), over
        any (``REPLACE``: ``force``), or over the very file this run read
        (``Rule.grows(identity)``).
    nbytes : int, optional
        The size of its data, when known: the free space is checked first.
    """

    path: str
    write: Callable[[str], None] | None
    rule: Rule = NEW
    nbytes: int | None = None


def _targets_problem(targets: Sequence[Target]) -> None:
    """Raise when a target cannot be written (rank 0): each path, then the space per file system."""
    need: dict[int, tuple[str, int]] = {}
    for t in targets:
        _output_problem(t.path, t.rule.replace)
        check_target(t.path, t.rule)
        if t.nbytes is not None:
            directory = os.path.dirname(t.path) or "."
            dev = os.stat(directory).st_dev
            first, total = need.get(dev, (t.path, 0))
            need[dev] = (first, total + int(t.nbytes))
    for path, nbytes in need.values():
        _space_problem(path, nbytes)


def check_targets(c: Comm, targets: Sequence[Target]) -> None:
    """Check, before computing, that every target can be written as its rule says (rank 0 checks;
    the same error on every rank): directories, existing files, identities, free space."""
    on_rank0(c, lambda: _targets_problem([Target(os.path.abspath(t.path), t.write, t.rule,
                                                 t.nbytes) for t in targets]))


def publish(c: Comm, targets: Sequence[Target], *, outputs: Outputs | None = None) -> None:
    """Write files collectively, then give them their names together (collective).

    Parameters
    ----------
    c : Comm
    targets : sequence of Target
        Files published together: every one of them, or none. Their
        directories, free space and rules are checked before anything is
        written.
    outputs : Outputs, optional
        The program's outputs (:class:`mpiattn.io.publishing.Outputs`),
        whose :meth:`~mpiattn.io.publishing.Outputs.stop` a signal handler
        calls; a private one by default.

    Raises
    ------
    Exception
        Whatever a ``write`` raised, or the publishing error, on every rank;
        every target is then as it was and the temporaries are removed.

    Notes
    -----
    Rank 0 reserves a temporary directory per file with a lock it holds
    until the directory is gone (:class:`mpiattn.io.temporaries.Temporary`);
    every rank notes their names in ``outputs``, so that a signal handler on
    any rank can remove them, and so does an abort through ``c``. Once all
    are written, every rank votes to publish them; rank 0 learning that
    every rank voted is the commit point (:mod:`mpiattn.io.publishing`),
    after which rank 0 names them (:func:`mpiattn.io.naming.publish_together`).
    """
    targets = [Target(os.path.abspath(t.path), t.write, t.rule, t.nbytes) for t in targets]
    outputs = Outputs() if outputs is None else outputs
    on_rank0(c, lambda: _targets_problem(targets))
    tmps: list = []

    def reserve() -> list:
        for t in targets:
            tmps.append(outputs.reserve(t.path))
        return tmps
    try:
        own = on_rank0(c, reserve, share=False)
    except Exception:
        for tmp in tmps:  # rank 0: those reserved before the failure
            outputs.discard(tmp, remove=True)
        raise
    names = c.bcast_obj([tmp.dir for tmp in own] if c.rank == 0 else None) if c.size > 1 \
        else [tmp.dir for tmp in own]
    tmps = own if c.rank == 0 else [outputs.adopt(name) for name in names]
    group = [(tmp, t.path) for tmp, t in zip(tmps, targets)]

    def name_them() -> None:
        for tmp in tmps:
            _fsync(tmp.data)
        try:
            outputs.publish([(tmp, t.path, t.rule) for tmp, t in zip(tmps, targets)])
        except FileExistsError as exc:
            raise FileExistsError(f"output {exc.filename} appeared while this run was "
                                  "writing it; not replaced (overwrite with force=True, --force on "
                                  "the command line)") from None

    try:
        with c.cleanup_on_abort(outputs.remove_all):
            for tmp, t in zip(tmps, targets):
                t.write(tmp.data)
        with c.collective_errors():
            outputs.vote(group)  # a rank stopped by a signal never votes
        outputs.decided(group)  # the commit point, as rank 0 sees it: unless rank 0 revoked it
        on_rank0(c, name_them)
    except Exception as exc:  # raised identically on every rank: clean up, then let everyone raise
        for tmp in tmps:
            outputs.discard(tmp, remove=c.rank == 0)
        c.barrier()  # nobody returns before the temporary files are gone
        if _disk_full(exc):
            where = ", ".join(t.path for t in targets)
            raise errors.mark(NoSpaceError(f"the disk filled up while writing {where} (No space "
                                           "left on device); nothing was written under that "
                                           "name")) from exc
        marked = errors.mark(exc)
        if marked is exc:
            raise
        raise marked from exc.__cause__
    except BaseException:
        for tmp in tmps:
            outputs.discard(tmp, remove=c.rank == 0)
        raise
    outputs.settle(group)


def write_atomically(c: Comm, path: str, write: Callable[[str], None], *, force: bool = False,
                     nbytes: int | None = None, outputs: Outputs | None = None) -> None:
    """Run the collective ``write(tmp)``, then publish ``tmp`` as ``path`` (collective).

    One file of :func:`publish`: ``force`` replaces an existing ``path``
    (atomically: ``os.replace``); without it an existing ``path`` is never
    replaced, however late it appears (a hard link, which fails if the name
    exists). ``nbytes``: the size of the data, for the free-space check.
    """
    publish(c, [Target(path, write, REPLACE if force else NEW, nbytes)], outputs=outputs)
