"""Command line: ``python -m mpiattn [example | run | make-data | info | clean | plan | calibrate |
prefill | decode | bench]``.

Every rank parses the same ``argv`` and runs the same sequence of collective
steps; only rank 0 prints (a progress bar on terminals, progress lines
otherwise).

Exit codes: 0 success, 2 usage error (bad arguments, also those found only
once the input is known, such as ``--strategy ulysses`` with heads that do
not divide among the ranks), 1 runtime error (bad input file, unwritable
output, full disk, failed check, broken launch, ...), ``128 + N`` when
ended by signal ``N`` (SIGINT, SIGTERM, SIGHUP: see
:mod:`mpiattn.cli.signals`). Each error is printed once. Errors of the
collective steps are raised identically on every rank and carry the marker
:class:`mpiattn.comm.errors.Agreed`, so every rank returns the same code;
any other error (one rank only: a bug) is printed by that rank, which then
aborts the job so nothing hangs.

Before any work :func:`main` checks that the launcher and MPI agree on the
number of ranks and gives each rank its share of the node's cores for BLAS
(:mod:`mpiattn.cli.resources`). Run as the program (``argv`` None) it also
installs the signal handlers and, after an error that left an HDF5 file
open, ends the process without running HDF5's exit handlers (after a failed
write they may crash).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import traceback
import warnings
from typing import Any, Iterator

from ..comm.errors import Agreed
from ..comm.node import OversubscriptionWarning
from ..strategies import machines, registry
from ..strategies.machines import MachineFileError
from .calibrate import cmd_calibrate
from .commands import cmd_clean, cmd_example, cmd_info, cmd_make_data, cmd_run
from .inference import cmd_decode, cmd_prefill
from .plan import cmd_plan
from .common import PLUGINS, Console, UsageError, world_rank
from .parser import build_parser
from .quiet import QuietReleases
from .startup import NoMPI, init_mpi
from . import resources, signals

#: Commands that compute or write, and so check the launch and set the BLAS threads.
_WORKING = ("example", "run", "make-data", "info", "calibrate", "prefill", "decode")


def main(argv: list[str] | None = None, *, watcher: Any = None) -> int:
    """Run the command line; returns the exit code (0, 1 or 2) on every rank.

    Parameters
    ----------
    argv : list of str, optional
        The arguments. None (the program, ``python -m mpiattn``): ``sys.argv``;
        MPI is initialised first (:func:`mpiattn.cli.startup.init_mpi`), then
        the signals are handed to the run's guard for the rest of the process
        (:mod:`mpiattn.cli.signals`), and the process ends with ``os._exit``
        after an error that left an HDF5 file open (see :func:`_leave`).
    watcher : mpiattn.cli.startup.Watcher, optional
        The program's signal watcher, installed before the imports
        (:func:`mpiattn.cli.startup.program`); made here when None.
    """
    program = argv is None
    if program:
        try:
            init_mpi()  # until it returns, a signal ends the process at once
        except NoMPI as exc:
            if resources.launcher_rank() in (None, 0):
                print(f"mpiattn: error: {exc}", file=sys.stderr, flush=True)
            return 1
    rank = world_rank()
    guard = signals.install(watcher) if program else None
    con = Console(rank, guard=guard)
    args = _parse(sys.argv[1:] if program else list(argv), con)
    if isinstance(args, int):
        return args
    with QuietReleases():  # h5py's reports about a broken file would bury the one error line
        code = _main(args, con)
        if guard is not None:
            guard.hold()  # a signal is ending the process: its thread speaks and ends it
        if program and args.command not in PLUGINS:  # (a plugin's ranks may return different codes)
            _leave(code, guard)
    if guard is not None:
        guard.ignore()
    return code


def _parse(argv: list[str], con: Console) -> Any:
    """The parsed arguments, or the exit code (usage error, ``--help``, ``--version``)."""
    try:
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
            argv = ["example", *argv]  # options without a command belong to the example
        args = build_parser(argv[0]).parse_args(argv)
        con.quiet = bool(getattr(args, "quiet", False))
        con.tty = con.tty and not con.quiet
        return args
    except UsageError as exc:
        if con.rank == 0:
            sys.stderr.write(exc.usage + str(exc) + "\n")
            sys.stderr.flush()
        return 2
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0


def _main(args: Any, con: Console) -> int:
    threads = None
    try:
        if args.command in _WORKING or args.command in PLUGINS:
            from mpi4py import MPI

            problem = resources.launch_problem(MPI.COMM_WORLD.Get_size())
            if problem is not None:  # every process sees it alike: no communication
                if resources.launcher_rank() in (None, 0):
                    con.error(problem)  # the launcher's rank 0 speaks, for all
                return 1
        if args.command in PLUGINS:
            return int(importlib.import_module(PLUGINS[args.command][0]).run(args) or 0)
        with warnings.catch_warnings():
            if args.command in _WORKING:
                from .steps import world_comm

                from ..io.segments import forget_names

                forget_names(world_comm())  # a job killed from now on leaves no MPI segment file
                threads = resources.configure_threads(world_comm().node, getattr(args, "threads", None))
                args.threads_info = threads
                if threads.source == resources.REQUESTED:  # the user chose: no advice against it
                    warnings.simplefilter("ignore", OversubscriptionWarning)
                _machine_checked(args)
            yielding = contextlib.nullcontext()
            if con.guard is not None and args.command in _WORKING:  # an error that echoes a
                from .steps import world_comm                      # signal says nothing

                yielding = world_comm().cleanup_on_abort(con.guard.yield_to_a_signal)
            with _watching(args), yielding:
                return {"example": cmd_example, "run": cmd_run, "make-data": cmd_make_data,
                        "info": cmd_info, "clean": cmd_clean, "plan": cmd_plan,
                        "calibrate": cmd_calibrate, "prefill": cmd_prefill,
                        "decode": cmd_decode}[args.command](args, con)
    except UsageError as exc:
        con.error(str(exc))
        return 2
    except Exception as exc:  # noqa: BLE001 - turned into an exit code
        if isinstance(exc, Agreed):  # raised alike on every rank: every rank returns 1
            con.error(str(exc) or type(exc).__name__, isinstance(exc, (OSError, MemoryError)))
            return 2 if isinstance(exc, MachineFileError) else 1  # (a bad machine: bad input)
        return _unexpected(exc, con)
    finally:
        if threads is not None:
            threads.restore()


def _machine_checked(args: Any) -> None:
    """The machine file the cost model would read (``--machine``, else ``$MPIATTN_MACHINE``),
    read whole on every rank before any work: a bad one raises the same
    :class:`mpiattn.strategies.machines.MachineFileError` on every rank (exit code 2). Only
    where the strategy leaves the model a choice, as the library reads it only then."""
    if not hasattr(args, "machine") or not registry.needs_choice(args.strategy):
        return
    from .steps import world_comm

    with world_comm().collective_errors():
        machines.load(machines.resolve_name(args.machine, "numpy"))  # (a default is a profile)


@contextlib.contextmanager
def _watching(args: Any) -> Iterator[None]:
    """The command under a :class:`mpiattn.comm.watchdog.Watchdog` when ``--watchdog`` asks.

    It stops (collectively) when the command returns or raises an error every
    rank raises; after any other error it keeps watching until the abort that
    follows ends the job (stopping would wait for peers blocked in MPI).
    """
    seconds = getattr(args, "watchdog", None)
    if not seconds:
        yield
        return
    from ..comm.watchdog import Watchdog
    from .steps import world_comm

    dog = Watchdog(world_comm(), seconds).start()
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, Agreed):
            dog.stop()
        raise
    dog.stop()


def _leave(code: int, guard: signals.Guard | None) -> None:
    """The program's last collective step: late signals told, then a normal exit or ``os._exit``.

    Every rank returned the same code and is here. One allgather tells
    rank 0 whether a signal came too late to matter on some rank (it then
    says so, :meth:`mpiattn.cli.signals.Guard.finish`) and whether any rank
    still holds an HDF5 file. After a failed write HDF5 may hold a
    half-closed file whose clean-up at exit crashes (HDF5 2.0: a segfault in
    ``H5_term_library`` after a full disk), turning exit code 1 into a
    signal; then all leave together through ``os._exit`` right after a
    barrier. Otherwise every rank returns, to leave through Python's normal
    shutdown, which finalizes MPI and runs the MPI library's own exit
    handlers: Hydra (MPICH's ``mpiexec``) kills the ranks still running when
    one leaves without them, and a rank killed that way turns the job's
    exit code into 9.
    """
    from mpi4py import MPI

    h5py = sys.modules.get("h5py")
    held = bool(code) and h5py is not None and _hdf5_holds_files(h5py)
    if guard is not None:
        guard.sync()  # the signals received so far are handled: a late one is known
        guard.hold()
    late = None if guard is None else guard.late
    usable = MPI.Is_initialized() and not MPI.Is_finalized()
    world = MPI.COMM_WORLD if usable else None
    states = [(held, late)]
    if world is not None and world.Get_size() > 1:
        states = world.allgather((held, late))
    if guard is not None:
        guard.finish([s for _, s in states], code)
    if not any(h for h, _ in states):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
            pass
    if world is not None:
        world.Barrier()
    os._exit(code)


def _hdf5_holds_files(h5py) -> bool:
    """True when HDF5 has a file, or a dataset, group or attribute in one, still open.

    (Not ``get_obj_count()`` with its defaults: they also count the datatypes
    h5py itself keeps open from its import on, 24 to 30 of them.)
    """
    f = h5py.h5f
    return bool(f.get_obj_count(f.OBJ_ALL, f.OBJ_FILE | f.OBJ_DATASET | f.OBJ_GROUP | f.OBJ_ATTR))


def _unexpected(exc: BaseException, con: Console) -> int:
    """A failure on this rank alone: report it here and end the whole job."""
    from mpi4py import MPI

    con.hold()
    world = MPI.COMM_WORLD
    sys.stderr.write(f"mpiattn: error on rank {world.Get_rank()}: {type(exc).__name__}: {exc}\n"
                     f"{traceback.format_exc()}")
    sys.stderr.flush()
    if world.Get_size() > 1:
        from ..comm.errors import abort_job

        abort_job(world, 1, "mpiattn: aborting the job so no rank waits forever")
    return 1
