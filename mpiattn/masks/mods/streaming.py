"""StreamingLLM's attention (Xiao et al. 2023, "attention sinks"): the first keys and a window.

Query ``i`` sees key ``j`` when

    j < first  or  i - j <= left

that is, the ``first`` keys of the sequence (the tokens that soak up attention) and a
window of ``left`` keys before the query (``left`` as in the ``window`` rule's left
bound). Combine it with ``causal=True`` to hide the keys after the query. Key blocks
and tiles that lie between the first keys and the window are skipped whole. (The
learnable ``sinks=`` of :mod:`mpiattn.masks.sinks` are another thing: one more term
of the softmax, no key.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..maskmod import MaskMod, check_count

__all__ = ["Streaming"]


@dataclass(frozen=True)
class Streaming(MaskMod):
    """Query ``i`` sees keys ``j < first`` and keys with ``i - j <= left``.

    Attributes
    ----------
    first : int
        The keys every query sees, from the sequence's start, >= 0.
    left : int
        How far back the window reaches, >= 0 (0: the query's own key, and those after).
    """

    name = "streaming"
    first: int
    left: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "first", check_count("streaming", "first", self.first))
        object.__setattr__(self, "left", check_count("streaming", "left", self.left))

    @classmethod
    def example(cls, n: int) -> "Streaming":
        return cls(max(1, n // 10), max(1, n // 4))

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < self.first) | (q_idx - kv_idx <= self.left)

    def hull(self, q0: int, q1: int, k0: int, k1: int) -> str:
        if max(k0, self.first) > min(k1, q1 - self.left - 1):  # no key j >= first with q1 - j > left
            return "all"
        if k0 >= self.first and q0 - k1 > self.left:
            return "none"
        return "some"
