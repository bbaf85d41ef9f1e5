"""What a strategy is: how the rows of a call meet, with its traffic and memory, as one object.

A strategy decides which key/value rows a rank's queries meet and how they
travel (ring, gather, all-to-all, the products, two levels); the engines
(:mod:`mpiattn.kernels`) compute. Every strategy declares:

``supports(spec, topology)``
    None, or why it cannot run the call (e.g. heads that do not divide);
``candidates(spec, topology)``
    the configured variants it may run as (a two-level strategy: one per
    split of the ranks); ``auto`` and the cost model compare them;
``traffic(spec, topology, block, backward)``
    what the busiest rank sends inside its node and between nodes, in how
    many messages, and whether it hides behind compute (:class:`Phase`);
    :mod:`mpiattn.strategies.model` turns it into time on a machine;
``work(spec, topology)``
    the largest share of the visible (query, key) pairs one rank computes;
``memory(spec, P, block, backward)``
    the bytes a rank holds at its peak (inputs included; native engine);
``forward`` / ``backward``
    the call itself, on a validated :class:`mpiattn.strategies.problem.Problem`.

Per rank, ``P`` ranks, ``n = N/P``, ``m = M/P`` rows, ``W = B Hkv (E+Ev)``
words per key/value row: the formulas are in each strategy's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..kernels import engines
from ..layouts import all_segments, positions

__all__ = ["Phase", "Strategy", "Progress", "report", "blocked_memory", "heads_memory",
           "relaid_bytes", "ring_phase", "spread_phase", "layout_share", "sends_out", "mask_bytes"]

Progress = Callable[[int, int], None] | None


def report(progress: Progress, done: int, total: int) -> None:
    """Call ``progress(done, total)`` when a callback was given."""
    if progress is not None:
        progress(done, total)


@dataclass(frozen=True)
class Phase:
    """One communication phase of a pass, as the busiest rank sees it.

    Attributes
    ----------
    inside, between : float
        Bytes it sends to ranks on its own node, and to ranks on other nodes.
    messages : int
        Sequential messages (each pays its link's latency once).
    overlap : bool
        The transfers can hide behind the pass's compute (a ring's do).
    steps : int
        Of a ring: its steps, each hiding behind one block's compute.
    sharing : int
        The ranks of one node (the most on any node) that send between nodes
        at once in this phase, each about as much as the busiest rank: they
        share their node's link to the others
        (:attr:`~mpiattn.strategies.machines.Machine.node_bandwidth`).
    """

    inside: float = 0.0
    between: float = 0.0
    messages: int = 0
    overlap: bool = False
    steps: int = 0
    sharing: int = 1


def _sharing(topology: Any, senders: Sequence[int]) -> int:
    """The most ranks of one node among ``senders`` (ranks sending between nodes at once), at least 1."""
    per_node: dict[int, int] = {}
    for rank in set(senders):
        node = topology.node_of(rank)
        per_node[node] = per_node.get(node, 0) + 1
    return max(per_node.values(), default=1)


def ring_phase(topology: Any, ring: Sequence[int], step_bytes: float, steps: int,
               pieces: int = 1, rings: Sequence[Sequence[int]] | None = None) -> Phase:
    """``steps`` ring steps of ``step_bytes`` each over the ranks ``ring`` (in ring order).

    A step is as slow as its slowest edge: if any edge joins two nodes, the
    busiest rank is one that sends every step between nodes. ``rings``: all
    the rings that run at once (``ring`` among them; default ``ring`` alone),
    whose ranks at a node's edge share its link.
    """
    if steps <= 0 or step_bytes <= 0:
        return Phase(overlap=True)

    def edges(rg: Sequence[int]) -> list[tuple[int, int]]:
        return list(zip(rg, [*rg[1:], rg[0]])) if len(rg) > 1 else []

    crosses = any(not topology.same_node(a, b) for a, b in edges(ring))
    senders = [a for rg in (rings or [ring]) for a, b in edges(rg) if not topology.same_node(a, b)]
    total = step_bytes * steps
    return Phase(0.0 if crosses else total, total if crosses else 0.0, steps * pieces, True, steps,
                 _sharing(topology, senders))


def spread_phase(topology: Any, group: Sequence[int], bytes_per_dest: float,
                 messages: int, groups: Sequence[Sequence[int]] | None = None) -> Phase:
    """A collective in which each rank of ``group`` sends ``bytes_per_dest`` to every other.

    The busiest rank is the one with the most group members on other nodes.
    ``groups``: all the groups doing it at once (``group`` among them; default
    ``group`` alone), whose ranks with members elsewhere share their node's link.
    """
    worst = (0, 0)
    for a in group:
        here = sum(1 for b in group if b != a and topology.same_node(a, b))
        away = len(group) - 1 - here
        worst = max(worst, (away, here))
    away, here = worst
    senders = [a for g in (groups or [group]) for a in g
               if any(not topology.same_node(a, b) for b in g)]
    return Phase(here * bytes_per_dest, away * bytes_per_dest, messages, False,
                 sharing=_sharing(topology, senders))


def sends_out(spec: Any) -> int:
    """1 when the call's engine needs the forward's ``out`` in the backward (it then travels), else 0."""
    name = spec.options.engine
    return int(engines.get(engines.AUTO[0] if name == "auto" else name).capabilities.needs_out)


def mask_bytes(spec: Any, rows: float) -> float:
    """Bytes of ``rows`` query rows of the call's ``attn_mask`` counted as a full ``(B, H, rows, M)``
    one (bool: one byte an entry; float: float64), 0 without one: what a head-sharded strategy
    moves at most (one broadcast head sent to each of ``P <= H`` ranks is no more)."""
    return float(rows) * spec.B * spec.H * spec.M * spec.mask.attn_mask_itemsize


def layout_share(row_pairs: Any, N: int, P: int, layout: Any) -> float:
    """The largest share of all visible pairs one rank's query rows hold under ``layout``.

    ``row_pairs`` is the visible keys of every global query row (``(N,)``);
    1/P for a perfect balance.
    """
    total = float(row_pairs.sum())
    if total <= 0:
        return 1.0 / P
    return max(float(row_pairs[positions(s)].sum()) for s in all_segments(N, P, layout)) / total


class Strategy:
    """A strategy: a name, what it supports, its traffic, work and memory, its forward and backward."""

    name: str = ""
    #: Whether ``strategy="auto"`` may pick it.
    auto: bool = True
    #: Whether it computes through an engine (materialized runs the products instead).
    uses_engine: bool = True

    @property
    def label(self) -> str:
        """The name with its configuration (e.g. ``"hybrid:2x2"``): what a call reports."""
        return self.name

    def supports(self, spec: Any, topology: Any) -> str | None:
        """None when the strategy runs the call ``spec`` on ``topology``'s ranks, else why not."""
        return None

    def candidates(self, spec: Any, topology: Any) -> list["Strategy"]:
        """The configured variants this strategy may run as (most: itself)."""
        return [self]

    @property
    def open_choice(self) -> bool:
        """Whether the cost model chooses among its candidates (an unconfigured ``hybrid``)."""
        return False

    def configured(self, options: str) -> "Strategy":
        """This strategy configured by the text after its name (``"2x2"`` of ``"hybrid:2x2"``)."""
        raise ValueError(f"strategy {self.name!r} takes no configuration, got {options!r}")

    def traffic(self, spec: Any, topology: Any, block: int, backward: bool) -> list[Phase]:
        """The phases of a forward pass (``backward``: of a backward pass)."""
        raise NotImplementedError

    def work(self, spec: Any, topology: Any, row_pairs: Any) -> float:
        """The largest share of the visible pairs one rank computes (``row_pairs`` per query row)."""
        return layout_share(row_pairs, spec.N, topology.P, spec.layout)

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
                   span: int = 1, circulation: str = "ring", moved: int = 0,
                   moved_backward: int | None = None, exchange: bool = False) -> int:
    """Peak bytes per rank of a strategy feeding the native engine blocks (a model).

    Counts, per rank: the inputs (and, for the backward, ``out``, ``lse``, ``dout``), the
    engine's state (folded queries and running accumulators, one accumulation word per query
    row and head), one score tile, the key/value copies the strategy holds while the blocks
    run, and what is made at the end (the output; re-laid-out copies of it). Read off
    ``tracemalloc`` at the busiest block of every strategy (``benchmarks/memory_model``):
    the ring copies its own key/value rows as it sends them and frees them before the output
    is made; all-gather keeps its last round's blocks until then.

    Parameters
    ----------
    heads : int
        The heads are split this many ways (ulysses: ``P``; a hybrid split: its ``U``).
    span : int
        The engine sees the rows of this many ranks (ulysses: ``P``, the whole sequence; a
        hybrid split: ``U``, its group's rows) rather than ``n``.
    circulation : {"ring", "gather", "none"}
        How key/value blocks reach the rank: passed along a ring (its own rows copied as they
        are sent, two pieces received ahead; the backward's key/value gradients travelling
        with them), gathered in rounds of ``P`` pieces (the next round's arriving meanwhile;
        also the ring at ``P = 1``, which sends nothing), or not at all (already local).
    moved : int
        Bytes of re-laid-out copies held through the forward (ulysses' head-sharded arrays).
    moved_backward : int, optional
        The same for the backward (default ``moved``).
    exchange : bool
        The output is re-laid out at the end (a send and a receive buffer of its size).
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
    n_loc, m_loc = min(spec.N, n * span), min(spec.M, m * span)
    Tq, Tk = min(block, max(n_loc, 1)), min(block, max(m_loc, 1))
    BK = max(1, B * Hkv // heads)
    tile_f = a * BK * (Tq * G * (Tk + Ev + 8) + Tk * (E + Ev))
    tile_b = a * BK * (Tq * G * (2 * Tk + E + 4) + 2 * Tk * (E + Ev))
    piece = Tk * kv_row // heads
    if P == 1 and circulation == "ring":  # nothing is sent: the blocks are read off the shard
        circulation = "gather"
    if circulation == "ring":
        pieces_f = s * (m * kv_row + 2 * piece)
        pieces_b = (s + a) * (m * kv_row + 2 * piece)
    elif circulation == "gather":  # a round of P pieces, the next round's P - 1 arriving
        pieces_f = s * (2 * P - 1) * piece
        pieces_b = (s + a) * (2 * P - 1) * piece
    else:
        pieces_f = pieces_b = 0
    rows = a * n_loc * B * H // heads
    state_f = inputs + moved + rows * (E + Ev + 3) + cast * s * n * o_row + tile_f
    # the gathered blocks are still held when the output is made; the ring's are freed by then
    end = s * n * o_row * (3 if exchange else 1) + (pieces_f if circulation == "gather" else 0)
    fwd = max(state_f + pieces_f, state_f + end)
    if not backward:
        return int(fwd)
    moved_b = moved if moved_backward is None else moved_backward
    bwd = (inputs + out_lse + dout + moved_b + rows * (2 * E + Ev + 2) + a * m_loc * kv_row // heads
           + cast * s * (n * q_row + m * kv_row) + tile_b + pieces_b)
    return int(max(fwd, bwd))


def heads_memory(spec: Any, P: int, block: int, backward: bool, u: int, *,
                 circulation: str = "ring") -> int:
    """:func:`blocked_memory` of a strategy that re-lays the sequence out by heads over ``u``
    ranks (ulysses: ``u = P``; a hybrid split ``U x R``: ``u = U``).

    The forward holds head-sharded copies of ``q``, ``k``, ``v`` (and of the ``attn_mask``
    rows) and re-lays the output out at the end; the backward holds those of ``q``, ``out``
    (its statistics), ``dout``, ``k``, ``v`` and of the gradients (twice the forward's).
    """
    mask = int(mask_bytes(spec, spec.N * u / P)) // u
    return blocked_memory(spec, P, block, backward, heads=u, span=u, circulation=circulation,
                          moved=relaid_bytes(spec, P, out=False) + mask,
                          moved_backward=2 * relaid_bytes(spec, P, out=True) + mask, exchange=True)


def relaid_bytes(spec: Any, P: int, *, out: bool) -> int:
    """Bytes of one rank's share (``1/P``) of ``q``, ``k``, ``v`` (and, with ``out``, of the
    output): what one re-laid-out copy of them holds."""
    q_width = spec.E + (spec.Ev if out else 0)
    return spec.itemsize * spec.B * (spec.N * spec.H * q_width
                                     + spec.M * spec.Hkv * (spec.E + spec.Ev)) // P
