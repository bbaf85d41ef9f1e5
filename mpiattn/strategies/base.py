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
from typing import Any, Callable

import numpy as np

from ..kernels import engines

__all__ = ["Phase", "Strategy", "Progress", "report", "blocked_memory", "heads_memory",
           "relaid_bytes", "ring_phase", "spread_phase", "layout_share", "sends_out", "row_data_bytes"]

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


def _ranks(group: Any) -> np.ndarray:
    """Ranks as an int64 array: one group (a sequence, a ``range``: no Python loop) as ``(1, n)``,
    several of equal size (a 2-D array or a list of lists) as ``(groups, n)``."""
    if isinstance(group, range):
        return np.arange(group.start, group.stop, group.step, dtype=np.int64)[None]
    out = np.asarray(group, dtype=np.int64)
    return out.reshape(1, -1) if out.ndim < 2 else out


def _sharing(topology: Any, senders: np.ndarray) -> int:
    """The most ranks of one node among ``senders`` (ranks sending between nodes at once), at least 1."""
    return max(1, int(topology.node_counts(senders).max()))


def ring_phase(topology: Any, rings: Any, step_bytes: float, steps: int, pieces: int = 1) -> Phase:
    """``steps`` ring steps of ``step_bytes`` each over the ranks of ``rings``, in ring order.

    ``rings`` is one ring, or several of one length running at once (a 2-D array,
    one ring a row). A step is as slow as its slowest edge: if any edge joins two
    nodes, the busiest rank is one that sends every step between nodes; the ranks
    at a node's edge share its link. Vectorised: ``O(P)`` for ``P`` ranks in all.
    """
    if steps <= 0 or step_bytes <= 0:
        return Phase(overlap=True)
    ranks = _ranks(rings)
    nodes = topology.nodes_of(ranks)
    cross = nodes != np.roll(nodes, -1, axis=1)  # edge (a, next a), the last one back to the first
    crosses = bool(cross.any())
    total = step_bytes * steps
    return Phase(0.0 if crosses else total, total if crosses else 0.0, steps * pieces, True, steps,
                 _sharing(topology, ranks[cross]))


def spread_phase(topology: Any, groups: Any, bytes_per_dest: float, messages: int) -> Phase:
    """A collective in which each rank of a group sends ``bytes_per_dest`` to every other.

    ``groups`` is one group, or several of one size doing it at once (a 2-D
    array, one group a row). The busiest rank is the one with the most group
    members on other nodes (the fewest on its own); the ranks of groups that
    span nodes share their node's link. Vectorised: ``O(P log P)``.
    """
    ranks = _ranks(groups)
    size = ranks.shape[1]
    if size == 0:
        return Phase(messages=messages)
    nodes = np.sort(topology.nodes_of(ranks), axis=1)
    flat = nodes.ravel()
    starts = np.ones(flat.size + 1, dtype=bool)  # where a run of one node in one group starts
    starts[1:-1] = flat[1:] != flat[:-1]
    starts[size::size] = True
    fewest = int(np.diff(np.flatnonzero(starts)).min())  # members of a group on one node
    spanning = nodes[:, 0] != nodes[:, -1]
    return Phase((fewest - 1) * bytes_per_dest, (size - fewest) * bytes_per_dest, messages, False,
                 sharing=_sharing(topology, ranks[spanning]))


def sends_out(spec: Any) -> int:
    """1 when the call's engine needs the forward's ``out`` in the backward (it then travels), else 0."""
    name = spec.options.engine
    return int(engines.get(engines.AUTO[0] if name == "auto" else name).capabilities.needs_out)


def row_data_bytes(spec: Any, rows: float) -> float:
    """Bytes of ``rows`` query rows of the modifiers' per-row data (an ``attn_mask``) counted as a
    full ``(B, H, rows, M)`` array (:attr:`~mpiattn.masks.MaskSpec.row_itemsize` a pair), 0
    without any: what a head-sharded strategy moves at most (one broadcast head sent to each of
    ``P <= H`` ranks is no more)."""
    return float(rows) * spec.B * spec.H * spec.M * spec.mask.row_itemsize


def layout_share(row_pairs: Any, P: int, layout: Any) -> float:
    """The largest share of all visible pairs one rank's query rows hold under ``layout``.

    ``row_pairs`` is the visible keys of the query rows
    (:class:`mpiattn.strategies.model.RowPairs`); 1/P for a perfect balance.
    """
    total = row_pairs.total
    if total <= 0:
        return 1.0 / P
    return float(row_pairs.per_rank(P, layout).max()) / total


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
        """The largest share of the visible pairs one rank computes (``row_pairs``: the query
        rows', a :class:`mpiattn.strategies.model.RowPairs`)."""
        return layout_share(row_pairs, topology.P, spec.layout)

    def reads(self, spec: Any, topology: Any) -> float:
        """Bytes the busiest rank reads from memory in a forward pass, where that can take longer
        than its compute (a decode step's cache rows); 0: the compute bounds it."""
        return 0.0

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
    mask = int(row_data_bytes(spec, spec.N * u / P)) // u
    return blocked_memory(spec, P, block, backward, heads=u, span=u, circulation=circulation,
                          moved=relaid_bytes(spec, P, out=False) + mask,
                          moved_backward=2 * relaid_bytes(spec, P, out=True) + mask, exchange=True)


def relaid_bytes(spec: Any, P: int, *, out: bool) -> int:
    """Bytes of one rank's share (``1/P``) of ``q``, ``k``, ``v`` (and, with ``out``, of the
    output): what one re-laid-out copy of them holds."""
    q_width = spec.E + (spec.Ev if out else 0)
    return spec.itemsize * spec.B * (spec.N * spec.H * q_width
                                     + spec.M * spec.Hkv * (spec.E + spec.Ev)) // P
