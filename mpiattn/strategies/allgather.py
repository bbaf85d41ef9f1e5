"""All-gather attention: the keys and values gathered in bounded rounds, each attended locally.

Round ``t`` gathers rows ``[t*block, (t+1)*block)`` of every rank's shard
(one collective), so at most ``P block`` rows are held at once; the
backward sums each round's ``dK``, ``dV`` to their owners by a
reduce-scatter. No overlap of transfer and compute.

Costs per rank: the ring's FLOPs; words received ``(P-1) m W`` with
``W = B Hkv (E+Ev)``, in ``ceil(m / block)`` collectives; memory
``P block W`` for a round.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import numpy as np

from .. import backend
from ..layouts import all_segments, positions
from .base import Phase, blocked_memory, spread_phase
from .blocked import BlockedStrategy, KeyBlock, key_block, kv_data

__all__ = ["Allgather"]


def _rows_first(x: Any) -> Any:
    xp = backend.array_module(x)
    return xp.ascontiguousarray(xp.moveaxis(x, -2, 0))


def _blocks(c: Any, pb: Any, k: Any, v: Any, mask: Any, grads: Sequence[Any] = ()) -> tuple:
    xp = backend.array_module(k)
    s = pb.spec
    pos = [positions(seg) for seg in all_segments(s.M, pb.P, s.kv_layout)]
    rounds = max((math.ceil(p.size / pb.block) for p in pos), default=0)

    def blocks() -> Iterator[KeyBlock]:
        for t in range(rounds):
            lo = t * pb.block
            counts = [max(0, min(pb.block, p.size - lo)) for p in pos]
            got = [xp.moveaxis(c.allgatherv_rows(_rows_first(x[..., lo:lo + counts[c.rank], :]), counts), 0, -2)
                   for x in kv_data(pb, k, v, mask)]
            k_idx = np.concatenate([p[lo:lo + n] for p, n in zip(pos, counts)])
            parts = [xp.zeros(x.shape, dtype=s.acc_dtype) for x in got[:2]] if grads else []
            yield key_block(pb, got, k_idx, parts)
            for g, part in zip(grads, parts):
                g[..., lo:lo + counts[c.rank], :] += xp.moveaxis(
                    c.reduce_scatterv_rows(_rows_first(part), counts), 0, -2)

    return rounds, blocks()


class Allgather(BlockedStrategy):
    """All-gather attention (see the module docstring)."""

    name = "allgather"

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        if P == 1:
            return []
        m = spec.M / P
        rounds = max(1, math.ceil(m / max(block, 1)))
        row = spec.B * spec.Hkv * (spec.E + spec.Ev)
        phases = [spread_phase(topology, range(P), m * row * spec.itemsize, rounds * (P - 1))]
        if backward:  # each round's dK, dV summed to their owners
            phases.append(spread_phase(topology, range(P), m * row * spec.acc_dtype.itemsize,
                                       rounds * (P - 1)))
        return phases

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        return blocked_memory(spec, P, block, backward, circulation="gather")

    def blocks(self, c: Any, pb: Any, k: Any, v: Any, mask: Any, grads: Sequence[Any] = ()) -> tuple:
        return _blocks(c, pb, k, v, mask, grads)
