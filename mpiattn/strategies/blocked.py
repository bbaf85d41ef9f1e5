"""Ring and all-gather attention: key/value blocks fed to the blocked kernels.

Two block sources hand every key/value block, with its global positions, to
the same blocked forward and backward loops (:mod:`mpiattn.kernels`); with
``grads`` they also bring each block's ``dK``, ``dV`` home to its owner:

``ring``
    blocks arrive from the neighbour (:func:`mpiattn.comm.circulate`); dK,
    dV travel with them and come home after ``P`` hops.
``allgather``
    round ``t`` gathers rows ``[t*block, (t+1)*block)`` of every rank's
    shard; its dK, dV are summed to their owners by a reduce-scatter.

Each block's :class:`~mpiattn.kernels.masks.BlockMask` comes from
:func:`block_mask` (causal, window, documents, padding). A block with no
visible pair is never handed to the engine (it costs only its transfer), and
the engine skips the tiles with no visible pair inside the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .. import backend, kernels
from ..kernels import engines
from ..comm.core import Comm
from ..comm.ring import circulate, row_pieces
from ..layouts import all_segments, positions
from . import masking
from .problem import Problem, Progress, report

__all__ = ["blocked_forward", "blocked_backward"]


@dataclass
class _KeyBlock:
    """Keys/values of global positions ``k_idx`` (row axis -2), their padding, gradient sinks."""

    k: Any
    v: Any
    k_idx: np.ndarray
    pad: Any
    dk: Any = None
    dv: Any = None


def block_mask(pb: Problem, q_pos: np.ndarray, b: _KeyBlock) -> kernels.BlockMask:
    """The visibility rules of this rank's queries against key block ``b``."""
    return masking.block_mask(pb, q_pos, b.k_idx, b.pad)


def _visible(bm: kernels.BlockMask) -> bool:
    """False when no query sees any key of the block: it is skipped (it cost only its transfer)."""
    return bm.visibility(0, bm.q_pos.size, 0, bm.k_pos.size) != "none"


def _kv_data(pb: Problem, k: Any, v: Any, mask: Any) -> list[Any]:
    return [k, v] + ([mask[:, :, None]] if pb.masked else [])


def _key_block(pb: Problem, data: Sequence[Any], k_idx: np.ndarray, sinks: Sequence[Any] = ()) -> _KeyBlock:
    pad = data[2][..., 0] if pb.masked else None
    return _KeyBlock(data[0], data[1], k_idx, pad, *sinks)


# The two block sources below hand every key/value block to the same blocked
# forward/backward loops; with ``grads`` they also collect dK, dV for the owners.

def _ring_blocks(c: Comm, pb: Problem, k: Any, v: Any, mask: Any,
                 grads: Sequence[Any] = ()) -> tuple[int, Iterator[_KeyBlock]]:
    """Ring: blocks arrive from the neighbour; dK, dV travel with them and come home."""
    total = sum(len(row_pieces(s, pb.block)) for s in all_segments(pb.M, pb.P, pb.kv_layout))
    pieces = circulate(c, _kv_data(pb, k, v, mask), pb.M, pb.kv_layout, pb.block, acc_out=grads)
    return total, (_key_block(pb, p.data, np.arange(p.start, p.stop), p.acc) for p in pieces)


def _gather_blocks(c: Comm, pb: Problem, k: Any, v: Any, mask: Any,
                   grads: Sequence[Any] = ()) -> tuple[int, Iterator[_KeyBlock]]:
    """All-gather: round ``t`` gathers rows ``[t*block, (t+1)*block)`` of every rank's shard;
    its dK, dV are summed to their owners by a reduce-scatter."""
    xp = backend.array_module(k)
    pos = [positions(s) for s in all_segments(pb.M, pb.P, pb.kv_layout)]
    rounds = max((math.ceil(p.size / pb.block) for p in pos), default=0)

    def blocks() -> Iterator[_KeyBlock]:
        for t in range(rounds):
            lo = t * pb.block
            counts = [max(0, min(pb.block, p.size - lo)) for p in pos]
            got = [xp.moveaxis(c.allgatherv_rows(_rows_first(x[..., lo:lo + counts[c.rank], :]), counts), 0, -2)
                   for x in _kv_data(pb, k, v, mask)]
            k_idx = np.concatenate([p[lo:lo + n] for p, n in zip(pos, counts)])
            sinks = [xp.zeros(x.shape, dtype=pb.acc_dtype) for x in got[:2]] if grads else []
            yield _key_block(pb, got, k_idx, sinks)
            for g, part in zip(grads, sinks):
                g[..., lo:lo + counts[c.rank], :] += xp.moveaxis(c.reduce_scatterv_rows(_rows_first(part), counts), 0, -2)

    return rounds, blocks()


def _rows_first(x: Any) -> Any:
    xp = backend.array_module(x)
    return xp.ascontiguousarray(xp.moveaxis(x, -2, 0))


_BLOCKS = {"ring": _ring_blocks, "allgather": _gather_blocks}


def blocked_forward(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any,
                    progress: Progress) -> tuple[Any, Any]:
    """Forward over every key/value block: ``out (B, H, n, Ev)``, ``lse (B, H, n)`` (accumulation dtype)."""
    f = engines.get(pb.engine).forward(q, pb.Hkv, pb.scale, pb.acc_dtype, pb.Ev, pb.finite)
    q_pos = pb.q_pos()
    total, blocks = _BLOCKS[pb.strategy](c, pb, k, v, mask)
    for i, b in enumerate(blocks):
        bm = block_mask(pb, q_pos, b)
        if _visible(bm):
            f.add(b.k, b.v, bm, pb.tile)
        report(progress, i + 1, total)
    return f.result()


def blocked_backward(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                     D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    """Gradients over every key/value block: ``dq``, ``dk``, ``dv`` (accumulation dtype)."""
    xp = backend.array_module(q)
    bwd = engines.get(pb.engine).backward(q, dout, out, lse, D, pb.Hkv, pb.scale, pb.acc_dtype)
    q_pos = pb.q_pos()
    dk = xp.zeros(k.shape, dtype=pb.acc_dtype)
    dv = xp.zeros(v.shape, dtype=pb.acc_dtype)
    total, blocks = _BLOCKS[pb.strategy](c, pb, k, v, mask, grads=[dk, dv])
    for i, b in enumerate(blocks):
        bm = block_mask(pb, q_pos, b)
        if _visible(bm):
            bwd.add(b.k, b.v, bm, b.dk, b.dv, pb.tile)
        report(progress, i + 1, total)
    return bwd.result(), dk, dv
