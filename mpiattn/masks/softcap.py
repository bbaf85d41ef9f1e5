"""The logit softcap, ``y = c tanh(x / c)``: the one place its formula is written for the kernels.

With ``x = s q . k`` a pair's raw score and ``c > 0`` the cap (Gemma 2's
``attn_logit_softcapping``; FlashAttention's ``softcap``)::

    y     = c tanh(x / c)            |y| < c, y ~ x for |x| << c
    dy/dx = 1 - tanh(x / c)^2 = 1 - t^2,  t = tanh(x / c)

A score transform is an elementwise ``y = f(x)`` applied before the bias
(ALiBi, a float ``attn_mask``) and the rules' ``-inf``; it is the only part
of a score whose backward needs more than ``P``: the chain rule's factor
``f'(x)`` multiplies ``dS``. The kernels (native, CuPy, materialized) ask
:attr:`mpiattn.masks.Modifiers.transform` for the object below and call
its three methods; none of them writes ``tanh`` itself. It is one instance
of the transforms of :mod:`mpiattn.masks.scoremod` (a user's ``score_mod``
is another): its methods take the tile's indices ``at`` and read none. The references of
:mod:`mpiattn.kernels.reference` keep a formula of their own on purpose (a
reference shares no code with what it checks).

Everything here is generic array code (NumPy or CuPy, in place where the
name ends in ``_``); ``S`` is any floating array of raw scores.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend

__all__ = ["Softcap", "check_softcap"]


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` as a float > 0, or None (no cap). Raises TypeError / ValueError otherwise."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number > 0 or None, got {softcap!r}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    return c


@dataclass(frozen=True)
class Softcap:
    """The score transform ``y = c tanh(x / c)`` (module docstring).

    Attributes
    ----------
    c : float
        The cap, > 0 (checked by :func:`check_softcap`).
    """

    c: float

    def forward_(self, S: Any, at: Any = None) -> Any:
        """``S <- y(S)`` in place (a forward that keeps nothing for a backward); returns ``S``."""
        xp = backend.array_module(S)
        S *= S.dtype.type(1.0 / self.c)
        xp.tanh(S, out=S)
        S *= S.dtype.type(self.c)
        return S

    def saving_(self, S: Any, out: Any, at: Any = None) -> Any:
        """``out <- y(S)``, and ``S`` left holding what :meth:`chain_` needs (``t = tanh(x / c)``).

        ``out`` has ``S``'s shape (any floating dtype); returns ``out``.
        """
        xp = backend.array_module(S)
        S *= S.dtype.type(1.0 / self.c)
        xp.tanh(S, out=S)
        return xp.multiply(S, S.dtype.type(self.c), out=out)

    def chain_(self, dS: Any, saved: Any, at: Any = None) -> Any:
        """``dS <- dS * dy/dx`` in place, from what :meth:`saving_` left (``saved`` is overwritten:
        ``1 - t^2``); returns ``dS``."""
        xp = backend.array_module(saved)
        saved *= saved
        xp.subtract(saved.dtype.type(1), saved, out=saved)
        dS *= saved
        return dS
