"""Command line: ``python -m mpiattn [example | run | make-data | info] ...``.

Every rank parses the same ``argv`` and runs the same sequence of collective
steps; only rank 0 prints (the progress bar only when stdout is a terminal).

Exit codes: 0 success, 2 usage error (bad arguments), 1 runtime error (bad
input file, unwritable output, failed check, ...). Each error is printed
once. Errors of the collective steps are raised identically on every rank,
so every rank returns the same code; an unexpected error on one rank only
(a bug) is printed by that rank, which then aborts the job so nothing hangs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback


from .commands import cmd_example, cmd_info, cmd_make_data, cmd_run
from .common import PLUGINS, Console, UsageError, world_rank
from .parser import build_parser



def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 1 or 2) on every rank."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = world_rank()
    con = Console(rank)
    try:
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
            argv = ["example", *argv]  # options without a command belong to the example
        args = build_parser(argv[0]).parse_args(argv)
        con.quiet = bool(getattr(args, "quiet", False))
        con.tty = con.tty and not con.quiet
    except UsageError as exc:
        if rank == 0:
            sys.stderr.write(exc.usage + str(exc) + "\n")
            sys.stderr.flush()
        return 2
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.command in PLUGINS:
            return int(importlib.import_module(PLUGINS[args.command][0]).run(args) or 0)
        return {"example": cmd_example, "run": cmd_run, "make-data": cmd_make_data,
                "info": cmd_info}[args.command](args, con)
    except UsageError as exc:
        con.error(str(exc))
        return 2
    except Exception as exc:  # noqa: BLE001 - turned into an exit code
        if getattr(exc, "mpiattnagreed", False):
            con.error(str(exc) or type(exc).__name__)
            return 1
        return _unexpected(exc)


def _unexpected(exc: BaseException) -> int:
    """A failure on this rank alone: report it here and end the whole job."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sys.stderr.write(f"mpiattn: error on rank {world.Get_rank()}: {type(exc).__name__}: {exc}\n"
                     f"{traceback.format_exc()}")
    sys.stderr.flush()
    if world.Get_size() > 1:
        sys.stderr.write("mpiattn: aborting the job so no rank waits forever\n")
        sys.stderr.flush()
        world.Abort(1)
    return 1


