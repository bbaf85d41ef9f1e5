"""The loops that feed key/value blocks to an engine, shared by the ring and all-gather strategies.

A block source (:mod:`mpiattn.strategies.ring`, :mod:`mpiattn.strategies.allgather`)
yields every key/value block with its global positions, and, for the
backward, the sinks where the block's ``dK``, ``dV`` go (the source brings
them home to their owner). Each block's :class:`~mpiattn.masks.BlockMask`
comes from the call's mask rules; a block with no visible pair is never
handed to the engine (it costs only its transfer), and the engine skips the
tiles with no visible pair inside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .. import backend
from ..masks import BlockMask, QuerySide, block_mask
from .base import Progress, report

__all__ = ["KeyBlock", "kv_data", "key_block", "run_forward", "run_backward"]


@dataclass
class KeyBlock:
    """Keys/values of global positions ``k_idx`` (row axis -2), their padding, gradient sinks."""

    k: Any
    v: Any
    k_idx: np.ndarray
    pad: Any
    dk: Any = None
    dv: Any = None


def kv_data(pb: Any, k: Any, v: Any, mask: Any) -> list[Any]:
    """The arrays that travel for a block: keys, values and (if any) padding as a row array."""
    return [k, v] + ([mask[:, :, None]] if pb.spec.mask.padding else [])


def key_block(pb: Any, data: Sequence[Any], k_idx: np.ndarray, sinks: Sequence[Any] = ()) -> KeyBlock:
    pad = data[2][..., 0] if pb.spec.mask.padding else None
    return KeyBlock(data[0], data[1], k_idx, pad, *sinks)


def _mask(pb: Any, queries: QuerySide, b: KeyBlock) -> BlockMask | None:
    """The block's mask, or None when no query sees any of its keys (skip it)."""
    bm = block_mask(pb.spec.mask, queries, b.k_idx, pb.seg_k, b.pad)
    return bm if bm.visibility(0, bm.q_pos.size, 0, bm.k_pos.size) != "none" else None


def run_forward(pb: Any, q: Any, blocks: Iterator[KeyBlock], total: int,
                progress: Progress) -> tuple[Any, Any]:
    """Forward over every block: ``out (B, H, n, Ev)``, ``lse (B, H, n)`` (accumulation dtype)."""
    s = pb.spec
    f = pb.engine.forward(q=q, hkv=s.Hkv, scale=s.scale, acc_dtype=s.acc_dtype, ev=s.Ev,
                          tile=pb.tile, finite=pb.finite, fused=s.fused)
    queries = pb.queries()
    for i, b in enumerate(blocks):
        bm = _mask(pb, queries, b)
        if bm is not None:
            f.add(b.k, b.v, bm)
        report(progress, i + 1, total)
    return f.result()


def run_backward(pb: Any, dout: Any, q: Any, out: Any, lse: Any, D: Any,
                 blocks: Iterator[KeyBlock], total: int, progress: Progress) -> Any:
    """Gradients over every block: ``dq`` (accumulation dtype); each block's sinks get its dK, dV."""
    s = pb.spec
    bwd = pb.engine.backward(q=q, dout=dout, out=out, lse=lse, D=D, hkv=s.Hkv, scale=s.scale,
                             acc_dtype=s.acc_dtype, tile=pb.tile, fused=s.fused)
    queries = pb.queries()
    for i, b in enumerate(blocks):
        bm = _mask(pb, queries, b)
        if bm is not None:
            bwd.add(b.k, b.v, bm, b.dk, b.dv)
        report(progress, i + 1, total)
    return bwd.result()


def zeros_like_kv(pb: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """``dk``, ``dv`` accumulators in the accumulation dtype."""
    xp = backend.array_module(k)
    return (xp.zeros(k.shape, dtype=pb.spec.acc_dtype), xp.zeros(v.shape, dtype=pb.spec.acc_dtype))
