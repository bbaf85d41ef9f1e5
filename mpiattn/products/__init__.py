"""Sequence-sharded matrix products ``A·Bᵀ``, ``A·B``, ``Aᵀ·B`` and their backward.

``plan`` validates and plans (one metadata collective per call); ``matmul``
runs the rings (see its docstring for shapes, costs and the closure of the
three products under differentiation).
"""

from __future__ import annotations

from .matmul import (matmul_nn, matmul_nn_backward, matmul_nt, matmul_nt_backward, matmul_tn,
                     matmul_tn_backward)
from .plan import PIECE_BYTES, default_block_size

__all__ = ["matmul_nt", "matmul_nn", "matmul_tn",
           "matmul_nt_backward", "matmul_nn_backward", "matmul_tn_backward",
           "PIECE_BYTES", "default_block_size"]
