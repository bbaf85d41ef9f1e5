"""The NumPy/CuPy multi-head attention layer on sequence-sharded rows (``mpiattn.MultiheadAttention``).

``projections``
    the row-local arithmetic: ``x W + b`` in the accumulation dtype, heads split and merged;
``saving``
    a layer's file (configuration and parameters, through :mod:`mpiattn.io.checkpoint`);
``multihead``
    :class:`MultiheadAttention`: projections, attention, hand-derived parameter gradients.
"""

from __future__ import annotations

from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]
