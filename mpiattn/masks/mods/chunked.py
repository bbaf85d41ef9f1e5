"""Chunked local attention (Llama 4's ``attention_chunk_size``): a query sees the keys of its own chunk.

The sequence is cut into chunks of ``size`` rows; query ``i`` sees key ``j`` when

    i // size == j // size

(global indices, as every ``mask_mod``). With ``causal=True`` that is Llama 4's
chunked attention layers: causal inside each chunk, nothing across. Key blocks and
tiles that lie in other chunks than their queries are skipped whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..maskmod import MaskMod, check_count

__all__ = ["Chunked"]


@dataclass(frozen=True)
class Chunked(MaskMod):
    """Query ``i`` sees key ``j`` when both lie in the same chunk of ``size`` rows.

    Attributes
    ----------
    size : int
        Rows per chunk, >= 1.
    """

    name = "chunked"
    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_count("chunked", "size", self.size, 1))

    @classmethod
    def example(cls, n: int) -> "Chunked":
        return cls(max(1, n // 3))

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx // self.size == kv_idx // self.size

    def hull(self, q0: int, q1: int, k0: int, k1: int) -> str:
        c = self.size
        if q1 // c < k0 // c or k1 // c < q0 // c:
            return "none"
        if q0 // c == q1 // c == k0 // c == k1 // c:
            return "all"
        return "some"
