"""Ulysses attention: all-to-all from sequence-sharded to head-sharded and back.

Each rank attends its ``H/P`` heads over the whole sequence with the local
engine (Jacobs et al. 2023, DeepSpeed-Ulysses). Any ``H >= P`` and any ``Hkv``:
where ``P`` does not divide ``H`` and ``Hkv``, the ranks hold ``H // P`` or
``H // P + 1`` query heads and every key/value head their query heads use (a
key/value head replicated on the ranks that share it, its gradients summed on
the way back): the all-to-all of the hybrid's one head group of ``P`` ranks
(``hybrid:Px1``, :func:`mpiattn.strategies.heads.shares`), which this strategy
then runs.

An ``attn_mask`` moves with the queries: each rank gets its heads' rows of
every query, ``(1 or B, H/P, N, M)``, or all of one broadcast head,
``(1 or B, 1, N, M)``, in one more all-to-all per pass.

Costs per rank: the ring's FLOPs; words sent forward
``(P-1)/P B (n H (E+Ev) + m Hkv (E+Ev))`` in five all-to-alls (q, k, v in;
out, lse back), and an ``attn_mask``'s rows (counted as ``(B, H)`` ones, at
most what either shape sends); memory: the head-sharded copies of the whole
sequence, ``B (N (H E + H Ev) + M Hkv (E+Ev)) / P`` words, the moved mask,
``B (H/P) N M`` entries at most, and one tile.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import Comm
from ..layouts import all_segments, local_lengths
from ..masks.ids import global_rows
from .base import Phase, Strategy, heads_memory, row_data_bytes, sends_out, spread_phase
from .blocked import KeyBlock, run_backward, run_forward
from .hybrid import Hybrid

__all__ = ["Ulysses"]


def _seq_to_heads(c: Comm, x: Any, n_total: int, layout: Any) -> Any:
    """``(B, Hx, n_r, F)`` sequence-sharded -> ``(B, Hx/P, n_total, F)`` head-sharded, global order."""
    xp = backend.array_module(x)
    P = c.size
    B, Hx, n, F = x.shape
    hp = Hx // P
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    send = xp.ascontiguousarray(x.reshape(B, P, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(-1, F)
    got = c.alltoallv_rows(send, [B * hp * n] * P, [B * hp * ln for ln in lengths])
    out = xp.empty((B, hp, n_total, F), dtype=x.dtype)
    pos = 0
    for s in range(P):
        block = got[pos:pos + B * hp * lengths[s]].reshape(B, hp, lengths[s], F)
        pos += B * hp * lengths[s]
        local = 0
        for g, ln in segs[s]:
            out[:, :, g:g + ln] = block[:, :, local:local + ln]
            local += ln
    return out


def _heads_to_seq(c: Comm, y: Any, n_total: int, layout: Any) -> Any:
    """Inverse of :func:`_seq_to_heads`: ``(B, Hx/P, N, F)`` -> ``(B, Hx, n_r, F)``."""
    xp = backend.array_module(y)
    P = c.size
    B, hp, _, F = y.shape
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    parts = []
    for d in range(P):
        rows = [y[:, :, g:g + ln] for g, ln in segs[d]]
        blk = xp.concatenate(rows, axis=2) if rows else xp.empty((B, hp, 0, F), dtype=y.dtype)
        parts.append(xp.ascontiguousarray(blk).reshape(-1, F))
    send = xp.concatenate(parts, axis=0) if parts else xp.empty((0, F), dtype=y.dtype)
    n = lengths[c.rank]
    got = c.alltoallv_rows(send, [B * hp * ln for ln in lengths], [B * hp * n] * P)
    return xp.ascontiguousarray(got.reshape(P, B, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(B, P * hp, n, F)


def _moved_rows(c: Comm, pb: Any) -> Any:
    """``pb`` with the modifiers' per-row data moved to this rank's heads of every query (global
    order), as the queries are."""
    mods = pb.mods
    if mods is None or not mods.has_rows:
        return pb
    if c.size == 1 and all_segments(pb.spec.N, 1, pb.spec.layout)[0] == [(0, pb.spec.N)]:
        return pb  # one rank whose rows are in global order already
    P = c.size

    def move(m: np.ndarray) -> np.ndarray:
        if m.shape[1] == 1:  # one head for all: every rank needs every row
            m = np.broadcast_to(m, (m.shape[0], P) + m.shape[2:])
        return _seq_to_heads(c, m, pb.spec.N, pb.spec.layout)

    return replace(pb, mods=mods.with_rows(move, c.rank * (pb.spec.H // P)))


def _whole(c: Comm, pb: Any, kh: Any, vh: Any, mask: Any, grads: tuple = ()) -> tuple:
    """This rank's heads of every query against one block of every key (the runner's input)."""
    pb = _moved_rows(c, pb)
    s = pb.spec
    pad = global_rows(c, mask, s.M, s.kv_layout) if s.mask.padding else None
    hp = s.H // pb.P
    attend = pb.attend(pb.queries(np.arange(s.N), np.arange(pb.rank * hp, (pb.rank + 1) * hp)),
                       heads=pb.P)
    return attend, [KeyBlock(kh, vh, np.arange(s.M), pad, *grads)]


class Ulysses(Strategy):
    """Ulysses attention (see the module docstring)."""

    name = "ulysses"

    @staticmethod
    def _uneven(spec: Any, P: int) -> Hybrid | None:
        """The head group that runs a call whose heads ``P`` does not divide (else None)."""
        return Hybrid(P, 1) if spec.H % P or spec.Hkv % P else None

    def supports(self, spec: Any, topology: Any) -> str | None:
        P = topology.P
        if spec.H < P:
            return (f"strategy 'ulysses' needs at least one query head per rank: H = {spec.H} "
                    f"heads, {P} ranks; use 'ring' or 'allgather', or fewer ranks")
        return None

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        if (group := self._uneven(spec, P)) is not None:
            return group.traffic(spec, topology, block, backward)
        if P == 1:
            return []
        n, m, s = spec.N / P, spec.M / P, spec.itemsize
        a = spec.acc_dtype.itemsize
        q, o, kv = spec.B * spec.H * spec.E, spec.B * spec.H * spec.Ev, spec.B * spec.Hkv * (spec.E + spec.Ev)
        mask = row_data_bytes(spec, n)
        if not backward:  # q, k, v (and the modifiers' per-row data) in; out, lse back
            per_rank = n * q * s + m * kv * s + n * o * s + n * spec.B * spec.H * a + mask
            return [spread_phase(topology, range(P), per_rank / P, (5 + (mask > 0)) * (P - 1))]
        # q, k, v, dout, out (for an engine that needs it), lse and D in; dq, dk, dv back
        # (accumulation dtype)
        out = sends_out(spec)
        per_rank = ((n * q + m * kv) * (s + a) + (1 + out) * n * o * s + 2 * n * spec.B * spec.H * a
                    + mask)
        return [spread_phase(topology, range(P), per_rank / P, (8 + out + (mask > 0)) * (P - 1))]

    def work(self, spec: Any, topology: Any, row_pairs: Any) -> float:
        """Every rank attends the whole sequence for its heads: an even share (the most heads a
        rank holds, where they do not divide)."""
        return -(-spec.H // topology.P) / spec.H

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        if (group := self._uneven(spec, P)) is not None:
            return group.memory(spec, P, block, backward)
        return heads_memory(spec, P, block, backward, P, circulation="none")

    def forward(self, c: Comm, pb: Any, q: Any, k: Any, v: Any, mask: Any,
                progress: Any) -> tuple[Any, Any]:
        if (group := self._uneven(pb.spec, c.size)) is not None:
            return group.forward(c, pb, q, k, v, mask, progress)
        s = pb.spec
        qh = _seq_to_heads(c, q, s.N, s.layout)
        kh = _seq_to_heads(c, k, s.M, s.kv_layout)
        vh = _seq_to_heads(c, v, s.M, s.kv_layout)
        attend, blocks = _whole(c, pb, kh, vh, mask)
        o, lse, _ = run_forward(attend, qh, iter(blocks), 1, progress)
        o = o.astype(s.dtype, copy=False)
        return (_heads_to_seq(c, o, s.N, s.layout),
                _heads_to_seq(c, lse[..., None], s.N, s.layout)[..., 0])

    def backward(self, c: Comm, pb: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 D: Any, mask: Any, progress: Any) -> tuple[Any, Any, Any]:
        if (group := self._uneven(pb.spec, c.size)) is not None:
            return group.backward(c, pb, dout, q, k, v, out, lse, D, mask, progress)
        xp = backend.array_module(q)
        s = pb.spec
        qh = _seq_to_heads(c, q, s.N, s.layout)
        kh = _seq_to_heads(c, k, s.M, s.kv_layout)
        vh = _seq_to_heads(c, v, s.M, s.kv_layout)
        doh = _seq_to_heads(c, dout, s.N, s.layout)
        stats = _seq_to_heads(c, xp.stack([lse.astype(s.acc_dtype), D], axis=-1), s.N, s.layout)
        oh = _seq_to_heads(c, out, s.N, s.layout) if pb.engine.capabilities.needs_out else None
        dk = xp.zeros(kh.shape, dtype=s.acc_dtype)
        dv = xp.zeros(vh.shape, dtype=s.acc_dtype)
        attend, blocks = _whole(c, pb, kh, vh, mask, (dk, dv))
        dq = run_backward(attend, doh, qh, oh, stats[..., 0], stats[..., 1], iter(blocks), 1,
                          progress)
        return (_heads_to_seq(c, dq, s.N, s.layout), _heads_to_seq(c, dk, s.M, s.kv_layout),
                _heads_to_seq(c, dv, s.M, s.kv_layout))
