"""The native engine: mpiattn's own kernels behind the engine interface.

Every dtype, device and mask rule; the reference the other engines are
checked against. NumPy arrays run :mod:`mpiattn.kernels.native` (its
backward :mod:`mpiattn.kernels.native_backward`), CuPy
arrays :mod:`mpiattn.kernels.native_cuda`. The ``fused`` engine is the
same code with the fused CuPy kernels of :mod:`mpiattn.kernels.fused` for
a tile's elementwise work (CuPy only; chosen by name like any engine).
Blocks are cut into score tiles of ``tile`` rows; its preferred exchanged
block is one tile: :data:`mpiattn.kernels.tiling.DEFAULT_TILE` rows on the
host, the tile sized from the devices on CuPy (``spec.tile``, agreed by
every rank, :func:`mpiattn.kernels.native_cuda.device_tile`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..masks import RULES
from ..masks.modifiers import ENGINE_MODIFIERS
from . import native, native_backward, native_cuda, tiling
from .engine import Capabilities, Engine, KernelCall

__all__ = ["NativeEngine", "FusedEngine"]


class _Forward:
    def __init__(self, call: KernelCall, q: Any, fused: bool):
        self.h, self.tile, self.group = q.shape[1], call.tile, q.shape[1] // call.hkv
        self.device = backend.array_module(q) is not np
        if self.device:
            self.st = native_cuda.DeviceForward.start(q, call.hkv, call.scale, call.acc_dtype,
                                                      call.ev, fused, call.max_logit)
        else:
            self.st = native.ForwardState.start(q, call.hkv, call.scale, call.acc_dtype, call.ev,
                                                call.max_logit)

    def add(self, k: Any, v: Any, mask: Any) -> None:
        if self.device:
            native_cuda.forward_block(self.st, self.group, k, v, mask, self.tile)
        else:
            native.forward_block(self.st, self.group, k, v, mask, self.tile)

    def result(self) -> tuple[Any, Any]:
        o, lse = (native_cuda.finalize if self.device else native.finalize)(self.st)
        return tiling.unfold_rows(o, self.h), tiling.unfold_rows(lse[..., None], self.h)[..., 0]

    def max_logit(self) -> np.ndarray:
        """The largest ``scale q . k`` of a visible pair per query head, float64 host ``(H,)``."""
        top = tiling.unfold_rows(self.st.xmax[..., None], self.h)[..., 0]  # (B, H, n)
        if top.shape[0] * top.shape[2] == 0:
            return np.full(self.h, -np.inf)
        return backend.to_host(top.max(axis=(0, 2))).astype(np.float64)


class _Backward:
    def __init__(self, call: KernelCall, q: Any, dout: Any, lse: Any, D: Any, fused: bool):
        xp = backend.array_module(q)
        hkv, scale, acc = call.hkv, call.scale, call.acc_dtype
        self.h, self.scale, self.tile, self.group = q.shape[1], scale, call.tile, q.shape[1] // hkv
        self.device = xp is not np
        if self.device:  # dQ is scaled in its GEMM
            self.bi = native_cuda.DeviceBackward.start(q, dout, lse, D, hkv, scale, acc, fused)
            lead = self.bi.q.shape[:-1]
        else:
            self.bi = native_backward.BackwardInputs.start(q, dout, lse, D, hkv, scale, acc)
            lead = self.bi.qa.shape[:-1]
        self.dq = xp.zeros(lead + (q.shape[3],), dtype=acc)

    def add(self, k: Any, v: Any, mask: Any, dk: Any, dv: Any) -> None:
        if self.device:
            native_cuda.backward_block(self.bi, self.group, k, v, mask, self.dq, dk, dv, self.tile)
        else:
            native_backward.backward_block(self.bi, self.group, k, v, mask, self.dq, dk, dv, self.tile)

    def result(self) -> Any:
        if not self.device:
            self.dq *= self.scale
        return tiling.unfold_rows(self.dq, self.h)


class NativeEngine(Engine):
    """mpiattn's own blocked kernels (every dtype, device and mask)."""

    name = "native"
    capabilities = Capabilities(
        dtypes={"numpy": ("float16", "bfloat16", "float32", "float64"),
                "cupy": ("float16", "float32", "float64")},
        rules=RULES, needs_out=False, modifiers=ENGINE_MODIFIERS)
    #: A tile's elementwise work in one fused CuPy kernel each way (:mod:`mpiattn.kernels.fused`).
    fused = False

    def block_rows(self, spec: Any, max_rows: int) -> int:
        """One score tile (``spec.tile``, else :data:`mpiattn.kernels.tiling.DEFAULT_TILE` rows)."""
        return spec.tile or tiling.DEFAULT_TILE

    def tile_rows(self, spec: Any) -> int | None:
        """This rank's preferred tile for ``spec`` (local): sized from the device on CuPy."""
        return native_cuda.device_tile(spec) if spec.device == "cupy" else None

    def forward(self, call: KernelCall, q: Any) -> _Forward:
        """Start a forward pass (NaN and Inf propagate by themselves: ``call.finite`` is not needed)."""
        return _Forward(call, q, self.fused)

    def backward(self, call: KernelCall, q: Any, dout: Any, out: Any, lse: Any, D: Any) -> _Backward:
        """Start a backward pass (``out`` is not needed: ``D`` carries it)."""
        return _Backward(call, q, dout, lse, D, self.fused)


class FusedEngine(NativeEngine):
    """The native engine with the fused CuPy kernels (CuPy float16/32/64; every mask rule).

    Chosen by name (``engine="fused"``), never by ``auto``, until a GPU run
    of ``jobs/gpu_check.sh`` has compared it with the native engine.
    """

    name = "fused"
    capabilities = Capabilities(dtypes={"cupy": ("float16", "float32", "float64")}, rules=RULES,
                                needs_out=False, modifiers=ENGINE_MODIFIERS)
    fused = True
