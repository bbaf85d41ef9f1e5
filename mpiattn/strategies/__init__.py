"""Distributed attention: the public API, a call's spec, and the strategies in one registry.

Modules, bottom to top: ``spec`` (:class:`Options`, :class:`AttentionSpec`),
``base`` (what a strategy is), ``blocked`` (the loops feeding an engine),
the strategies ``ring``, ``allgather``, ``ulysses``, ``materialized``,
``registry`` (every strategy, and ``auto``), ``problem`` (a validated,
planned call), ``api`` (:func:`attention`, :func:`attention_backward`).
"""

from __future__ import annotations

from .api import attention, attention_backward
from .registry import NAMES, STRATEGIES
from .spec import AttentionSpec, Options

__all__ = ["attention", "attention_backward", "AttentionSpec", "Options", "NAMES", "STRATEGIES"]
