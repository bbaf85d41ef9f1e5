"""A per-head temperature: the score transform ``y = x / tau[h]``.

Each query head ``h`` divides its raw scores ``x = s q . k`` by its own
temperature ``tau[h] > 0`` (a sharper softmax below 1, a flatter one above),
the same on every rank. Its derivative is ``dy/dx = 1 / tau[h]``; no gradient
flows to ``tau`` (as for ALiBi's slopes; ``mpiattn.torch``'s ``score_mod`` trains
one). It is given as ``mpiattn.Score(temperature=tau)`` and takes the place of
the call's one transform (not with ``softcap`` or ``score_mod``).

It is the worked example of adding a score-forming modifier: this module (the
check and the transform protocol of :mod:`mpiattn.masks.scoremod`) and its
field in :class:`mpiattn.masks.score.Score`; the kernels, strategies and
interfaces read it through those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend

__all__ = ["Temperature", "check_temperature"]


def check_temperature(tau: Any, H: int) -> np.ndarray:
    """``tau`` as a host float64 ``(H,)`` array of finite numbers > 0 (else TypeError/ValueError)."""
    a = backend.to_host(tau)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"temperature must hold real numbers, got dtype {a.dtype}")
    a = np.asarray(a, dtype=np.float64)
    if a.shape != (H,):
        raise ValueError(f"temperature must have shape (H,) = ({H},), got {a.shape}")
    if not (np.all(np.isfinite(a)) and np.all(a > 0)):
        raise ValueError("temperature must hold finite numbers > 0")
    return a


@dataclass(frozen=True, eq=False)
class Temperature:
    """The transform ``y = x / tau[h]`` on a tile (``at``: its :class:`~mpiattn.masks.scoremod.TileIndex`).

    Attributes
    ----------
    tau : (H,) float64 host array
        Checked by :func:`check_temperature`.
    """

    tau: np.ndarray

    def _inverse(self, S: Any, at: Any) -> Any:
        """``1 / tau[h]`` broadcasting against the tile ``S``, in its dtype and on its device."""
        h = at.arrays()[1]
        xp = backend.array_module(S)
        return backend.to_device((1.0 / self.tau).astype(S.dtype), xp)[h]

    def forward_(self, S: Any, at: Any) -> Any:
        """``S <- S / tau[h]`` in place; returns ``S``."""
        S *= self._inverse(S, at)
        return S

    def saving_(self, S: Any, out: Any, at: Any) -> Any:
        """``out <- S / tau[h]`` (nothing to keep: the derivative does not depend on ``S``)."""
        xp = backend.array_module(S)
        return xp.multiply(S, self._inverse(S, at), out=out)

    def chain_(self, dS: Any, saved: Any, at: Any) -> Any:
        """``dS <- dS / tau[h]`` in place; returns ``dS``."""
        dS *= self._inverse(dS, at)
        return dS
