"""The benchmark application of mpiattn (like ``mpi4py.bench``): ``python -m mpiattn bench``.

Modules, bottom to top (the library provides the rest: the strategies, the
engines, their cost and memory models and the dense reference from its
registries, the timer :class:`mpiattn.timing.Timer`, the inputs
:mod:`mpiattn.io.datagen`):

``tasks``
    :class:`~.tasks.Task` (one case) and :class:`~.tasks.Settings` (one
    job), their JSON form, the call's spec, the nominal FLOPs;
``memory``, ``environment``
    peak memory and the library's models of it; the machine;
``ceilings``, ``workloads``, ``products``
    the GEMM ceilings; attention (mpiattn's strategies and engines, the
    single-process ``dense`` and ``torch`` peers); the products suite;
``worker``
    what runs inside one MPI job;
``presets``, ``launcher``
    the suites and the tasks they expand to; fresh jobs per case and the
    memory curve;
``derive``, ``report``, ``plot``
    derived numbers (ceiling fractions, fraction of ideal, scaling,
    targets), the table, the PNGs;
``gpu``, ``masks``, ``decode``
    the GPU suite (``python -m mpiattn.bench.gpu``), the masks suite
    (``python -m mpiattn.bench.masks``) and the decode suite
    (``python -m mpiattn.bench.decode``);
``app``
    the options, the launch loop and everything ``python -m mpiattn bench``
    prints. Besides it only the ``main`` entry points of ``report``, ``plot``,
    ``gpu``, ``masks`` and ``decode`` print; the modules below hand back records and
    take a ``log`` callback.

The CLI imports this package only for its ``bench`` command and calls
:func:`add_arguments` and :func:`run`; importing it imports none of
matplotlib, psutil, torch or CuPy.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser`` (see :func:`mpiattn.bench.app.add_arguments`)."""
    from .app import add_arguments as add

    add(parser)


def run(args: argparse.Namespace, comm: Any = None) -> int:
    """Run the benchmark described by ``args``; returns an exit code (see :func:`mpiattn.bench.app.run`)."""
    from .app import run as run_app

    return run_app(args, comm)
