"""What every CLI module shares: constants, the usage error, rank 0's console."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from ..io import Outputs
from ..masks import ALIGNMENTS


#: Output of ``python -m mpiattn`` with no arguments (in the current directory).
EXAMPLE_OUTPUT = "mpiattn-example-out.h5"
#: Root attribute marking a file written by the example (the only kind it overwrites).
EXAMPLE_ATTR = "mpiattn_example"
#: make-data arguments of the bundled example (``mpiattn/data/example.h5``).
EXAMPLE_SPEC = dict(batch=1, heads=4, kv_heads=2, seq=1024, kv_seq=1024, dim=16, value_dim=16,
                    dtype="float32", with_dout=True, padding=0.1, seed=2024)
#: Relative tolerance of ``--check`` per compute dtype (max error / max |reference|).
CHECK_TOL = {"bfloat16": 2.4e-1, "float16": 3e-2, "float32": 1e-4, "float64": 1e-10}  # bf16: 8x float16's epsilon
#: Optional subcommands of other modules: name -> (module with add_arguments(parser) and
#: run(args) -> exit code, one-line help). The module is imported only when its command runs.
PLUGINS = {"bench": ("mpiattn.bench", "benchmarks: mpiattn against GEMM and peers (see bench --help)")}


class UsageError(Exception):
    """Bad command-line arguments (exit code 2)."""

    def __init__(self, message: str, usage: str = ""):
        super().__init__(message)
        self.usage = usage


def world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` and prints help on rank 0 only.

    ``--causal`` takes an optional alignment (``--causal bottom-right``); a
    word after it that is not an alignment is left to the next argument
    (``run --causal in.h5 -o out.h5`` reads ``in.h5`` as the input).
    """

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        causal = self._option_string_actions.get("--causal")
        if args is not None and causal is not None and causal.nargs == "?":
            args = list(args)
            for i, word in enumerate(args[:-1]):
                after = args[i + 1]
                if word == "--causal" and not after.startswith("-") and after not in ALIGNMENTS:
                    args[i] = "--causal=top-left"
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}", self.format_usage())

    def _print_message(self, message: str, file: Any = None) -> None:
        if world_rank() == 0:
            super()._print_message(message, file)


#: Off terminals, progress lines appear only for phases running longer than this (seconds).
PROGRESS_AFTER_S = 5.0


class Console:
    """Rank 0's output: messages (unless quiet), errors, progress; and the run's outputs.

    Progress is a bar on terminals; elsewhere (a batch job's log) a line
    every 10 % for phases that run longer than :data:`PROGRESS_AFTER_S`.
    With a signal guard (:class:`mpiattn.cli.signals.Guard`, the program
    only) the console says nothing once a signal is ending the process
    (that signal's message is the only one), and its :attr:`outputs` are
    the guard's, which the signal stops.
    """

    def __init__(self, rank: int, quiet: bool = False, guard: Any = None):
        self.rank, self.quiet, self.guard = rank, quiet, guard
        self.tty = rank == 0 and not quiet and sys.stdout.isatty()
        #: Every write of the run goes through these (:class:`mpiattn.io.Outputs`).
        self.outputs = guard.outputs if guard is not None else Outputs()

    def hold(self) -> None:
        """Wait for good when a signal is ending the process (its thread speaks)."""
        if self.guard is not None:
            self.guard.hold()

    def doing(self, text: str) -> None:
        """What the run does now, for a signal's message (e.g. ``"while writing the output"``)."""
        if self.guard is not None:
            self.guard.phase = text

    def say(self, msg: str = "") -> None:
        if self.rank == 0 and not self.quiet and (self.guard is None or self.guard.fired is None):
            print(msg, flush=True)

    def error(self, msg: str, environmental: bool = False) -> None:
        """Rank 0 prints ``msg`` as the run's error (once a signal ends the run: nothing).

        ``environmental`` (an OSError, a full disk): first let a signal on
        another rank be heard (:meth:`mpiattn.cli.signals.Guard.settle`).
        """
        if environmental and self.guard is not None:
            self.guard.settle()
        self.hold()
        if self.rank == 0:
            print(f"mpiattn: error: {msg}", file=sys.stderr, flush=True)

    def progress(self, label: str) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback: a bar on terminals, lines every 10 % elsewhere."""
        last = [0.0]
        start = time.monotonic()
        decile = [0]

        def update(done: int, total: int) -> None:
            if not self.tty:
                if self.rank != 0 or self.quiet or total <= 0:
                    return
                now = time.monotonic()
                step = 10 * min(done, total) // total
                if step > decile[0] and now - start >= PROGRESS_AFTER_S:
                    decile[0] = step
                    print(f"  {label:9s}{100 * done // total:3d} % ({done}/{total} steps, "
                          f"{now - start:.0f} s)", flush=True)
                return
            now = time.monotonic()
            if done < total and now - last[0] < 0.1:
                return
            last[0] = now
            width = 30
            fill = width * done // max(total, 1)
            sys.stdout.write(f"\r  {label:9s}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
            if done >= total:
                sys.stdout.write("\n")
            sys.stdout.flush()

        return update
