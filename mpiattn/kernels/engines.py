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
packages and the same machine (``machine=``, ``$MPIATTN_MACHINE``), picks the
same engine, whatever else the process imported before. It reads the speeds
the machine holds (:attr:`mpiattn.strategies.machines.Machine.engines`, measured
by ``mpiattn calibrate`` on the machine itself): the engine measured fastest
for the call's dtype and direction (forward, or the backward), if it beats
the native engine's measured speed by more than :data:`MARGIN` and can run
the call here; else ``native``, the reference, which supports every case.
The profiles hold no such speeds, so without a calibrated machine ``auto`` is
``native`` (on the CPUs measured it runs at 0.8-1.3x torch's own kernel, and
choosing torch unmeasured would make a NumPy call import torch: seconds,
hundreds of MiB; ``benchmarks/cpu_profile/``). The ranks agree: where their
choices differ (an engine usable on some ranks only), every rank runs
``native``.

Adding an engine: a module with an :class:`~mpiattn.kernels.engine.Engine`
subclass, and one entry in :data:`ENGINES`; the shared contract suite
(``tests/attention/test_contract.py``) then tests it on every case it
declares.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .engine import Engine
from .native_engine import FusedEngine, NativeEngine
from .torch_engine import TorchEngine

__all__ = ["ENGINES", "NAMES", "AUTO", "MARGIN", "get", "local_choice", "agreed_choice"]

#: Every engine, by name.
ENGINES: dict[str, Engine] = {e.name: e for e in (NativeEngine(), FusedEngine(), TorchEngine())}

#: Accepted values of ``engine=`` (``auto`` first).
NAMES = ("auto", *ENGINES)

#: What ``engine="auto"`` runs without a measured faster engine, and why (the module docstring).
AUTO = ("native", "auto: the reference engine (no faster engine measured on this machine)")

#: How much faster than the native engine another must have been measured for ``auto`` to run
#: it (a fraction): a measurement's noise does not switch engines.
MARGIN = 0.05


def get(name: str) -> Engine:
    """The engine object of ``name``."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(NAMES)}") from None


def local_choice(requested: str, spec: Any, measured: dict | None = None,
                 backward: bool = False) -> tuple[str, str]:
    """This rank's engine for the call ``spec``, and why (local; may import the engine's library).

    Parameters
    ----------
    requested : str
        :data:`NAMES`.
    spec : AttentionSpec
    measured : dict, optional
        For ``auto``: the machine's engine speeds (engine -> dtype -> ``[forward, backward]``
        FLOP/s, :attr:`mpiattn.strategies.machines.Machine.engines`).
    backward : bool
        The call is a backward (compare the backward speeds).

    Returns
    -------
    (name, reason) : (str, str)
        For an explicit engine that cannot run the call here, ``name`` is
        ``""`` and ``reason`` says why (the caller raises, on every rank).
    """
    if requested == "auto":
        return _auto(spec, measured or {}, backward)
    engine = get(requested)
    why = engine.supports(spec) or engine.usable(spec.device)
    return (engine.name, "requested") if why is None else ("", why)


def _auto(spec: Any, measured: dict, backward: bool) -> tuple[str, str]:
    """``auto``'s engine from the measured speeds (the module docstring)."""
    dtype, side = np.dtype(spec.dtype).name, int(backward)
    speeds = {name: float(by[dtype][side]) for name, by in measured.items()
              if name in ENGINES and dtype in by}
    base = speeds.get(AUTO[0])
    if base is None:
        return AUTO
    for name in sorted(speeds, key=lambda n: (-speeds[n], n)):  # fastest first; ties by name
        if name == AUTO[0] or speeds[name] <= base * (1 + MARGIN):
            break
        engine = ENGINES[name]
        if (engine.supports(spec) or engine.usable(spec.device)) is None:
            return name, (f"auto: measured {speeds[name] / base:.2f}x the native engine's "
                          f"{'backward' if backward else 'forward'} speed in {dtype} on this machine")
    return AUTO


def agreed_choice(choices: list[tuple[str, str]], requested: str) -> tuple[str, str]:
    """The engine every rank uses, from every rank's :func:`local_choice` (gathered): the first
    rank's when every rank chose alike; for ``auto`` where they did not (an engine usable on some
    ranks only), the native engine; else the same ValueError on every rank naming the first rank
    where the requested engine cannot run."""
    for r, (name, why) in enumerate(choices):
        if not name:
            raise ValueError(f"engine {requested!r} cannot run on rank {r}: {why}; use "
                             f"engine={AUTO[0]!r} or 'auto'")
    if requested == "auto" and any(c[0] != choices[0][0] for c in choices):
        return AUTO[0], ("auto: the ranks' measured choices differ (an engine not usable on every "
                         "rank): the native engine")
    return choices[0]
