"""The engines, in one registry, and the rule that picks one for a call.

``native``
    mpiattn's own blocked kernels (:mod:`mpiattn.kernels.native_engine`):
    every dtype, device and mask; the reference.
``fused``
    the native engine with the fused CuPy kernels of :mod:`mpiattn.kernels.fused`
    (CuPy only): a tile's elementwise work in one kernel each way;
``torch``
    torch's fused flash-attention kernels on the same memory
    (:mod:`mpiattn.kernels.torch_engine`): NumPy float16/32/64 and CuPy
    float16/32 (head dims multiples of 8), causal and padding masks; torch
    is imported only when this engine is asked for.

The ``auto`` rule is deterministic: the same call, with the same installed
packages and configuration, picks the same engine, whatever else the process
imported before. It picks ``native``: the reference, which supports every
case, and on the CPU runs at 0.90-1.03x the speed of torch's own fused
kernel (``benchmarks/engines/``), so choosing torch would buy little and
would make a NumPy call import torch (seconds, hundreds of MiB). The torch
engine is there for whoever asks (``engine="torch"``, ``--engine torch``);
on a GPU, where its fused kernels should matter, it becomes the default only
once a GPU run has verified it (``jobs/gpu_check.sh``).

Adding an engine: a module with an :class:`~mpiattn.kernels.engine.Engine`
subclass, and one entry in :data:`ENGINES`; the shared contract suite
(``tests/attention/test_contract.py``) then tests it on every case it
declares.
"""

from __future__ import annotations

from typing import Any

from .engine import Engine
from .native_engine import FusedEngine, NativeEngine
from .torch_engine import TorchEngine

__all__ = ["ENGINES", "NAMES", "AUTO", "get", "local_choice", "agreed_choice"]

#: Every engine, by name.
ENGINES: dict[str, Engine] = {e.name: e for e in (NativeEngine(), FusedEngine(), TorchEngine())}

#: Accepted values of ``engine=`` (``auto`` first).
NAMES = ("auto", *ENGINES)

#: What ``engine="auto"`` runs, and why (see the module docstring).
AUTO = ("native", "auto: the reference engine (deterministic: torch only when asked for)")


def get(name: str) -> Engine:
    """The engine object of ``name``."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(NAMES)}") from None


def local_choice(requested: str, spec: Any) -> tuple[str, str]:
    """This rank's engine for the call ``spec``, and why (local; may import the engine's library).

    Returns
    -------
    (name, reason) : (str, str)
        For an explicit engine that cannot run the call here, ``name`` is
        ``""`` and ``reason`` says why (the caller raises, on every rank).
    """
    if requested == "auto":
        return AUTO
    engine = get(requested)
    why = engine.supports(spec) or engine.usable(spec.device)
    return (engine.name, "requested") if why is None else ("", why)


def agreed_choice(choices: list[tuple[str, str]], requested: str) -> tuple[str, str]:
    """The engine every rank uses, from every rank's :func:`local_choice` (gathered): the first
    rank's, or the same ValueError on every rank naming the first rank where the requested
    engine cannot run."""
    for r, (name, why) in enumerate(choices):
        if not name:
            raise ValueError(f"engine {requested!r} cannot run on rank {r}: {why}; use "
                             f"engine={AUTO[0]!r} or 'auto'")
    return choices[0]
