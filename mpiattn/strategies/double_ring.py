"""The double ring: ring attention whose blocks go round each node, then on to the next node.

Key/value blocks travel as in ring attention (:mod:`mpiattn.strategies.ring`),
but along a two-level route (:meth:`mpiattn.comm.ring.Route.two_level`; the
"double ring" of LoongTrain, Gu et al. 2024): ``w - 1`` moves inside a node
of ``w`` ranks, then one move to the same local rank of the next node. Every
rank then sends between nodes ``R - 1`` times out of ``P - 1`` (``R``
nodes), where the flat ring makes the rank at each node's edge send every
step between nodes, and every rank's network link is busy at once. It needs
the same number of ranks on every node; any heads (no head group, unlike
:mod:`~mpiattn.strategies.hybrid`, so it suits MQA and head counts that do
not divide).

Per rank, ``m = M/P`` rows, ``W = B Hkv (E+Ev)`` words per row: FLOPs as the
ring's; forward ``(P-R) m W`` words inside a node and ``(R-1) m W`` between
nodes; backward again that, plus the travelling ``dK, dV`` (accumulation
dtype): ``(P-1-R) m W`` inside and ``R m W`` between (their last move, home,
crosses a node). Memory as the ring's.

Each between-node move hides behind one block's compute, like every ring
step; every rank of a node makes it at the same step, so they share the
node's link. Sending the next node's block a whole inner round ahead would hide
it behind ``w`` blocks instead; that needs each block forwarded to two ranks
and each node's partial ``dK, dV`` summed at home, and the cost model finds
a gain only when one between-node move takes longer than a block's compute
(short shards): not built.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..comm.ring import Route, circulate, row_pieces
from ..layouts import all_segments
from .base import Phase, blocked_memory
from .blocked import BlockedStrategy, key_block, kv_data

__all__ = ["DoubleRing"]


def _moves(topology: Any) -> list[bool]:
    """For each move ``t -> t+1`` (t = 0 .. P-2): whether it goes to another node."""
    w = topology.sizes[0]
    return [topology.n_nodes > 1 and (t + 1) % w == 0 for t in range(topology.P - 1)]


class DoubleRing(BlockedStrategy):
    """The double ring (see the module docstring)."""

    name = "double-ring"

    def supports(self, spec: Any, topology: Any) -> str | None:
        if not topology.uniform:
            return (f"strategy {self.name!r} needs the same number of ranks on every node, "
                    f"the call has {topology.describe()}")
        return None

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        if P == 1:
            return []
        m = spec.M / P
        row = m * spec.B * spec.Hkv * (spec.E + spec.Ev)
        s, a = spec.itemsize, spec.acc_dtype.itemsize
        moves = _moves(topology)
        out_data = sum(moves)
        inside, between = (P - 1 - out_data) * row * s, out_data * row * s
        if backward:  # dK, dV: sent at steps 1 .. P-1, the last one home
            acc_out = sum(moves[1:]) + (topology.n_nodes > 1)
            inside += (P - 1 - acc_out) * row * a
            between += acc_out * row * a
        pieces = max(1, -(-int(m) // max(block, 1)))
        n_in = P - 1 - out_data
        return [p for p in (Phase(inside=inside, messages=n_in * pieces, overlap=True, steps=n_in),
                            Phase(between=between, messages=out_data * pieces, overlap=True,
                                  steps=out_data, sharing=topology.sizes[0])) if p.steps > 0]

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        return blocked_memory(spec, P, block, backward)

    def blocks(self, c: Any, pb: Any, k: Any, v: Any, mask: Any, grads: Sequence[Any] = ()) -> tuple:
        s = pb.spec
        route = Route.two_level(c.topology.nodes, c.rank)
        total = sum(len(row_pieces(seg, pb.block)) for seg in all_segments(s.M, pb.P, s.kv_layout))
        pieces = circulate(c, kv_data(pb, k, v, mask), s.M, s.kv_layout, pb.block, acc_out=grads,
                           route=route)
        return total, (key_block(pb, p.data, np.arange(p.start, p.stop), p.acc) for p in pieces)
