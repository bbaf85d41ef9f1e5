"""Ring attention: key/value blocks travel round the ring while the queries stay.

Rank ``r`` folds its own key/value blocks into an online softmax first, then
those of ``r-1``, ``r-2``, ..., each received block forwarded to ``r+1`` and
the next one in flight while the current one is computed
(:func:`mpiattn.comm.circulate`; Liu, Zaharia, Abbeel 2023). In the
backward, ``dK``, ``dV`` travel with their block and come home after ``P``
hops. Causal attention skips blocks no query can see; with the zigzag layout
every rank then does about half the non-causal work.

Costs per rank: FLOPs ``4 n M H E`` forward (``10 n M H E`` backward);
words sent ``(P-1) m W`` with ``W = B Hkv (E+Ev)`` (backward: again that
plus the travelling ``dK, dV``), in ``P-1`` steps; extra memory
``O(block^2 + block W)`` for the tile and the blocks in flight.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..comm.ring import circulate, row_pieces
from ..layouts import all_segments
from .base import Phase, blocked_memory, ring_phase
from .blocked import BlockedStrategy, key_block, kv_data

__all__ = ["Ring"]


class Ring(BlockedStrategy):
    """Ring attention (see the module docstring)."""

    name = "ring"

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        m = spec.M / P
        row = spec.B * spec.Hkv * (spec.E + spec.Ev)
        step = m * row * spec.itemsize
        if backward:  # the blocks again, and their dK, dV travelling with them
            step += m * row * spec.acc_dtype.itemsize
        pieces = max(1, -(-int(m) // max(block, 1)))
        return [ring_phase(topology, range(P), step, P - 1, pieces)]

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        return blocked_memory(spec, P, block, backward)

    def blocks(self, c: Any, pb: Any, k: Any, v: Any, mask: Any, grads: Sequence[Any] = ()) -> tuple:
        s = pb.spec
        total = sum(len(row_pieces(seg, pb.block)) for seg in all_segments(s.M, pb.P, s.kv_layout))
        pieces = circulate(c, kv_data(pb, k, v, mask), s.M, s.kv_layout, pb.block, acc_out=grads)
        return total, (key_block(pb, p.data, np.arange(p.start, p.stop), p.acc) for p in pieces)
