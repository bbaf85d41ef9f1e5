"""Command line: ``python -m mpiattn [example | run | make-data | info | clean | bench] ...``.

Modules: ``common`` (constants, console, usage error, error agreement),
``parser``, ``check`` (the float64 ``--check``), ``signals`` (SIGINT, SIGTERM,
SIGHUP: clean up, one message, abort the job), ``startup`` (the first steps of the program:
signals caught from the start, MPI initialised), ``resources`` (launch sanity,
BLAS threads), ``steps`` (device, compute, write, check), ``commands``,
``dispatch`` (the commands, exit codes; ``main``).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule (imported on first use: ``mpiattn.cli.startup`` must stay light, it
# runs before the heavy imports)
_EXPORTS = {"main": "dispatch", "build_parser": "parser", "EXAMPLE_OUTPUT": "common",
            "EXAMPLE_ATTR": "common", "UsageError": "common"}

__all__ = ["main", "build_parser", "EXAMPLE_OUTPUT", "EXAMPLE_ATTR", "UsageError"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'mpiattn.cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
