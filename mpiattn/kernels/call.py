"""What an engine is told of one call besides its arrays: one object, made by whoever brings the blocks.

A strategy (or a decode step) makes one :class:`KernelCall` per pass and
hands it to :meth:`mpiattn.kernels.engine.Engine.forward` or
:meth:`~mpiattn.kernels.engine.Engine.backward` with the queries; the
blocks then come with their :class:`~mpiattn.masks.BlockMask`. Everything
an engine may need is here, and nothing that only one engine needs is
threaded through the callers: an engine reads the fields it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KernelCall"]


@dataclass(frozen=True)
class KernelCall:
    """One pass of an engine over key/value blocks.

    Attributes
    ----------
    hkv : int
        Key/value heads of the arrays the engine gets (a head-sharded call:
        this rank's share).
    ev : int
        The value head dim.
    scale : float
        The softmax scale of the scores.
    acc_dtype : numpy.dtype
        The accumulation dtype of ``out``, ``lse`` and the gradients.
    tile : int
        Rows and keys of one score tile (the native engine's unit of work).
    finite : bool
        Every rank checked its inputs to hold no NaN or Inf (an engine that
        must guard against infinite keys may skip it).
    max_logit : bool
        Keep the maximum of ``x = scale q . k`` over the visible pairs of every
        query head (the forward's ``max_logit()``).
    """

    hkv: int
    ev: int
    scale: float
    acc_dtype: np.dtype
    tile: int
    finite: bool = False
    max_logit: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "acc_dtype", np.dtype(self.acc_dtype))

    @classmethod
    def of(cls, spec: Any, *, tile: int, finite: bool, heads: int = 1) -> "KernelCall":
        """The pass of the call ``spec`` (a :class:`mpiattn.strategies.spec.AttentionSpec`: its
        heads, value dim, scale, accumulation dtype and ``max_logit``) with score tiles of
        ``tile`` rows; ``heads``: the ranks its key/value heads are shared among (a
        head-sharded strategy). The one place a KernelCall is made."""
        return cls(hkv=spec.Hkv // heads, ev=spec.Ev, scale=spec.scale, acc_dtype=spec.acc_dtype,
                   tile=tile, finite=finite, max_logit=spec.mask.max_logit)
