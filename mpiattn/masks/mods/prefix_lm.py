"""Prefix-LM attention (T5's and UniLM's prefix language model): a bidirectional prefix, causal after.

Query ``i`` sees key ``j`` when

    j < prefix  or  j <= i

so every query sees the whole prefix (the prefix's own queries included: they see it
in both directions) and the rows after it attend causally. Give it without
``causal=True`` (which would hide the prefix's later keys from its earlier queries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..maskmod import MaskMod, check_count

__all__ = ["PrefixLM"]


@dataclass(frozen=True)
class PrefixLM(MaskMod):
    """Keys ``j < prefix`` are seen by every query; later keys causally (``j <= i``).

    Attributes
    ----------
    prefix : int
        Rows of the bidirectional prefix, >= 0 (0: plain causal attention).
    """

    name = "prefix_lm"
    prefix: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", check_count("prefix_lm", "prefix", self.prefix))

    @classmethod
    def example(cls, n: int) -> "PrefixLM":
        return cls(n // 3)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < self.prefix) | (kv_idx <= q_idx)

    def hull(self, q0: int, q1: int, k0: int, k1: int) -> str:
        if k1 < self.prefix or k1 <= q0:
            return "all"
        if k0 >= self.prefix and k0 > q1:
            return "none"
        return "some"
