"""Command line: ``python -m mpiattn [example | run | make-data | info | clean | bench] ...``.

Modules: ``common`` (constants, console, usage error, error agreement),
``parser``, ``check`` (the float64 ``--check``), ``signals`` (SIGINT, SIGTERM,
SIGHUP: clean up, one message, abort the job), ``resources`` (launch sanity,
BLAS threads), ``steps`` (device, compute, write, check), ``commands``,
``main`` (exit codes).
"""

from __future__ import annotations

from .common import EXAMPLE_ATTR, EXAMPLE_OUTPUT, UsageError
from .main import main
from .parser import build_parser

__all__ = ["main", "build_parser", "EXAMPLE_OUTPUT", "EXAMPLE_ATTR", "UsageError"]
