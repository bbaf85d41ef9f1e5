"""mpiattn: exact dot-product attention over sequence-sharded operands with MPI.

Each MPI rank holds a shard of the sequence (rows) and runs on NumPy (CPU) or
CuPy (GPU) arrays; see :mod:`mpiattn.layouts` for the layouts and
``docs/architecture.md`` for the layers of the package.

Importing the package initialises neither MPI nor CUDA: communicators are
passed in (default ``MPI.COMM_WORLD``) and duplicated on first use.
"""

from __future__ import annotations

from ._lazy import lazy_getattr
from ._version import __version__

# public name -> submodule that defines it (imported on first access)
_EXPORTS = {
    "partition": "sharding",
    "shard": "sharding",
    "gather": "sharding",
    "Layout": "layouts",
    "balance": "balancing",
    "segment_ids_from_cu_seqlens": "balancing",
    "matmul_nt": "products",
    "matmul_nn": "products",
    "matmul_tn": "products",
    "matmul_nt_backward": "products",
    "matmul_nn_backward": "products",
    "matmul_tn_backward": "products",
    "attention": "strategies",
    "attention_backward": "strategies",
    "plan_attention": "strategies",
    "AttentionPlan": "strategies",
    "Options": "strategies",
    "AttentionSpec": "strategies",
    "MultiheadAttention": "layer",
    "get_comm": "comm",
    "KVCache": "inference",
    "ScoreMod": "masks.scoremod",
    "RelativeBias": "masks.relbias",
    "Score": "masks.score",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
