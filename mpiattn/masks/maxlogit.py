"""``max_logit``: the largest visible raw score of each query head, measured by a forward pass.

A report, not a change to the scores: with ``max_logit=True`` a forward pass keeps, for every
query head, the largest raw score ``x = s q . k`` (before any transform) of a pair no rule
hides, over the batch, its rows and every key, and the call returns it in
``details["max_logit"]`` (float64 ``(H,)``, the same on every rank). Stabilisers of training
such as QK-clip read it (Kimi K2). A :class:`HeadMax` is made for one forward call
(:meth:`HeadMax.of`), filled by whatever computes that call's scores (the engines' blocks,
the materialized products) with the maxima of their query heads, then combined over the
ranks and reported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["HeadMax"]


class HeadMax:
    """The running maximum of the visible raw scores per query head (the module docstring).

    Parameters
    ----------
    H : int
        The call's query heads.
    """

    __slots__ = ("top",)

    def __init__(self, H: int):
        self.top = np.full(int(H), -np.inf)

    @classmethod
    def of(cls, spec: Any) -> "HeadMax | None":
        """One for the call ``spec`` (an :class:`~mpiattn.strategies.AttentionSpec`) when it asks
        for ``max_logit``, else None."""
        return cls(spec.H) if spec.mask.max_logit else None

    def add(self, heads: Any, values: Any) -> None:
        """Take the maxima ``values`` of the query heads ``heads`` (global indices, host arrays
        of one shape)."""
        np.maximum.at(self.top, np.asarray(heads, dtype=np.int64), np.asarray(values, dtype=np.float64))

    def combined(self, c: Any) -> np.ndarray:
        """The maxima over every rank of the communicator ``c`` (collective), float64 ``(H,)``."""
        return np.max(np.stack(c.allgather_obj(self.top)), axis=0)

    def report(self, c: Any, details: dict | None) -> None:
        """Combine over the ranks (collective: every rank calls it) and put the result in
        ``details["max_logit"]``."""
        top = self.combined(c)
        if details is not None:
            details["max_logit"] = top
