"""Local per-block attention engines (one rank, no MPI).

``native``
    mpiattn's own blocked kernels on NumPy or CuPy: the reference, every
    dtype and mask.
``masks``
    which (query, key) pairs a block may use, decided per tile;
``fused``
    fused CuPy kernels for the forward's elementwise steps (used by
    ``native`` on a GPU when switched on).
"""

from __future__ import annotations

from .masks import BlockMask, padding_bias
from .native import (DEFAULT_TILE, TAU, BackwardInputs, ForwardState, Workspace, backward_block,
                     finalize, fold_queries, forward_block, unfold_rows)

__all__ = ["fold_queries", "unfold_rows", "Workspace", "ForwardState", "BackwardInputs",
           "forward_block", "finalize", "backward_block", "padding_bias", "BlockMask",
           "DEFAULT_TILE", "TAU"]
