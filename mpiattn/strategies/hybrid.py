"""Two-level attention (USP-style): heads shared out inside a group, a ring across the groups.

The ``P`` ranks form a grid of ``u`` (a head group) by ``r`` (a ring across
the groups), ``u r = P``. An all-to-all inside each head group turns its
members' sequence shards into head shards: member ``j`` holds query heads
``[j H/u, (j+1) H/u)`` of all the group's rows (the union of its members'
rows, :mod:`mpiattn.strategies.heads`). Ring attention
(:mod:`mpiattn.strategies.ring`) then runs across the ``r`` groups on that
head subset, each group's rows one explicit layout; an all-to-all brings the
result back. The backward does the same in reverse. GQA/MQA with fewer
key/value heads than ``u``: a key/value head is replicated inside the group
(each member takes the one its query heads use; LoongTrain's way), not the
whole K/V, and its gradients are summed on the way back. Any ``H >= u`` and any
``Hkv``: the members' query head counts differ by at most one where ``u`` does not divide
``H`` (:func:`mpiattn.strategies.heads.shares`). An ``attn_mask``
moves with the queries (member ``j`` gets its heads' rows of the group's
queries, or all of them for one broadcast head).

Placement (by the communicator's :class:`~mpiattn.comm.topology.Topology`,
the ranks taken node by node): ``head-first`` (the default) puts each head
group inside a node (the all-to-alls stay on the fast links, the ring
crosses nodes: ``1/u`` of the flat ring's bytes between nodes);
``ring-first`` does the opposite, for measurement. ``hybrid:1xP`` is the
ring, ``hybrid:Px1`` all-to-all attention like ulysses (its rows in group
order rather than global).

Per rank, ``n = N/P``, ``m = M/P``: FLOPs as the ring's; words sent: the
all-to-alls' ``(u-1)/u`` of this rank's q, k, v (a replicated key/value head
goes to each member that needs it) and out, and the ring's
``(r-1) u m B (Hkv/u) (E+Ev)`` (``Hkv < u``: ``B (E+Ev)`` per row).
``strategy="hybrid"`` lets the cost model pick ``u x r``;
``"hybrid:2x2"`` fixes it, ``"hybrid:2x2:ring-first"`` also the placement.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend
from ..comm.device import configure
from ..layouts import Layout, all_segments, local_lengths
from .base import (Phase, Strategy, blocked_memory, heads_memory, row_data_bytes, relaid_bytes,
                   ring_phase, sends_out, spread_phase)
from .heads import shares, to_heads, to_rows
from .ring import Ring

__all__ = ["Hybrid", "PLACEMENTS", "divisors"]

#: Where the head groups sit.
PLACEMENTS = ("head-first", "ring-first")

_RING = Ring()


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, increasing (the head-group sizes ``u`` of ``n`` ranks), in
    ``O(sqrt n)``."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


class Hybrid(Strategy):
    """Two-level attention (see the module docstring); unconfigured, the model picks ``u x r``."""

    name = "hybrid"

    def __init__(self, u: int | None = None, r: int | None = None, placement: str = "head-first"):
        if placement not in PLACEMENTS:
            raise ValueError(f"hybrid placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
        self.u, self.r, self.placement = u, r, placement

    def __repr__(self) -> str:
        return f"Hybrid({self.label})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Hybrid) and (self.u, self.r, self.placement) == (
            other.u, other.r, other.placement)

    def __hash__(self) -> int:
        return hash((self.u, self.r, self.placement))

    @property
    def label(self) -> str:
        if self.u is None:
            return self.name
        tail = "" if self.placement == "head-first" else f":{self.placement}"
        return f"{self.name}:{self.u}x{self.r}{tail}"

    @property
    def open_choice(self) -> bool:
        return self.u is None

    def configured(self, options: str) -> "Hybrid":
        grid, _, placement = options.partition(":")
        try:
            u, r = (int(x) for x in grid.lower().split("x"))
        except ValueError:
            raise ValueError(f"strategy 'hybrid:{options}': expected hybrid:UxR (e.g. hybrid:2x2), "
                             "optionally :head-first or :ring-first") from None
        if u < 1 or r < 1:
            raise ValueError(f"strategy 'hybrid:{options}': U and R must be >= 1")
        return Hybrid(u, r, placement or "head-first")

    # ------------------------------------------------------------- what it supports
    @staticmethod
    def _heads_fit(spec: Any, u: int) -> str | None:
        if spec.H < u:
            return f"the query heads H = {spec.H} are fewer than the {u} ranks of a head group"
        return None

    def supports(self, spec: Any, topology: Any) -> str | None:
        P = topology.P
        if self.u is None:
            return None  # u = 1 (the ring) always fits
        if self.u * self.r != P:
            return f"strategy {self.label!r} needs U x R = {self.u * self.r} ranks, the call has {P}"
        why = self._heads_fit(spec, self.u)
        return None if why is None else f"strategy {self.label!r}: {why}"

    def candidates(self, spec: Any, topology: Any) -> list[Strategy]:
        if self.u is not None:
            return [self]
        P = topology.P
        return [Hybrid(u, P // u, self.placement) for u in divisors(P)
                if self._heads_fit(spec, u) is None]

    # ------------------------------------------------------------- the grid
    def grid(self, topology: Any) -> tuple[list[list[int]], list[list[int]]]:
        """``(groups, rings)``: the ranks of each head group (``r`` of ``u``) and of each ring
        (``u`` of ``r``, ring ``i`` holding member ``i`` of every group)."""
        groups = self._groups(topology)
        return groups.tolist(), groups.T.tolist()

    def _groups(self, topology: Any) -> np.ndarray:
        """:meth:`grid`'s groups as an ``(r, u)`` array (its rings are the columns)."""
        order = topology.node_major_array()
        if self.placement == "head-first":
            return order.reshape(self.r, self.u)
        return order.reshape(self.u, self.r).T

    @staticmethod
    def _busiest(sh: Any) -> tuple[int, int]:
        """The most query heads a member of the :func:`~mpiattn.strategies.heads.shares` ``sh``
        holds, and the most key/value heads its engine sees (one per query head where they are
        not grouped)."""
        return max(len(x.q) for x in sh), max(x.kv_width for x in sh)

    # ------------------------------------------------------------- the model
    @staticmethod
    def _a2a_bytes(spec: Any, sh: Any, n: float, m: float, backward: bool) -> float:
        """Bytes the busiest member of a head group (its heads: ``sh``) sends in its all-to-alls
        (``n``, ``m`` query and key rows a member): the other members' heads of its rows in, its
        heads of their rows back."""
        s, a, B, E, Ev, u = spec.itemsize, spec.acc_dtype.itemsize, spec.B, spec.E, spec.Ev, len(sh)
        K = sum(len(x.kv) for x in sh)  # key/value heads received, a replicated one each time
        row_in = E * s + ((1 + sends_out(spec)) * Ev * s + 2 * a if backward else 0)  # q (dout, out, lse, D)
        row_back = E * a if backward else Ev * s + a  # dq; or out and lse
        kv_back = (E + Ev) * a if backward else 0  # dk, dv
        return max(B * n * (spec.H - len(x.q)) * row_in + B * m * (E + Ev) * s * (K - len(x.kv))
                   + (u - 1) * B * (n * len(x.q) * row_back + m * len(x.kv) * kv_back) for x in sh)

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P, u, r = topology.P, self.u, self.r
        n, m, s, a = spec.N / P, spec.M / P, spec.itemsize, spec.acc_dtype.itemsize
        sh = shares(spec.H, spec.Hkv, u)
        seen = self._busiest(sh)[1]
        groups = self._groups(topology)
        mask = row_data_bytes(spec, n) / u if u > 1 else 0.0
        per_dest = self._a2a_bytes(spec, sh, n, m, backward) / max(u - 1, 1) + mask
        calls = ((8 + sends_out(spec)) if backward else 5) + (mask > 0)
        a2a = spread_phase(topology, groups, per_dest, calls * (u - 1)) if u > 1 else None
        step = u * m * spec.B * seen * (spec.E + spec.Ev) * s  # what the ring circulates
        if backward:
            step += u * m * spec.B * seen * (spec.E + spec.Ev) * a
        pieces = max(1, -(-int(u * m) // max(block, 1)))
        ring = ring_phase(topology, groups.T, step, r - 1, pieces)
        return [p for p in (a2a, ring) if p is not None]

    def work(self, spec: Any, topology: Any, row_pairs: Any) -> float:
        """A member computes ``1/u`` of the heads of its group's rows: the busiest group's share / u."""
        total = row_pairs.total
        if total <= 0:
            return 1.0 / topology.P
        per_rank = row_pairs.per_rank(topology.P, spec.layout)
        hq = self._busiest(shares(spec.H, spec.Hkv, self.u))[0]  # (H / u where u divides H)
        return float(per_rank[self._groups(topology)].sum(axis=1).max()) / total * hq / spec.H

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        if self.u is None or self.u == 1:  # a ring over copies of q, out, k, v made by the split
            return blocked_memory(spec, P, block, backward, moved=relaid_bytes(spec, P, out=True))
        hq, seen = self._busiest(shares(spec.H, spec.Hkv, self.u))  # (the busiest's, as every member's)
        return heads_memory(replace(spec, H=hq * self.u, Hkv=seen * self.u), P, block, backward,
                            self.u, circulation="ring" if self.r > 1 else "none")

    # ------------------------------------------------------------- the call
    def _plan(self, c: Any, pb: Any) -> tuple:
        """This rank's group and ring Comms, the head lists, row counts, and the ring's Problem."""
        s = pb.spec
        groups, rings = self.grid(c.topology)
        g = next(i for i, grp in enumerate(groups) if c.rank in grp)
        j = groups[g].index(c.rank)
        gc, rc = c.split(groups[g]), c.split(rings[j])
        for sub in (gc, rc):  # CuPy buffers: the parent's transport (collective on each sub)
            if c.device_transport is not None and sub.device_transport is None:
                configure(sub, transport=c.device_transport.name)
        sh = shares(s.H, s.Hkv, self.u)
        q_heads, kv_heads, me = [list(x.q) for x in sh], [list(x.kv) for x in sh], sh[j]
        q_segs = all_segments(s.N, c.size, s.layout)
        k_segs = all_segments(s.M, c.size, s.kv_layout)
        q_lay = Layout([[(a, a + ln) for rank in grp for a, ln in q_segs[rank]] for grp in groups])
        k_lay = Layout([[(a, a + ln) for rank in grp for a, ln in k_segs[rank]] for grp in groups])
        n_rows = [local_lengths(s.N, c.size, s.layout)[rank] for rank in groups[g]]
        m_rows = [local_lengths(s.M, c.size, s.kv_layout)[rank] for rank in groups[g]]
        spec_r = replace(s, H=len(me.q), Hkv=me.kv_width, layout=q_lay, kv_layout=k_lay)
        pb_r = replace(pb, spec=spec_r, P=self.r, rank=g, strategy=_RING, heads=tuple(q_heads[j]))
        if pb.mods is not None and pb.mods.has_rows and self.u > 1:
            # the modifiers' per-row data: the group's rows of this member's heads (or the one head's)
            pb_r = replace(pb_r, mods=pb.mods.with_rows(
                lambda m: to_heads(gc, m, q_heads if m.shape[1] > 1 else [[0]] * self.u, n_rows),
                q_heads[j][0]))
        return gc, rc, q_heads, kv_heads, n_rows, m_rows, pb_r, me

    @staticmethod
    def _group_mask(gc: Any, mask: Any, m_rows: list) -> Any:
        """The group's padding ``(B, sum m_rows)`` on every member (member order), or None."""
        if mask is None:
            return None
        return to_heads(gc, mask[:, None, :, None], [[0]] * gc.size, m_rows)[:, 0, :, 0]

    def forward(self, c: Any, pb: Any, q: Any, k: Any, v: Any, mask: Any, progress: Any) -> tuple:
        gc, rc, q_heads, kv_heads, n_rows, m_rows, pb_r, me = self._plan(c, pb)
        qh = to_heads(gc, q, q_heads, n_rows)
        kh = me.expand(to_heads(gc, k, kv_heads, m_rows))
        vh = me.expand(to_heads(gc, v, kv_heads, m_rows))
        o, lse = _RING.forward(rc, pb_r, qh, kh, vh, self._group_mask(gc, mask, m_rows), progress)
        out = to_rows(gc, o.astype(pb.spec.dtype, copy=False), q_heads, n_rows, pb.spec.H)
        lse = to_rows(gc, lse[..., None], q_heads, n_rows, pb.spec.H)[..., 0]
        return out, lse

    def backward(self, c: Any, pb: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 D: Any, mask: Any, progress: Any) -> tuple:
        gc, rc, q_heads, kv_heads, n_rows, m_rows, pb_r, me = self._plan(c, pb)
        s = pb.spec
        xp = backend.array_module(lse)
        qh = to_heads(gc, q, q_heads, n_rows)
        kh = me.expand(to_heads(gc, k, kv_heads, m_rows))
        vh = me.expand(to_heads(gc, v, kv_heads, m_rows))
        doh = to_heads(gc, dout, q_heads, n_rows)
        oh = to_heads(gc, out, q_heads, n_rows) if pb.engine.capabilities.needs_out else None
        stats = xp.stack([lse.astype(s.acc_dtype), D], axis=-1)
        sh = to_heads(gc, stats, q_heads, n_rows)
        dq, dk, dv = _RING.backward(rc, pb_r, doh, qh, kh, vh, oh, sh[..., 0], sh[..., 1],
                                    self._group_mask(gc, mask, m_rows), progress)
        return (to_rows(gc, dq, q_heads, n_rows, s.H), to_rows(gc, me.fold(dk), kv_heads, m_rows, s.Hkv),
                to_rows(gc, me.fold(dv), kv_heads, m_rows, s.Hkv))
