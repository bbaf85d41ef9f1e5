"""Command line: ``python -m mpiattn [example | run | make-data | info | clean | bench] ...``.

Modules: ``common`` (constants, console, usage error, error agreement),
``parser``, ``check`` (the float64 ``--check``), ``signals`` (SIGINT, SIGTERM,
SIGHUP: clean up, one message, abort the job), ``startup`` (the first steps of the program:
signals caught from the start, MPI initialised), ``resources`` (launch sanity,
BLAS threads), ``steps`` (device, compute, write, check), ``commands``,
``dispatch`` (the commands, exit codes; ``main``).
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# public name -> submodule (imported on first use: ``mpiattn.cli.startup`` must stay light, it
# runs before the heavy imports)
_EXPORTS = {"main": "dispatch", "build_parser": "parser", "EXAMPLE_OUTPUT": "common",
            "EXAMPLE_ATTR": "common", "UsageError": "common"}

__all__ = ["main", "build_parser", "EXAMPLE_OUTPUT", "EXAMPLE_ATTR", "UsageError"]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
