"""The strategies, in one registry, and the rule behind ``strategy="auto"``.

``auto`` takes, among the strategies that support the call and may be
picked (``auto = False``: materialized never is), and their configured
variants (a two-level strategy: every split of the ranks), the one the cost
model (:mod:`mpiattn.strategies.model`) predicts fastest, forward plus
backward, on the call's machine (:mod:`mpiattn.strategies.machines`); ties go
to the first in :data:`STRATEGIES` (the ring). ``strategy="hybrid"`` lets the
model pick its split the same way; ``"hybrid:2x2"`` fixes it. The choice uses
global sizes, the topology and the machine only, which every rank agrees on,
so every rank makes the same one.

Adding a strategy: a module with a :class:`~mpiattn.strategies.base.Strategy`
subclass and one entry in :data:`STRATEGIES`. The command line's choices,
its argument checks, ``plan``, the benchmark's estimates and the shared
contract suite (``tests/attention/test_contract.py``) all read this registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .allgather import Allgather
from .base import Strategy
from .double_ring import DoubleRing
from .hybrid import PLACEMENTS, Hybrid, divisors
from .materialized import Materialized
from .model import Prediction, RowPairs, choose, predict
from .ring import Ring
from .ulysses import Ulysses

__all__ = ["STRATEGIES", "NAMES", "Row", "get", "needs_choice", "pool", "resolve", "table", "variants"]

#: Every strategy, by name (the order breaks ties in ``auto``).
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Ring(), Allgather(), Ulysses(), Materialized(),
                                                       Hybrid(), DoubleRing())}

#: Accepted values of ``strategy=`` (``auto`` first); a strategy may take a
#: configuration after a colon (``hybrid:2x2``).
NAMES = ("auto", *STRATEGIES)


def get(name: str) -> Strategy:
    """The strategy object of ``name`` (``"ring"``, ``"hybrid:2x2"``, ...).

    Raises
    ------
    ValueError
        An unknown name, or a configuration the strategy does not take.
    """
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name (str), got {name!r}")
    base, colon, config = name.partition(":")
    strategy = STRATEGIES.get(base)
    if strategy is None or base == "auto" and colon:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(NAMES)} "
                         "(hybrid also as hybrid:UxR)")
    return strategy.configured(config) if colon else strategy


def needs_choice(name: str) -> bool:
    """Whether ``name`` leaves a choice to the cost model (``auto``, an unconfigured ``hybrid``)."""
    return name == "auto" or get(name).open_choice


def pool(spec: Any, topology: Any) -> list[Strategy]:
    """The configured strategies ``spec.options.strategy`` may run as on ``topology``.

    Raises
    ------
    ValueError
        The requested strategy does not support the call.
    """
    requested = spec.options.strategy
    if requested == "auto":
        return [c for s in STRATEGIES.values() if s.auto and s.supports(spec, topology) is None
                for c in s.candidates(spec, topology)]
    strategy = get(requested)
    why = strategy.supports(spec, topology)
    if why is not None:
        raise ValueError(why)
    return strategy.candidates(spec, topology)


def resolve(spec: Any, topology: Any, block: int, machine: Any,
            rate_dtype: str | None = None, pairs: Any = None) -> tuple[Strategy, str]:
    """The configured strategy for the call and why (see the module docstring).

    ``machine`` (a :class:`~mpiattn.strategies.machines.Machine`) is needed
    only when there is a choice to make (None otherwise). ``pairs``: the visible keys
    of every query row when the call counted them (an ``attn_mask`` or ``mask_mod``,
    :mod:`mpiattn.masks.counts`); default the rules' (:meth:`~mpiattn.strategies.model.RowPairs.of`).
    """
    candidates = pool(spec, topology)
    if not needs_choice(spec.options.strategy):
        return candidates[0], "requested"
    best, pred = choose(candidates, spec, topology, block, machine, rate_dtype, pairs)
    fits = "" if machine.fits(pred.memory) else "; no candidate fits the machine's memory"
    return best, (f"{spec.options.strategy}: the fastest the model predicts on {machine.name}, "
                  f"{topology.describe()} ({pred.fwdbwd_s:.3g} s forward+backward, parallel "
                  f"efficiency {pred.efficiency:.2f}{fits})")


@dataclass(frozen=True)
class Row:
    """One line of a plan: a configured strategy, its prediction (None: unsupported, ``why``),
    whether ``auto`` chose it and whether its memory fits the machine."""

    label: str
    prediction: Prediction | None
    why: str = ""
    auto: bool = False
    fits: bool = True
    pickable: bool = True


def table(spec: Any, topology: Any, block: int, machine: Any,
          rate_dtype: str | None = None) -> list[Row]:
    """Every strategy and split for ``spec`` on ``topology``: the model's predictions, ``auto``'s
    choice marked (``python -m mpiattn plan`` prints it)."""
    from dataclasses import replace

    auto_spec = replace(spec, options=replace(spec.options, strategy="auto"))
    pairs = RowPairs.of_spec(spec)
    chosen, _ = resolve(auto_spec, topology, block, machine, rate_dtype, pairs)
    rows = []
    for name, strategy in STRATEGIES.items():
        why = strategy.supports(spec, topology)
        if why is not None:
            rows.append(Row(name, None, why, pickable=strategy.auto))
            continue
        for c in strategy.candidates(spec, topology):
            pred = predict(c, spec, topology, block, machine, pairs, rate_dtype)
            rows.append(Row(c.label, pred, auto=c == chosen, fits=machine.fits(pred.memory),
                            pickable=strategy.auto))
    return rows


def variants(P: int) -> list[str]:
    """Every configured strategy name for ``P`` ranks (for tests and ``plan``): the plain
    names, and every ``hybrid:UxR`` split in each placement."""
    out = [name for name in STRATEGIES if name != "hybrid"]
    for u in divisors(P):
        out += [f"hybrid:{u}x{P // u}" + ("" if p == PLACEMENTS[0] else f":{p}") for p in PLACEMENTS]
    return out
