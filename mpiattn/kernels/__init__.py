"""Local attention engines (one rank, no MPI) and the library's dense reference.

``engine``
    what an engine is: the interface and its declared capabilities;
``tiling``
    folded query rows, scratch buffers, the walk over the tiles a query sees;
``native``, ``native_backward``
    mpiattn's own blocked kernels on NumPy (the math; its backward), ``native_cuda`` on CuPy;
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
from .native import TAU
from .tiling import DEFAULT_TILE

__all__ = ["Capabilities", "Engine", "ENGINES", "NAMES", "get", "local_choice", "DEFAULT_TILE",
           "TAU"]
