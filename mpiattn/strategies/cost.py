"""The cost model behind ``strategy="auto"``.

Per rank, ``P`` ranks, ``n = N/P``, ``m = M/P``: the ring sends
``(P-1) m Hkv (E+Ev)`` words; ulysses' all-to-alls move
``(P-1)/P (n H (E+Ev) + m Hkv (E+Ev))`` words (and need the head counts
divisible by ``P``); allgather is one collective per round instead of
``P-1`` exchanges, best when every shard fits in one block.
"""

from __future__ import annotations

import math

__all__ = ["choose_strategy"]


def choose_strategy(N: int, M: int, H: int, Hkv: int, E: int, Ev: int, P: int, block: int) -> str:
    """The cost model behind ``strategy="auto"`` (see the module docstring)."""
    if P == 1:
        return "ring"
    n, m = N / P, M / P
    ring_words = (P - 1) * m * Hkv * (E + Ev)
    ulysses_words = (P - 1) / P * (n * H * (E + Ev) + m * Hkv * (E + Ev))
    if H % P == 0 and Hkv % P == 0 and ulysses_words < ring_words:
        return "ulysses"
    if math.ceil(m) <= block:
        return "allgather"
    return "ring"
