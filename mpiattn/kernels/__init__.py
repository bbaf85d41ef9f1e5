"""Local attention engines (one rank, no MPI) and the library's dense reference.

``engine``
    what an engine is: the interface and its declared capabilities;
``native``
    mpiattn's own blocked kernels on NumPy or CuPy (the math);
``native_engine``, ``torch_engine``
    the engines (``torch_ops``: torch's kernels on one block; ``fused``:
    fused CuPy kernels for the native forward, opt-in);
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
