"""What a strategy is: how the rows of a call meet, with its cost and memory, as one object.

A strategy decides which key/value rows a rank's queries meet and how they
travel (ring, gather, all-to-all, the products); the engines
(:mod:`mpiattn.kernels`) compute. Every strategy declares:

``supports(spec, P)``
    None, or why it cannot run the call (e.g. heads that do not divide);
``cost(spec, P, block)``
    what a rank sends and in how many sequential steps (:class:`Cost`),
    from which ``auto`` picks the cheapest supported strategy;
``memory(spec, P, block, backward)``
    the bytes a rank holds at its peak (inputs included; native engine);
``forward`` / ``backward``
    the call itself, on a validated :class:`mpiattn.strategies.problem.Problem`.

Costs per rank, ``P`` ranks, ``n = N/P``, ``m = M/P`` rows, ``W = B Hkv (E+Ev)``
words per key/value row: the formulas are in each strategy's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Cost", "Strategy", "Progress", "report", "blocked_memory"]

Progress = Callable[[int, int], None] | None


def report(progress: Progress, done: int, total: int) -> None:
    """Call ``progress(done, total)`` when a callback was given."""
    if progress is not None:
        progress(done, total)


@dataclass(frozen=True, order=True)
class Cost:
    """What one rank sends in a forward pass, for comparing strategies.

    Attributes
    ----------
    words : float
        Words (array elements) this rank sends.
    steps : int
        Sequential communication steps (exchanges or collectives).
    """

    words: float
    steps: int


class Strategy:
    """A strategy: a name, what it supports, its cost and memory, its forward and backward."""

    name: str = ""
    #: Whether ``strategy="auto"`` may pick it.
    auto: bool = True
    #: Whether it computes through an engine (materialized runs the products instead).
    uses_engine: bool = True

    def supports(self, spec: Any, P: int) -> str | None:
        """None when the strategy runs the call ``spec`` on ``P`` ranks, else why not."""
        return None

    def cost(self, spec: Any, P: int, block: int) -> Cost:
        raise NotImplementedError

    def memory(self, spec: Any, P: int, block: int, backward: bool) -> int:
        raise NotImplementedError

    def forward(self, c: Any, pb: Any, q: Any, k: Any, v: Any, mask: Any,
                progress: Progress) -> tuple[Any, Any]:
        """``out (B, H, n, Ev)``, ``lse (B, H, n)`` (accumulation dtype)."""
        raise NotImplementedError

    def backward(self, c: Any, pb: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
        """``dq``, ``dk``, ``dv`` (accumulation dtype)."""
        raise NotImplementedError


def blocked_memory(spec: Any, P: int, block: int, backward: bool, *, heads: int = 1,
                   whole: bool = False, rounds: int = 1, moved: int = 0) -> int:
    """Peak bytes per rank of a strategy feeding the native engine blocks (a model).

    Counts the inputs and outputs of this rank, the folded queries and the
    running accumulators (one accumulation word per query row and head),
    one score tile, and the key/value pieces in flight.

    Parameters
    ----------
    heads : int
        The heads are split this many ways (ulysses: ``P``).
    whole : bool
        The engine sees the whole sequence (ulysses) rather than ``n`` rows.
    rounds : int
        Blocks gathered at once per rank (allgather: ``P``).
    moved : int
        Bytes of re-laid-out copies (ulysses' head-sharded arrays).
    """
    B, H, Hkv, E, Ev = spec.B, spec.H, spec.Hkv, spec.E, spec.Ev
    s, a = spec.itemsize, np.dtype(spec.acc_dtype).itemsize
    cast = 0 if s == a else 1  # float16 keeps float32 copies besides the inputs
    n, m = -(-spec.N // P), -(-spec.M // P)
    G = H // Hkv
    q_row, o_row, kv_row = B * H * E, B * H * Ev, B * Hkv * (E + Ev)
    inputs = s * (n * q_row + m * kv_row)
    out_lse = s * n * o_row + a * B * H * n
    dout = s * n * o_row
    n_loc, m_loc = (spec.N, spec.M) if whole else (n, m)
    Tq, Tk = min(block, max(n_loc, 1)), min(block, max(m_loc, 1))
    BK = max(1, B * Hkv // heads)
    tile_f = a * BK * (Tq * G * (Tk + Ev + 8) + Tk * (E + Ev))
    tile_b = a * BK * (Tq * G * (2 * Tk + E + 4) + 2 * Tk * (E + Ev))
    pieces_f = 3 * rounds * Tk * kv_row * s
    pieces_b = pieces_f + 3 * rounds * Tk * kv_row * a
    rows = a * n_loc * B * H // heads
    fwd = inputs + moved + rows * (E + 2 * Ev + 3) + cast * s * n * o_row + tile_f + pieces_f
    if not backward:
        return int(fwd)
    bwd = (inputs + out_lse + dout + moved + rows * (2 * E + Ev + 2) + a * m_loc * kv_row // heads
           + cast * s * (n * q_row + m * kv_row) + tile_b + pieces_b)
    return int(max(fwd, bwd))
