"""The strategies, in one registry, and the rule behind ``strategy="auto"``.

``auto`` takes the cheapest strategy that supports the call, by
:class:`~mpiattn.strategies.base.Cost`: the fewest words a rank sends; among
equal words, the fewest sequential communication steps; among equal costs,
the first in :data:`STRATEGIES` (the ring). Strategies that declare
``auto = False`` (materialized) are never picked. The cost uses global
sizes only, so every rank makes the same choice.

Adding a strategy: a module with a :class:`~mpiattn.strategies.base.Strategy`
subclass and one entry in :data:`STRATEGIES`. The command line's choices,
its argument checks, the benchmark's estimates and the shared contract suite
(``tests/attention/test_contract.py``) all read this registry.
"""

from __future__ import annotations

from typing import Any

from .allgather import Allgather
from .base import Strategy
from .materialized import Materialized
from .ring import Ring
from .ulysses import Ulysses

__all__ = ["STRATEGIES", "NAMES", "get", "resolve"]

#: Every strategy, by name (the order breaks ties in ``auto``).
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Ring(), Allgather(), Ulysses(), Materialized())}

#: Accepted values of ``strategy=`` (``auto`` first).
NAMES = ("auto", *STRATEGIES)


def get(name: str) -> Strategy:
    """The strategy object of ``name``."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(NAMES)}") from None


def resolve(spec: Any, P: int, block: int) -> tuple[Strategy, str]:
    """The strategy for the call ``spec`` on ``P`` ranks with ``block``-row blocks, and why.

    Raises
    ------
    ValueError
        The requested strategy does not support the call (the same on every
        rank: it depends on global sizes only).
    """
    requested = spec.options.strategy
    if requested != "auto":
        strategy = get(requested)
        why = strategy.supports(spec, P)
        if why is not None:
            raise ValueError(why)
        return strategy, "requested"
    ranked = sorted((s.cost(spec, P, block), i, s) for i, s in enumerate(STRATEGIES.values())
                    if s.auto and s.supports(spec, P) is None)
    cost, _, best = ranked[0]
    return best, (f"auto: the cheapest supported ({cost.words:.3g} words sent per rank in "
                  f"{cost.steps} step(s))")
