"""The native engine: mpiattn's own kernels (:mod:`mpiattn.kernels.native`) behind the engine interface.

Every dtype, device and mask rule; the reference the other engines are
checked against. Blocks are cut into score tiles of ``tile`` rows; its
preferred exchanged block is one tile (:data:`mpiattn.kernels.native.DEFAULT_TILE` rows).
"""

from __future__ import annotations

from typing import Any

from .. import backend
from ..masks import RULES
from . import native
from .engine import Capabilities, Engine

__all__ = ["NativeEngine"]


class _Forward:
    def __init__(self, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int, tile: int,
                 fused: bool):
        self.h, self.tile, self.fused = q.shape[1], tile, fused
        self.st = native.ForwardState.start(q, hkv, scale, acc_dtype, ev)

    def add(self, k: Any, v: Any, mask: Any) -> None:
        native.forward_block(self.st, self.h // self.st.qa.shape[1], k, v, mask, self.tile,
                             self.fused)

    def result(self) -> tuple[Any, Any]:
        o, lse = native.finalize(self.st)
        return native.unfold_rows(o, self.h), native.unfold_rows(lse[..., None], self.h)[..., 0]


class _Backward:
    def __init__(self, q: Any, dout: Any, lse: Any, D: Any, hkv: int, scale: float,
                 acc_dtype: Any, tile: int):
        xp = backend.array_module(q)
        self.h, self.scale, self.tile = q.shape[1], scale, tile
        self.bi = native.BackwardInputs.start(q, dout, lse, D, hkv, scale, acc_dtype)
        self.dq = xp.zeros(self.bi.qa.shape[:-1] + (q.shape[3],), dtype=acc_dtype)

    def add(self, k: Any, v: Any, mask: Any, dk: Any, dv: Any) -> None:
        native.backward_block(self.bi, self.h // self.bi.qa.shape[1], k, v, mask, self.dq, dk, dv,
                              self.tile)

    def result(self) -> Any:
        self.dq *= self.scale
        return native.unfold_rows(self.dq, self.h)


class NativeEngine(Engine):
    """mpiattn's own blocked kernels (every dtype, device and mask)."""

    name = "native"
    capabilities = Capabilities(
        dtypes={"numpy": ("float16", "bfloat16", "float32", "float64"),
                "cupy": ("float16", "float32", "float64")},
        rules=RULES, needs_out=False)

    def block_rows(self, spec: Any, max_rows: int) -> int:
        """One score tile (:data:`mpiattn.kernels.native.DEFAULT_TILE` rows)."""
        return native.DEFAULT_TILE

    def forward(self, *, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int, tile: int,
                finite: bool = False, fused: bool = False) -> _Forward:
        """Start a forward pass (NaN and Inf propagate by themselves: ``finite`` is not needed)."""
        return _Forward(q, hkv, scale, acc_dtype, ev, tile, fused)

    def backward(self, *, q: Any, dout: Any, out: Any, lse: Any, D: Any, hkv: int, scale: float,
                 acc_dtype: Any, tile: int) -> _Backward:
        """Start a backward pass (``out`` is not needed: ``D`` carries it)."""
        return _Backward(q, dout, lse, D, hkv, scale, acc_dtype, tile)
