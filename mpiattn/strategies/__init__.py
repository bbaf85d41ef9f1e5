"""Distributed attention: the public API, a call's spec, and the strategies in one registry.

Modules, bottom to top: ``spec`` (:class:`Options`, :class:`AttentionSpec`),
``base`` (what a strategy is), ``blocked`` (the loops feeding an engine),
the strategies ``ring``, ``allgather``, ``ulysses``, ``materialized``,
``registry`` (every strategy, and ``auto``), ``problem`` (a validated,
planned call), ``plan`` (:func:`plan_attention`: a call planned once, run
cheaply), ``api`` (:func:`attention`, :func:`attention_backward`).
"""

from __future__ import annotations

from .api import attention, attention_backward
from .plan import AttentionPlan, plan_attention
from .registry import NAMES, STRATEGIES
from .spec import AttentionSpec, Options

__all__ = ["attention", "attention_backward", "plan_attention", "AttentionPlan", "AttentionSpec",
           "Options", "NAMES", "STRATEGIES"]
