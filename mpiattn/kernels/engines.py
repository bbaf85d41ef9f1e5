"""Local attention engines behind one small interface, and the rule that picks one.

An engine computes one rank's attention against one key/value block at a
time; the strategies (:mod:`mpiattn.strategies`) bring the blocks. Two
objects carry a call:

``engine.forward(q, hkv, scale, acc_dtype, ev, finite)`` -> ``f``
    ``f.add(k, v, mask, tile)`` folds a block in (``mask`` a
    :class:`~mpiattn.kernels.masks.BlockMask`); ``f.result()`` returns
    ``out (B, H, n, Ev)`` and ``lse (B, H, n)`` in the accumulation dtype
    (rows that saw no key: ``out = 0``, ``lse = -inf``).
``engine.backward(q, dout, out, lse, D, hkv, scale, acc_dtype)`` -> ``b``
    ``b.add(k, v, mask, dk, dv, tile)`` adds the block's gradients into
    ``dk``, ``dv`` (``(B, Hkv, k, E/Ev)``, accumulation dtype) and keeps
    ``dq``; ``b.result()`` returns ``dq (B, H, n, E)``. The global ``lse``
    and ``D = rowsum(dout * out)`` make each block's gradients exact
    (FlashAttention-2), whatever the order of the blocks.

Engines
-------
``native``
    mpiattn's own blocked kernels (:mod:`mpiattn.kernels.native`) on NumPy
    or CuPy: every dtype, device and mask. The reference, and the default
    without torch.
``torch``
    torch's fused flash-attention kernels on the same memory
    (:mod:`mpiattn.kernels.torch_engine`), imported only when chosen.

Selection (``engine="auto"``, the default): on NumPy arrays of float32 or
float64, ``torch`` when torch is already imported in the process (mpiattn
never imports a heavy optional library as a side effect: import torch, or
pass ``engine="torch"``; the command line imports it when installed), its
kernels pass the signature check and it supports the case
(:func:`torch_engine.supports`: dtype, head dims and the active mask rules:
causal and padding); otherwise ``native``.
float16 stays ``native`` under ``auto`` (torch's CPU backward keeps half
precision gradients between its key chunks), and so do CuPy arrays until a
GPU run has verified the torch engine there (``engine="torch"`` asks for it). Every rank reports its local answer and the ranks
agree (one rank without torch makes every rank use ``native``), so the
choice is the same everywhere.
"""

from __future__ import annotations

from typing import Any

import importlib.util
import logging
import sys

import numpy as np

from .. import backend
from . import native, torch_engine

__all__ = ["ENGINES", "NativeEngine", "local_choice", "notice_fallback", "get"]

#: Accepted values of ``engine=``.
ENGINES = ("auto", "native", "torch")

_log = logging.getLogger("mpiattn.engines")
_SAID: set[str] = set()  # fall-back notices already given by this process


class _NativeForward:
    def __init__(self, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int):
        self.h = q.shape[1]
        self.st = native.ForwardState.start(q, hkv, scale, acc_dtype, ev)

    def add(self, k: Any, v: Any, mask: Any, tile: int) -> None:
        native.forward_block(self.st, self.h // self.st.qa.shape[1], k, v, mask, tile)

    def result(self) -> tuple[Any, Any]:
        o, lse = native.finalize(self.st)
        return native.unfold_rows(o, self.h), native.unfold_rows(lse[..., None], self.h)[..., 0]


class _NativeBackward:
    def __init__(self, q: Any, dout: Any, lse: Any, D: Any, hkv: int, scale: float, acc_dtype: Any):
        xp = backend.array_module(q)
        self.h, self.scale = q.shape[1], scale
        self.bi = native.BackwardInputs.start(q, dout, lse, D, hkv, scale, acc_dtype)
        self.dq = xp.zeros(self.bi.qa.shape[:-1] + (q.shape[3],), dtype=acc_dtype)

    def add(self, k: Any, v: Any, mask: Any, dk: Any, dv: Any, tile: int) -> None:
        native.backward_block(self.bi, self.h // self.bi.qa.shape[1], k, v, mask, self.dq, dk, dv, tile)

    def result(self) -> Any:
        self.dq *= self.scale
        return native.unfold_rows(self.dq, self.h)


class NativeEngine:
    """mpiattn's own blocked kernels (every dtype, device and mask)."""

    name = "native"

    def forward(self, q: Any, hkv: int, scale: float, acc_dtype: Any, ev: int,
                finite: bool = False) -> _NativeForward:
        """Start a forward pass for queries ``q (B, H, n, E)`` (NaN/Inf propagate by themselves)."""
        return _NativeForward(q, hkv, scale, acc_dtype, ev)

    def backward(self, q: Any, dout: Any, out: Any, lse: Any, D: Any, hkv: int, scale: float,
                 acc_dtype: Any) -> _NativeBackward:
        """Start a backward pass (``lse``, ``D``: ``(B, H, n)``, global; ``out`` is not needed)."""
        return _NativeBackward(q, dout, lse, D, hkv, scale, acc_dtype)

    @staticmethod
    def block_rows(default: int, **_: Any) -> int:
        """Rows per key/value block and tile edge when the caller gave none."""
        return default


def local_choice(requested: str, xp_name: str, dtype: Any, E: int, Ev: int,
                 rules: tuple[str, ...]) -> tuple[str, str]:
    """This rank's engine for a call, and why (local: no communication, no raise for "auto").

    Returns
    -------
    (name, reason) : (str, str)
        ``name`` is "native" or "torch"; for an explicit "torch" that cannot
        run here, ``name`` is "" and ``reason`` says why (the caller raises).
    """
    if requested == "native":
        return "native", "requested"
    if requested == "auto" and "torch" not in sys.modules:
        if importlib.util.find_spec("torch") is None:
            return "native", "auto: torch is not installed"
        return "native", "auto: torch is not imported (import torch, or pass engine='torch')"
    why = torch_engine.supports(xp_name, dtype, E, Ev, rules)
    if requested == "torch":
        return ("torch", "requested") if why is None else ("", why)
    if xp_name != "numpy":
        return "native", "auto: the torch engine is not yet verified on a GPU"
    if np.dtype(dtype) == np.float16:
        return "native", "auto: float16 stays native (torch keeps half-precision gradients)"
    if why is not None:
        return "native", f"auto: {why}"
    return "torch", "auto: torch's fused kernels support this case"


def get(name: str) -> Any:
    """The engine object for ``"native"`` or ``"torch"``."""
    if name == "torch":
        return torch_engine.TorchEngine()
    if name == "native":
        return NativeEngine()
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")


def notice_fallback(rank: int, requested: str, chosen: str, why: str) -> None:
    """One-line notice (rank 0, once per reason) when ``auto`` falls back to native because an
    installed torch is unusable (untested version, changed op signature); silent without torch."""
    if rank != 0 or requested != "auto" or chosen != "native" or why in _SAID:
        return
    if "untested" in why or "changed signature" in why:
        _SAID.add(why)
        _log.warning("mpiattn: using the native engine: %s", why)
