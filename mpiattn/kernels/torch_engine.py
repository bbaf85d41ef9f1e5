"""The torch engine: each key/value block through torch's fused flash-attention kernels.

The block is split into calls of :mod:`mpiattn.kernels.torch_ops` that the
fused kernels serve at full speed, by the global positions of the rows:

* queries and keys are cut into runs of consecutive global positions (the
  layouts' segments, the ring's pieces);
* without positional rules a run pair is one call (padding, if any, as an
  additive mask);
* causal (``j <= i``), queries ``[a, b)`` against keys ``[c, d)``: keys
  before ``a`` are visible to every query (one unmasked call); keys from
  ``max(a, c)`` on are top-left aligned with the queries from ``max(a, c)``,
  which is exactly torch's ``is_causal`` (one call); query rows before ``c``
  see nothing (skipped). Bottom-right causal (diagonal ``d = M - N``) is the
  same with the queries' positions moved by ``d``, so torch's top-left
  ``is_causal`` serves it too;
* with score modifiers (ALiBi ``-slope[b, h] |i + d - j|``, a float ``attn_mask``
  added, a bool one or a ``mask_mod`` hiding pairs) the block is cut into tiles
  of at most :data:`BIAS_ENTRIES` bias entries; a tile the block mask finds with
  no visible pair is skipped, the others are one call each with the block mask's
  additive bias (:meth:`~mpiattn.masks.BlockMask.bias`: padding, causal and the
  modifiers, ``-inf`` where hidden), made on the host and moved to the arrays'
  device. torch's kernels give a row whose bias is ``-inf`` everywhere ``out = 0``,
  ``lse = 0``: :mod:`mpiattn.kernels.torch_ops` sets its ``lse`` to ``-inf``, so the
  merge ignores it (in the backward, ``lse = -inf`` is passed as ``+inf``: ``P = 0``).

Each call returns its rows' ``(out, lse)``, merged into the running result
with the overflow-safe log-sum-exp update. The backward makes the same calls
with the global ``out`` and ``lse`` (exact per block, FlashAttention-2).

Supported: NumPy (torch CPU) float32, float64, float16, bfloat16 (``ml_dtypes``); CuPy (torch CUDA)
float16, float32 with head dims that are multiples of 8 (not yet run on a
GPU); masks: causal and key padding (windows and documents go to
``native``); score modifiers: ALiBi, ``attn_mask`` (bool or float) and
``mask_mod``, forward and backward (softcap and ``max_logit`` go to ``native``:
SDPA has no nonlinear score, nor the scores' maximum). Tested on the CPU with
torch 2.13, 2.11 (the GPU machine's) and 2.15 (the CI's torch_versions lane); support is
decided by the ops' schemas (:mod:`mpiattn.kernels.torch_ops`).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .. import backend
from ..masks import BlockMask
from . import torch_ops
from .engine import Capabilities, Engine, KernelCall
from .tiling import DEFAULT_TILE

__all__ = ["TorchEngine", "runs"]

#: Target bytes of one key/value block in flight when the caller gave no block size.
BLOCK_BYTES = 64 * 2**20

#: Most entries (batch x heads x queries x keys) of the bias of one call with score modifiers.
BIAS_ENTRIES = 2**22


def runs(pos: np.ndarray) -> list[tuple[int, int]]:
    """Local index ranges ``[(i0, i1), ...]`` over which ``pos`` increases by exactly 1."""
    if pos.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *cuts.tolist(), int(pos.size)]
    return list(zip(edges[:-1], edges[1:]))


def _calls(mask: BlockMask) -> Iterator[tuple[int, int, int, int, bool]]:
    """The calls of one block: ``(i0, i1, j0, j1, causal_aligned)`` in local rows."""
    q_runs, k_runs = runs(mask.q_pos), runs(mask.k_pos)
    shift = int(mask.diagonal)  # bottom-right: query i sits at key position i + shift
    for i0, i1 in q_runs:
        a, b = int(mask.q_pos[i0]) + shift, int(mask.q_pos[i1 - 1]) + 1 + shift
        for j0, j1 in k_runs:
            c, d = int(mask.k_pos[j0]), int(mask.k_pos[j1 - 1]) + 1
            if not mask.causal:
                yield i0, i1, j0, j1, False
                continue
            if c < a:  # keys [c, min(a, d)) are visible to every query of the run
                yield i0, i1, j0, j0 + min(a, d) - c, False
            s = max(a, c)
            if s < min(b, d):  # keys [s, d) against queries [s, b): top-left causal
                yield i0 + s - a, i1, j0 + s - c, j1, True


def _padding(mask: BlockMask, j0: int, j1: int) -> Any:
    return None if mask.pad is None else ~mask.pad[:, None, None, j0:j1]


def _modified(mask: BlockMask) -> bool:
    """The scores of ``mask``'s block have pairs hidden or terms added by the score modifiers."""
    return mask.mods is not None and (mask.mods.hides or mask.mods.adds)


def _tiles(n: int, m: int, width: int) -> Iterator[tuple[int, int, int, int]]:
    """Tiles ``(i0, i1, j0, j1)`` covering ``n`` queries x ``m`` keys, each of at most
    ``BIAS_ENTRIES // width`` pairs (``width``: batch x heads); whole key rows when they fit."""
    if n == 0 or m == 0:
        return
    pairs = max(BIAS_ENTRIES // max(width, 1), 1)
    cols = max(min(m, pairs // min(n, DEFAULT_TILE)), 1)
    rows = max(min(n, pairs // cols), 1)
    for i0 in range(0, n, rows):
        for j0 in range(0, m, cols):
            yield i0, min(i0 + rows, n), j0, min(j0 + cols, m)


def _plan(mask: BlockMask, xp: Any, dtype: Any,
          width: int) -> Iterator[tuple[int, int, int, int, bool, Any, Any]]:
    """The calls of one block: ``(i0, i1, j0, j1, causal_aligned, keep, bias)``.

    Without score modifiers, the runs of :func:`_calls` with the padding as ``keep`` (bool,
    True = visible). With them, tiles of :func:`_tiles`: those the block mask finds with no
    visible pair are skipped, the others get its additive ``bias`` in ``dtype`` on ``xp``'s
    device (padding, causal, ALiBi, ``attn_mask``, ``mask_mod``; per query head, ``group``
    1: :meth:`~mpiattn.masks.BlockMask.bias`), or None when it would be all 0.
    """
    if not _modified(mask):
        for i0, i1, j0, j1, aligned in _calls(mask):
            yield i0, i1, j0, j1, aligned, _padding(mask, j0, j1), None
        return
    for i0, i1, j0, j1 in _tiles(mask.q_pos.size, mask.k_pos.size, width):
        vis = mask.visibility(i0, i1, j0, j1)
        if vis != "none":
            yield i0, i1, j0, j1, False, None, mask.bias(xp, i0, i1, j0, j1, dtype, 1, vis)


def _bias_dtype(q: Any) -> Any:
    """The bias dtype torch's kernels take exactly for ``q`` (see :mod:`.torch_ops`)."""
    return np.dtype(np.float64 if q.dtype == np.float64 else np.float32)


class _TorchForward:
    def __init__(self, q: Any, scale: float, acc_dtype: Any, ev: int, finite: bool):
        xp = backend.array_module(q)
        B, H, n, _ = q.shape
        self.q, self.scale, self.finite = q, scale, finite
        self.out = xp.zeros((B, H, n, ev), dtype=acc_dtype)
        self.lse = xp.full((B, H, n), -np.inf, dtype=acc_dtype)
        self.bad_rows: np.ndarray | None = None

    def add(self, k: Any, v: Any, mask: BlockMask) -> None:
        if not self.finite:
            self._mark_nonfinite_keys(k, mask)
        xp = backend.array_module(k)
        B, H = self.q.shape[:2]
        with torch_ops.one_pool(xp):
            for i0, i1, j0, j1, aligned, keep, bias in _plan(mask, xp, _bias_dtype(self.q), B * H):
                o_c, lse_c = torch_ops.block_forward(
                    self.q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], scale=self.scale,
                    mask=keep, causal_aligned=aligned, bias=bias)
                torch_ops.merge(self.out[:, :, i0:i1], self.lse[:, :, i0:i1], o_c, lse_c)

    def _mark_nonfinite_keys(self, k: Any, mask: BlockMask) -> None:
        """Remember the rows that see a non-finite key: torch's kernel gives a row whose only key
        in a call is NaN out 0 (as if it saw none), where the native engine propagates the NaN."""
        xp = backend.array_module(k)
        bad_k = ~xp.isfinite(k).all(axis=-1)  # (B, Hkv, m): one pass over the keys
        if not bool(bad_k.any()):
            return
        B, H, n = self.out.shape[:3]
        G = H // k.shape[1]
        if self.bad_rows is None:
            self.bad_rows = np.zeros((B, H, n), dtype=bool)
        pad = None if mask.pad is None else backend.to_host(mask.pad)
        for b, h, j in zip(*np.nonzero(backend.to_host(bad_k))):
            pairs = mask.visible_pairs(0, n, j, j + 1)  # (Bs, n, 1)
            sees = pairs[min(b, pairs.shape[0] - 1), :, 0]
            if pad is not None and pad[b, j]:
                continue
            self.bad_rows[b, h * G:(h + 1) * G] |= sees

    def result(self) -> tuple[Any, Any]:
        if self.finite:
            return self.out, self.lse
        xp = backend.array_module(self.q)
        bad = ~xp.isfinite(self.q).all(axis=-1)  # torch's CPU kernel gives a NaN query row out 0
        if self.bad_rows is not None:
            bad |= backend.to_device(self.bad_rows, xp)
        if bool(bad.any()):  # once per call; a select, not boolean indexing
            self.out = xp.where(bad[..., None], self.out.dtype.type(np.nan), self.out)
            self.lse = xp.where(bad, self.lse.dtype.type(np.nan), self.lse)
        return self.out, self.lse


class _TorchBackward:
    def __init__(self, q: Any, dout: Any, out: Any, lse: Any, scale: float, acc_dtype: Any):
        xp = backend.array_module(q)
        self.q, self.dout, self.scale = q, dout, scale
        self.out = out.astype(q.dtype, copy=False)
        self.lse = lse
        self.dq = xp.zeros(q.shape, dtype=acc_dtype)

    def add(self, k: Any, v: Any, mask: BlockMask, dk: Any, dv: Any) -> None:
        with torch_ops.one_pool(backend.array_module(k)):
            self._add(k, v, mask, dk, dv)

    def _add(self, k: Any, v: Any, mask: BlockMask, dk: Any, dv: Any) -> None:
        xp, (B, H) = backend.array_module(k), self.q.shape[:2]
        for i0, i1, j0, j1, aligned, keep, bias in _plan(mask, xp, _bias_dtype(self.q), B * H):
            dq_c, dk_c, dv_c = torch_ops.block_backward(
                self.dout[:, :, i0:i1], self.q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1],
                self.out[:, :, i0:i1], self.lse[:, :, i0:i1], scale=self.scale,
                mask=keep, causal_aligned=aligned, bias=bias)
            self.dq[:, :, i0:i1] += dq_c
            dk[:, :, j0:j1] += dk_c
            dv[:, :, j0:j1] += dv_c

    def result(self) -> Any:
        return self.dq


class TorchEngine(Engine):
    """torch's fused kernels per block (see the module docstring for what it supports)."""

    name = "torch"
    capabilities = Capabilities(
        dtypes={"numpy": ("float16", "bfloat16", "float32", "float64"),
                "cupy": ("float16", "float32")},
        rules=("causal", "padding"), needs_out=True, head_dim_multiple={"cupy": 8},
        modifiers=("alibi", "attn_mask", "mask_mod"))

    def usable(self, device: str) -> str | None:
        """None when torch imports here, its kernels have the expected signatures, and (for
        CuPy arrays) it has CUDA; else why not. Imports torch."""
        why = torch_ops.available()
        if why is None and device == "cupy":
            import torch

            if not torch.cuda.is_available():
                return "torch has no CUDA here"
        return why

    def block_rows(self, spec: Any, max_rows: int) -> int:
        """Large blocks (few calls, few merges): up to :data:`BLOCK_BYTES` per block in flight."""
        row_bytes = spec.B * spec.Hkv * (spec.E + spec.Ev) * np.dtype(spec.dtype).itemsize
        return max(DEFAULT_TILE, min(max(max_rows, 1), BLOCK_BYTES // max(row_bytes, 1)))

    def forward(self, call: KernelCall, q: Any) -> _TorchForward:
        """Start a forward pass for queries ``q (B, H, n, E)`` (``call.tile`` is unused).

        With ``call.finite`` (the inputs were checked for NaN and Inf), the
        passes that make non-finite rows come out NaN are skipped.
        """
        return _TorchForward(q, call.scale, call.acc_dtype, call.ev, call.finite)

    def backward(self, call: KernelCall, q: Any, dout: Any, out: Any, lse: Any,
                 D: Any) -> _TorchBackward:
        """Start a backward pass with the global ``out`` and ``lse`` (torch forms ``D`` itself)."""
        return _TorchBackward(q, dout, out, lse, call.scale, call.acc_dtype)
