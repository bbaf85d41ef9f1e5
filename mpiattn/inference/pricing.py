"""The inference calls priced by the cost model's one entry point, like the attention strategies.

A chunked prefill's two variants and a decode step are
:class:`~mpiattn.strategies.base.Strategy` objects that declare their work, traffic and memory
reads; :func:`mpiattn.strategies.model.predict` turns them into time as it does a ring's
(:mod:`mpiattn.strategies.model`). Their call is a :func:`chunk_spec`: ``N`` new queries at the
end of ``M`` keys (the cache's rows and the new rows), bottom-right causal, with the call's
window; its visible pairs are the rules' (:class:`~mpiattn.strategies.model.RowPairs`: causal and
window in closed form) or, with an ``attn_mask`` or ``mask_mod``, the counted ones the caller
passes.

``pass-kv`` (:class:`PassKV`)
    A ring over the ``M`` keys (the chunk's queries stay, sharded by their layout): the ring's
    traffic, work and memory on the chunk's call.
``pass-q`` (:class:`PassQ`)
    The queries gathered on every rank (each rank sends its ``ceil(N / P)`` rows to the
    ``P - 1`` others), every rank attending them with its own keys, the partials ``(o, lse)``
    sent back in one all-to-all; nothing overlaps. The keys a rank holds are whole pages
    (:mod:`mpiattn.inference.placement`) dealt round the ranks, so the keys the rules leave
    visible (the last ``N + window`` positions under a window) are spread over
    ``min(P, ceil(span / page))`` ranks: the busiest computes that share.
``decode`` (:class:`DecodeStep`)
    A step of ``N`` new queries against the cache: each rank computes, or reads from memory
    (whichever is longer), the visible keys it holds (spread as pass-Q's), then the partials
    meet in a tree merge (``2 ceil(log2 P)`` messages of ``B N H (Ev + 1)`` accumulation words,
    between nodes when there are several).
"""

from __future__ import annotations

import math
from typing import Any

from ..strategies.base import Phase, Strategy, blocked_memory, spread_phase
from ..strategies.ring import Ring
from ..strategies.spec import AttentionSpec, Options
from .placement import PAGE_ROWS

__all__ = ["PassKV", "PassQ", "DecodeStep", "chunk_spec", "key_span"]


def chunk_spec(B: int, H: int, Hkv: int, N: int, cached: int, E: int, Ev: int, dtype: Any,
               window: Any = None, layout: Any = "contiguous") -> AttentionSpec:
    """The call of ``N`` new queries (sharded by ``layout``) after ``cached`` rows: ``M = cached +
    N`` keys, bottom-right causal, ``window`` measured from each query's absolute position."""
    o = Options(causal="bottom-right", window=window, layout=layout, kv_layout="contiguous")
    M = int(cached) + int(N)
    return AttentionSpec.from_shapes((B, H, N, E), (B, Hkv, M, E), (B, Hkv, M, Ev), dtype, o)


def key_span(spec: AttentionSpec) -> int:
    """How many consecutive key positions the rules leave visible to some query row (all ``M``
    without a window)."""
    lo, hi = spec.mask.band()
    first = 0 if lo == -math.inf else max(0, int(lo))
    last = spec.M - 1 if hi == math.inf else min(spec.M - 1, spec.N - 1 + int(hi))
    return max(0, last - first + 1)


def _holders(spec: AttentionSpec, P: int, page: int) -> int:
    """The ranks holding the visible keys: whole pages dealt round ``P`` ranks."""
    return max(1, min(P, -(-key_span(spec) // max(int(page), 1))))


class PassKV(Ring):
    """pass-KV: the ring's forward on the chunk's call (no backward: inference)."""

    name = "pass-kv"
    auto = False

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        return [] if backward else super().traffic(spec, topology, block, False)


class PassQ(Strategy):
    """pass-Q: the queries gathered, the partials sent back (module docstring).

    Parameters
    ----------
    page : int
        Rows per page of the cache (how its keys are spread).
    """

    name = "pass-q"
    auto = False

    def __init__(self, page: int = PAGE_ROWS):
        self.page = int(page)

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        if backward or P == 1:
            return []
        rows = -(-spec.N // P)
        per_row = spec.B * spec.H
        return [spread_phase(topology, range(P), rows * per_row * spec.E * spec.itemsize, P - 1),
                spread_phase(topology, range(P),
                             rows * per_row * (spec.Ev + 1) * spec.acc_dtype.itemsize, P - 1)]

    def work(self, spec: Any, topology: Any, row_pairs: Any) -> float:
        return 1.0 / _holders(spec, topology.P, self.page)

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        return blocked_memory(spec, P, block, False)


class DecodeStep(PassQ):
    """A decode step: compute or memory read of the visible keys a rank holds, then the tree
    merge (module docstring)."""

    name = "decode"

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        P = topology.P
        if backward or P == 1:
            return []
        steps = 2 * math.ceil(math.log2(P))
        nbytes = steps * self.merge_bytes(spec)
        side = {"between": nbytes} if topology.n_nodes > 1 else {"inside": nbytes}
        return [Phase(messages=steps, **side)]

    def merge_bytes(self, spec: Any) -> float:
        """Bytes of one merge message: ``B N H (Ev + 1)`` accumulation words."""
        return float(spec.B * spec.N * spec.H * (spec.Ev + 1) * spec.acc_dtype.itemsize)

    def reads(self, spec: Any, topology: Any) -> float:
        span = key_span(spec)
        rows = span / _holders(spec, topology.P, self.page)
        return rows * spec.B * spec.Hkv * (spec.E + spec.Ev) * spec.itemsize
