"""Distributed attention: public API, validation, cost model and the strategies.

Modules, bottom to top: ``cost`` (the ``auto`` rule), ``problem`` (a
validated call), ``blocked`` (ring and all-gather), ``ulysses``,
``materialized`` (the thesis' products), ``api`` (:func:`attention`,
:func:`attention_backward`).
"""

from __future__ import annotations

from .api import attention, attention_backward
from .cost import choose_strategy
from .problem import DEFAULT_BLOCK, STRATEGIES

__all__ = ["attention", "attention_backward", "choose_strategy", "STRATEGIES", "DEFAULT_BLOCK"]
