"""The native engine: mpiattn's own kernels behind the engine interface.

Every dtype, device and mask rule; the reference the other engines are
checked against. NumPy arrays run :mod:`mpiattn.kernels.native`, CuPy
arrays :mod:`mpiattn.kernels.native_cuda` (``fused``: its fused kernels).
Blocks are cut into score tiles of ``tile`` rows; its preferred exchanged
block is one tile: :data:`mpiattn.kernels.native.DEFAULT_TILE` rows on the
host, the tile sized from the devices on CuPy (``spec.tile``, agreed by
every rank, :func:`mpiattn.kernels.native_cuda.device_tile`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..masks import RULES
from . import native, native_cuda
from .engine import Capabilities, Engine

__all__ = ["NativeEngine"]


class _Forward:
    def __init__(self, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int, tile: int,
                 fused: bool):
        self.h, self.tile, self.group = q.shape[1], tile, q.shape[1] // hkv
        self.device = backend.array_module(q) is not np
        if self.device:
            self.st = native_cuda.DeviceForward.start(q, hkv, scale, acc_dtype, ev, fused)
        else:
            self.st = native.ForwardState.start(q, hkv, scale, acc_dtype, ev)

    def add(self, k: Any, v: Any, mask: Any) -> None:
        if self.device:
            native_cuda.forward_block(self.st, self.group, k, v, mask, self.tile)
        else:
            native.forward_block(self.st, self.group, k, v, mask, self.tile)

    def result(self) -> tuple[Any, Any]:
        o, lse = (native_cuda.finalize if self.device else native.finalize)(self.st)
        return native.unfold_rows(o, self.h), native.unfold_rows(lse[..., None], self.h)[..., 0]


class _Backward:
    def __init__(self, q: Any, dout: Any, lse: Any, D: Any, hkv: int, scale: float,
                 acc_dtype: Any, tile: int, fused: bool):
        xp = backend.array_module(q)
        self.h, self.scale, self.tile, self.group = q.shape[1], scale, tile, q.shape[1] // hkv
        self.device = xp is not np
        if self.device:  # dQ is scaled in its GEMM
            self.bi = native_cuda.DeviceBackward.start(q, dout, lse, D, hkv, scale, acc_dtype, fused)
            lead = self.bi.q.shape[:-1]
        else:
            self.bi = native.BackwardInputs.start(q, dout, lse, D, hkv, scale, acc_dtype)
            lead = self.bi.qa.shape[:-1]
        self.dq = xp.zeros(lead + (q.shape[3],), dtype=acc_dtype)

    def add(self, k: Any, v: Any, mask: Any, dk: Any, dv: Any) -> None:
        if self.device:
            native_cuda.backward_block(self.bi, self.group, k, v, mask, self.dq, dk, dv, self.tile)
        else:
            native.backward_block(self.bi, self.group, k, v, mask, self.dq, dk, dv, self.tile)

    def result(self) -> Any:
        if not self.device:
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
        """One score tile (``spec.tile``, else :data:`mpiattn.kernels.native.DEFAULT_TILE` rows)."""
        return spec.tile or native.DEFAULT_TILE

    def tile_rows(self, spec: Any) -> int | None:
        """This rank's preferred tile for ``spec`` (local): sized from the device on CuPy."""
        return native_cuda.device_tile(spec) if spec.device == "cupy" else None

    def forward(self, *, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int, tile: int,
                finite: bool = False, fused: bool = False) -> _Forward:
        """Start a forward pass (NaN and Inf propagate by themselves: ``finite`` is not needed)."""
        return _Forward(q, hkv, scale, acc_dtype, ev, tile, fused)

    def backward(self, *, q: Any, dout: Any, out: Any, lse: Any, D: Any, hkv: int, scale: float,
                 acc_dtype: Any, tile: int, fused: bool = False) -> _Backward:
        """Start a backward pass (``out`` is not needed: ``D`` carries it)."""
        return _Backward(q, dout, lse, D, hkv, scale, acc_dtype, tile, fused)
