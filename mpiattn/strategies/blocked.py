"""The loops that feed key/value blocks to an engine: every strategy's, and decode's.

A block source (:mod:`mpiattn.strategies.ring`, :mod:`mpiattn.strategies.allgather`,
the head-sharded :mod:`mpiattn.strategies.ulysses` with one block of every
key, a decode step's stored pages) yields every key/value block with its
global positions, and, for the backward, the arrays where the block's
``dK``, ``dV`` go (the source brings them home to their owner). Each block's
:class:`~mpiattn.masks.BlockMask` comes from the call's rules (an
:class:`Attend`); a block with no visible pair is never handed to the engine
(it costs only its transfer), and the engine skips the tiles with no visible
pair inside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .. import backend
from ..kernels.call import KernelCall
from ..kernels.engine import Engine
from ..masks import BlockMask, MaskSpec, QuerySide, block_mask
from .base import Progress, Strategy, report

__all__ = ["Attend", "KeyBlock", "BlockedStrategy", "kv_data", "key_block", "run_forward",
           "run_backward"]


@dataclass(frozen=True)
class Attend:
    """One rank's side of a pass: the engine, what it is told, the rules, and the queries.

    Attributes
    ----------
    engine : Engine
    call : KernelCall
    mask : MaskSpec
        The call's rules (positions are global: ``queries.q_pos`` and each block's keys).
    queries : QuerySide
        The queries the engine gets, by global position.
    seg_k : (B, M) host int64 array or None
        The keys' global document ids.
    tally : HeadMax or None
        Where a forward pass leaves what it measured (:class:`mpiattn.masks.maxlogit.HeadMax`:
        this rank's maxima per global query head).
    """

    engine: Engine
    call: KernelCall
    mask: MaskSpec
    queries: QuerySide
    seg_k: Any = None
    tally: Any = None


@dataclass
class KeyBlock:
    """Keys/values of global positions ``k_idx`` (row axis -2), their padding, where their
    gradients go (``dk``, ``dv``: accumulation dtype, the backward only)."""

    k: Any
    v: Any
    k_idx: np.ndarray
    pad: Any
    dk: Any = None
    dv: Any = None


def kv_data(pb: Any, k: Any, v: Any, mask: Any) -> list[Any]:
    """The arrays that travel for a block: keys, values and (if any) padding as a row array."""
    return [k, v] + ([mask[:, :, None]] if pb.spec.mask.padding else [])


def key_block(pb: Any, data: Sequence[Any], k_idx: np.ndarray, grads: Sequence[Any] = ()) -> KeyBlock:
    pad = data[2][..., 0] if pb.spec.mask.padding else None
    return KeyBlock(data[0], data[1], k_idx, pad, *grads)


def _mask(a: Attend, b: KeyBlock) -> BlockMask | None:
    """The block's mask, or None when no query sees any of its keys (skip it)."""
    bm = block_mask(a.mask, a.queries, b.k_idx, a.seg_k, b.pad)
    return bm if bm.visibility(0, bm.q_pos.size, 0, bm.k_pos.size) != "none" else None


def run_forward(a: Attend, q: Any, blocks: Iterator[KeyBlock], total: int,
                progress: Progress = None) -> tuple[Any, Any, int]:
    """Forward over every block: ``out (B, H, n, Ev)``, ``lse (B, H, n)`` (accumulation dtype),
    and how many blocks held a visible pair (0: nothing was computed; ``out = 0``, ``lse = -inf``)."""
    f = a.engine.forward(a.call, q)
    used = 0
    for i, b in enumerate(blocks):
        bm = _mask(a, b)
        if bm is not None:
            f.add(b.k, b.v, bm)
            used += 1
        report(progress, i + 1, total)
    o, lse = f.result()
    if a.call.max_logit and a.tally is not None:
        a.tally.add(a.queries.heads, f.max_logit())
    return o, lse, used


def run_backward(a: Attend, dout: Any, q: Any, out: Any, lse: Any, D: Any,
                 blocks: Iterator[KeyBlock], total: int, progress: Progress = None) -> Any:
    """Gradients over every block: ``dq`` (accumulation dtype); each block's ``dk``, ``dv`` get its
    gradients. ``out`` goes to the engine only when it declares it needs it."""
    bwd = a.engine.backward(a.call, q, dout, out if a.engine.capabilities.needs_out else None,
                            lse, D)
    for i, b in enumerate(blocks):
        bm = _mask(a, b)
        if bm is not None:
            bwd.add(b.k, b.v, bm, b.dk, b.dv)
        report(progress, i + 1, total)
    return bwd.result()


def zeros_like_kv(pb: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """``dk``, ``dv`` accumulators in the accumulation dtype."""
    xp = backend.array_module(k)
    return (xp.zeros(k.shape, dtype=pb.spec.acc_dtype), xp.zeros(v.shape, dtype=pb.spec.acc_dtype))


class BlockedStrategy(Strategy):
    """A strategy that brings every key/value block to each rank's queries (ring, all-gather,
    double ring): it says how (:meth:`blocks`), the runner does the rest."""

    def blocks(self, c: Any, pb: Any, k: Any, v: Any, mask: Any,
               grads: Sequence[Any] = ()) -> tuple[int, Iterator[KeyBlock]]:
        """``(total, blocks)``: how many blocks come, and the blocks (with ``grads``, the
        ``dk``, ``dv`` accumulators they bring home)."""
        raise NotImplementedError

    def forward(self, c: Any, pb: Any, q: Any, k: Any, v: Any, mask: Any, progress: Any) -> tuple:
        total, blocks = self.blocks(c, pb, k, v, mask)
        return run_forward(pb.attend(), q, blocks, total, progress)[:2]

    def backward(self, c: Any, pb: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 D: Any, mask: Any, progress: Any) -> tuple:
        dk, dv = zeros_like_kv(pb, k, v)
        total, blocks = self.blocks(c, pb, k, v, mask, grads=[dk, dv])
        return run_backward(pb.attend(), dout, q, out, lse, D, blocks, total, progress), dk, dv
