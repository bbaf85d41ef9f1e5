"""The cost model: a strategy's work and traffic on a machine, as time.

For a call (:class:`~mpiattn.strategies.spec.AttentionSpec`), a topology
(:class:`~mpiattn.comm.topology.Topology`) and a machine
(:class:`~mpiattn.strategies.machines.Machine`)::

    compute  = max(FLOPs x (the busiest rank's share of the visible pairs) / rate,
                 bytes it reads / memory bandwidth)   (reads: 0 but a decode step's)
    phase    = messages x latency + max(inside / bw_inside, between / bw_between')
               bw_between' = min(bw_between, node_bandwidth / sharing)
    pass     = compute + the phases that cannot overlap
               + for each ring step, the larger over its link classes of
                 max(transfer - overlap x one block's compute, (1 - overlap) x transfer)
               (overlap: the machine's ``overlap`` inside a node, ``overlap_between``
               between nodes)

with FLOPs ``2 B H (E + Ev)`` per visible (query, key) pair forward and 2.5
times that backward (five GEMMs against two), the backward's rate
``backward_ratio`` times the forward's, and the phases those the strategy
declares (:meth:`~mpiattn.strategies.base.Strategy.traffic`, the busiest
rank's bytes per link class, and how many ranks of a node send between
nodes at once: they share the node's link, where the machine knows its
``node_bandwidth``). Visible pairs count the causal and window
rules; documents and padding are not counted (the model then overestimates
the compute, alike for every strategy). ``auto`` takes the candidate with the
smallest predicted forward+backward time among those whose memory per rank
fits the machine's (:func:`choose`); ``python -m mpiattn plan`` prints the
whole table. The inference calls are strategies of their own, priced by
:func:`predict` alike (:mod:`mpiattn.inference.pricing`): a decode step
(compute or its memory read, :meth:`~mpiattn.strategies.base.Strategy.reads`,
whichever is longer, then the tree merge's phase) and a chunked prefill's
two variants (pass-KV a ring, pass-Q two collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..layouts import all_segments
from .base import Phase, Strategy
from .machines import Machine

__all__ = ["Prediction", "RowPairs", "flops_per_pair", "compute_time", "pass_time",
           "predict", "choose"]

#: Backward FLOPs per forward FLOP (five GEMMs per tile against two).
BACKWARD_FLOPS = 2.5


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one configured strategy.

    Attributes
    ----------
    strategy : str
        Its label (e.g. ``"hybrid:2x2"``).
    forward_s, backward_s : float
        Seconds of a forward pass and of a backward pass.
    compute_s : float
        Of the forward, the busiest rank's compute.
    inside, between : float
        Bytes the busiest rank sends inside its node and between nodes, forward
        plus backward.
    memory : int
        Peak bytes per rank (forward and backward, native engine).
    ideal_s : float
        Forward plus backward of the whole call on one rank, divided by the
        number of ranks: perfect balance, no communication.
    """

    strategy: str
    forward_s: float
    backward_s: float
    compute_s: float
    inside: float
    between: float
    memory: int
    ideal_s: float

    @property
    def fwdbwd_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def efficiency(self) -> float:
        """Parallel efficiency of forward plus backward: ``ideal_s / fwdbwd_s``."""
        return self.ideal_s / self.fwdbwd_s if self.fwdbwd_s > 0 else 1.0


class RowPairs:
    """The visible keys of a call's query rows, summed over ranges of rows.

    What the model's work and balance read: the pairs of all rows (:attr:`total`),
    of rows ``[0, i)`` (:meth:`before`) and of every rank's rows under a layout
    (:meth:`per_rank`). Made from the causal and window rules in closed form
    (:meth:`of_spec`: no array of ``N`` rows, whatever ``N``), or from counted
    keys per row (:meth:`counted`: an ``attn_mask`` or ``mask_mod``,
    :mod:`mpiattn.masks.counts`).
    """

    def __init__(self, n: int, before: Callable[[np.ndarray], np.ndarray]):
        self.n, self._before = int(n), before
        self.total = float(before(np.array([self.n]))[0])
        self._ranks: dict[tuple, np.ndarray] = {}

    @classmethod
    def of_spec(cls, spec: Any) -> "RowPairs":
        """The pairs the causal and window rules leave (:meth:`mpiattn.masks.MaskSpec.band`;
        documents and padding not counted): row ``i`` sees keys ``i + lo .. i + hi`` of ``M``."""
        lo, hi = spec.mask.band()
        M = float(spec.M)

        def below(c: float, rows: np.ndarray) -> np.ndarray:
            """Sum over rows ``r < rows`` of ``clip(r + c, 0, M)``: keys ``j < r + c``."""
            if c == np.inf:
                return M * rows
            if c == -np.inf:
                return np.zeros_like(rows)
            return _clipped_sum(rows + c, M) - _clipped_sum(np.full_like(rows, c), M)

        return cls(spec.N, lambda rows: below(hi + 1, rows) - below(lo, rows))

    @classmethod
    def counted(cls, per_row: np.ndarray) -> "RowPairs":
        """From the visible keys of every query row, ``(N,)``."""
        cumulative = np.concatenate(([0.0], np.cumsum(per_row, dtype=np.float64)))
        return cls(len(per_row), lambda rows: cumulative[rows.astype(np.int64)])

    @classmethod
    def of(cls, spec: Any, pairs: Any = None) -> "RowPairs":
        """``pairs`` as a :class:`RowPairs`: itself, counted keys per row (an array), or, None,
        :meth:`of_spec`."""
        if isinstance(pairs, RowPairs):
            return pairs
        return cls.of_spec(spec) if pairs is None else cls.counted(np.asarray(pairs))

    def before(self, rows: Any) -> np.ndarray:
        """The visible pairs of rows ``[0, i)`` for every ``i`` of ``rows``, float64."""
        return self._before(np.asarray(rows, dtype=np.float64))

    def per_rank(self, P: int, layout: Any) -> np.ndarray:
        """The visible pairs of each rank's query rows under ``layout`` on ``P`` ranks, ``(P,)``
        (kept: the strategies and splits of one call ask alike)."""
        key = (P, layout)
        if key not in self._ranks:
            segs = all_segments(self.n, P, layout)
            owner = np.repeat(np.arange(P), [len(s) for s in segs])
            start, length = (np.array([x[i] for s in segs for x in s], dtype=np.float64)
                             for i in (0, 1))
            pairs = self.before(start + length) - self.before(start)
            self._ranks[key] = np.bincount(owner, weights=pairs, minlength=P)
        return self._ranks[key]


def _clipped_sum(y: np.ndarray, M: float) -> np.ndarray:
    """``sum over x < y of clip(x, 0, M)`` for integers ``x`` (0 for ``y <= 0``), float64."""
    low = np.clip(y, 0.0, M)
    return low * (low - 1.0) / 2.0 + M * np.maximum(y - M, 0.0)


def flops_per_pair(B: int, H: int, E: int, Ev: int) -> float:
    """Forward FLOPs of one visible (query, key) pair over the batch and the heads: the two
    products' ``2 B H (E + Ev)``."""
    return 2.0 * B * H * (E + Ev)


def compute_time(flops: float, machine: Machine, rate_dtype: Any, read_bytes: float = 0.0) -> float:
    """Seconds of ``flops`` forward FLOPs at the machine's rate for ``rate_dtype``, or of reading
    ``read_bytes`` from memory at its bandwidth (a decode step), whichever is longer."""
    read = read_bytes / machine.memory_bandwidth if machine.memory_bandwidth > 0 else 0.0
    return max(flops / machine.rate(rate_dtype), read)


def _link_times(p: Phase, machine: Machine) -> tuple[float, float]:
    """Seconds of phase ``p`` on each link class, ``(inside, between)``, each with the phase's
    messages' latency (the between link's when any byte crosses; between is 0 when none does)."""
    between = machine.between.bandwidth
    if machine.node_bandwidth > 0:  # the node's ranks sending at once share its link
        between = min(between, machine.node_bandwidth / max(p.sharing, 1))
    crosses = p.between > 0
    latency = p.messages * (machine.between if crosses else machine.inside).latency_s
    return (latency + p.inside / machine.inside.bandwidth,
            latency + p.between / between if crosses else 0.0)


def _phase_time(p: Phase, machine: Machine) -> float:
    """Seconds of a phase: its messages' latency and its slower link class."""
    return max(_link_times(p, machine))


def _exposed(transfer: float, compute: float, overlap: float) -> float:
    """What a transfer leaves exposed beside ``compute``, ``overlap`` of it able to hide."""
    return max(transfer - overlap * compute, (1.0 - overlap) * transfer)


def pass_time(compute: float, phases: Sequence[Phase], machine: Machine) -> float:
    """Compute, the phases that cannot overlap, and what the ring steps leave exposed: each
    step hides behind one block's compute (``compute / (steps + 1)``, the first block needing
    no transfer), its transfer inside a node up to the machine's ``overlap``, between nodes up
    to its ``between_overlap``; the step waits for the class that leaves more exposed."""
    fixed = sum(_phase_time(p, machine) for p in phases if not p.overlap)
    rings = [p for p in phases if p.overlap and p.steps > 0]
    per_step = compute / (sum(p.steps for p in rings) + 1)
    exposed = 0.0
    for p in rings:
        inside, between = (t / p.steps for t in _link_times(p, machine))
        exposed += p.steps * max(_exposed(inside, per_step, machine.overlap),
                                 _exposed(between, per_step, machine.between_overlap))
    return compute + fixed + exposed


def predict(strategy: Strategy, spec: Any, topology: Any, block: int, machine: Machine,
            pairs: Any = None, rate_dtype: str | None = None) -> Prediction:
    """The model's :class:`Prediction` for ``strategy`` (configured) running ``spec`` on ``topology``.

    ``pairs``: the visible keys of the query rows, as :meth:`RowPairs.of` takes them (None:
    the spec's rules; pass one :class:`RowPairs` to many calls to share its sums);
    ``rate_dtype`` names the compute rate to use when it is not the spec's dtype
    (``plan`` sizes bfloat16 as float16, both two bytes, and times it as bfloat16).
    """
    pairs = RowPairs.of(spec, pairs)
    total = flops_per_pair(spec.B, spec.H, spec.E, spec.Ev) * pairs.total
    rate = machine.rate(rate_dtype or spec.dtype)
    bwd_rate = rate * machine.backward_ratio
    share = strategy.work(spec, topology, pairs)
    fwd_compute = compute_time(total * share, machine, rate_dtype or spec.dtype,
                               strategy.reads(spec, topology))
    bwd_compute = BACKWARD_FLOPS * total * share / bwd_rate
    fwd_phases = strategy.traffic(spec, topology, block, backward=False)
    bwd_phases = strategy.traffic(spec, topology, block, backward=True)
    phases = [*fwd_phases, *bwd_phases]
    ideal = (total / rate + BACKWARD_FLOPS * total / bwd_rate) / topology.P
    return Prediction(strategy.label, pass_time(fwd_compute, fwd_phases, machine),
                      pass_time(bwd_compute, bwd_phases, machine), fwd_compute,
                      sum(p.inside for p in phases), sum(p.between for p in phases),
                      strategy.memory(spec, topology.P, block, True), ideal)


def choose(strategies: Sequence[Strategy], spec: Any, topology: Any, block: int,
           machine: Machine, rate_dtype: str | None = None,
           pairs: Any = None) -> tuple[Strategy, Prediction]:
    """The candidate with the smallest predicted forward+backward time among those whose
    memory fits the machine's (all of them when none fits); ties go to the first. ``pairs``
    as in :func:`predict`."""
    pairs = RowPairs.of(spec, pairs)
    preds = [(s, predict(s, spec, topology, block, machine, pairs, rate_dtype)) for s in strategies]
    if not preds:
        raise ValueError("no strategy supports this call")
    fitting = [sp for sp in preds if machine.fits(sp[1].memory)] or preds
    return min(fitting, key=lambda sp: sp[1].fwdbwd_s)
