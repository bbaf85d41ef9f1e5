"""Local attention engines (one rank, no MPI) and the library's dense reference.

``engine``
    what an engine is: the interface and its declared capabilities;
``native``
    mpiattn's own blocked kernels on NumPy or CuPy (the math);
``call``
    what an engine is told of a pass (one object);
``native_engine``, ``torch_engine``
    the engines: native, fused (the native engine with the fused CuPy
    kernels of ``fused``), torch (``torch_ops``: torch's kernels on one block);
``engines``
    the registry and the ``auto`` rule;
``reference``
    dense attention that materialises the scores (``--check``, the
    benchmark's peer).
"""

from __future__ import annotations

from .engine import Capabilities, Engine
from .engines import ENGINES, NAMES, get, local_choice
from .native import DEFAULT_TILE, TAU

__all__ = ["Capabilities", "Engine", "ENGINES", "NAMES", "get", "local_choice", "DEFAULT_TILE",
           "TAU"]
