"""What a call hides, and which score modifiers it uses: checked once, as one frozen object.

Every rule is written in *global* positions (``i`` a query row, ``j`` a key
row), so it holds whatever the layout, and all rules combine by AND::

    causal:     j <= i + d                      (d = 0 top-left, torch's is_causal;
                                                 d = M - N bottom-right, FlashAttention >= 2.1)
    window:     i + d - left <= j <= i + d + right   (aligned like causal; None: unbounded side)
    documents:  seg_q[b, i] == seg_k[b, j]      (per batch entry b)
    padding:    not pad[b, j]                   (per batch entry b)

:class:`MaskSpec` says which rules and which score modifiers
(:mod:`mpiattn.masks.modifiers`, :mod:`mpiattn.masks.sinks`) a call uses (the arrays,
document ids, padding, slopes, masks and sinks, travel beside it); :mod:`mpiattn.masks.tiles` decides them per
tile, :mod:`mpiattn.masks.dense` materialises them for references, and
:mod:`mpiattn.masks.ids` gathers the document ids every rank needs.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .modifiers import MODIFIERS
from .softcap import check_softcap

__all__ = ["RULES", "ALIGNMENTS", "MaskSpec", "check_window", "check_causal", "diagonal",
           "softmax_scale"]

#: The mask rules, in the order :attr:`MaskSpec.rules` lists the active ones.
RULES = ("causal", "window", "segments", "padding")

#: How a causal mask is aligned when ``N != M``: ``top-left`` (query ``i`` sees keys
#: ``j <= i``, torch's ``is_causal``) or ``bottom-right`` (``j <= i + M - N``: the last query
#: sees every key, as FlashAttention >= 2.1, torch's ``causal_lower_right`` and every decode step).
ALIGNMENTS = ("top-left", "bottom-right")


def check_causal(causal: Any) -> bool | str:
    """``causal`` as False, True (top-left) or ``"bottom-right"``.

    Accepts a bool, ``"top-left"`` (the same as True) or ``"bottom-right"``;
    raises TypeError for anything else.
    """
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    if isinstance(causal, str) and causal in ALIGNMENTS:
        return True if causal == "top-left" else causal
    raise TypeError(f"causal must be True, False, 'top-left' or 'bottom-right', got {causal!r}")


def softmax_scale(scale: float | None, E: int) -> float:
    """The scale of the scores ``s q_i . k_j``: ``scale`` when given, else ``1/sqrt(E)``."""
    return 1.0 / math.sqrt(E) if scale is None else float(scale)


def diagonal(causal: Any, n: int, m: int) -> int:
    """The offset ``d`` of the rules' diagonal for ``n`` queries and ``m`` keys: ``m - n`` when
    ``causal`` is ``"bottom-right"``, else 0 (query ``i`` is aligned with key ``i + d``)."""
    return int(m) - int(n) if check_causal(causal) == "bottom-right" else 0


def check_window(window: Any) -> tuple | None:
    """``window`` as ``(left, right)`` (each an int >= 0 or None), or None for no window.

    ``(None, None)`` is no window. Raises TypeError for anything but a pair
    of ints/None, ValueError for a negative bound or one past int64.
    """
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, (bool, np.bool_)):
            raise TypeError(f"window {side} bound must be an int >= 0 or None, got {w!r}")
        try:
            w = operator.index(w)
        except TypeError:
            raise TypeError(f"window {side} bound must be an int >= 0 or None, got {w!r}") from None
        if w < 0:
            raise ValueError(f"window {side} bound must be >= 0, got {w}")
        if w > np.iinfo(np.int64).max:  # positions are int64: a larger bound is unbounded anyway
            raise ValueError(f"window {side} bound must be at most 2**63 - 1 (or None: unbounded), got {w}")
        out.append(int(w))
    return None if out == [None, None] else (out[0], out[1])


@dataclass(frozen=True)
class MaskSpec:
    """The mask rules of one call (which are on; the arrays travel beside it).

    Attributes
    ----------
    causal : bool
        Hide key ``j`` from query ``i`` when ``j > i + diagonal``.
    window : (left, right) or None
        As returned by :func:`check_window`; measured from ``i + diagonal``.
    segments : bool
        The queries carry document ids (``segment_ids``).
    kv_segments : bool
        The keys carry their own document ids (``kv_segment_ids``); without
        them they take the queries' ids.
    padding : bool
        A key padding mask is given.
    diagonal : int
        Query ``i`` is aligned with key ``i + diagonal`` (:func:`diagonal`:
        0 top-left, ``M - N`` bottom-right); the causal and window rules are
        measured from it.
    softcap : float or None
        The scores are capped, ``c tanh(x / c)`` (:mod:`mpiattn.masks.modifiers`).
    score_mod : bool
        A user's ``score_mod`` transforms the scores (:mod:`mpiattn.masks.scoremod`).
    alibi : bool
        ALiBi slopes are given.
    attn_mask : {None, "bool", "float"}
        An ``attn_mask`` of that kind is given.
    mask_mod : bool
        A ``mask_mod`` function is given.
    sinks : bool
        Sinks are given (:mod:`mpiattn.masks.sinks`).
    max_logit : bool
        The maximum score of every head is returned.
    """

    causal: bool = False
    window: tuple | None = None
    segments: bool = False
    kv_segments: bool = False
    padding: bool = False
    diagonal: int = 0
    softcap: float | None = None
    alibi: bool = False
    attn_mask: str | None = None
    mask_mod: bool = False
    sinks: bool = False
    max_logit: bool = False
    score_mod: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.causal, str):
            raise TypeError("MaskSpec.causal is a bool; give an alignment as diagonal= "
                            "(mpiattn.masks.diagonal(causal, N, M))")
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "diagonal", int(self.diagonal))
        object.__setattr__(self, "window", check_window(self.window))
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        if self.kv_segments and not self.segments:
            raise ValueError("kv_segment_ids needs segment_ids (the queries' document ids)")
        if self.attn_mask not in (None, "bool", "float"):
            raise ValueError(f"MaskSpec.attn_mask is None, 'bool' or 'float', got {self.attn_mask!r}")
        for name in ("alibi", "mask_mod", "sinks", "max_logit", "score_mod"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    @property
    def rules(self) -> tuple[str, ...]:
        """The active rules, a sub-tuple of :data:`RULES` (e.g. ``("causal", "padding")``)."""
        on = {"causal": self.causal, "window": self.window is not None,
              "segments": self.segments, "padding": self.padding}
        return tuple(r for r in RULES if on[r])

    @property
    def modifiers(self) -> tuple[str, ...]:
        """The active score modifiers, a sub-tuple of :data:`mpiattn.masks.modifiers.MODIFIERS`."""
        on = {"softcap": self.softcap is not None, "score_mod": self.score_mod, "alibi": self.alibi,
              "attn_mask": self.attn_mask is not None, "mask_mod": self.mask_mod,
              "sinks": self.sinks, "max_logit": self.max_logit}
        return tuple(m for m in MODIFIERS if on[m])

    @property
    def row_itemsize(self) -> int:
        """Bytes per (query, key) pair of the modifiers' per-row data as they hold it (what moves
        with a query row): an ``attn_mask``'s entry, 1 (bool), 8 (float64), 0
        without one."""
        return {None: 0, "bool": 1, "float": 8}[self.attn_mask]

    @property
    def positional(self) -> bool:
        """True when a rule decided by positions or ids is on (tiles and blocks may be skipped)."""
        return self.causal or self.window is not None or self.segments

    def band(self) -> tuple[float, float]:
        """The allowed range ``[lo, hi]`` of ``j - i`` under the causal and window rules."""
        left, right = self.window if self.window is not None else (None, None)
        lo = -np.inf if left is None else -float(left)
        hi = np.inf if right is None else float(right)
        d = float(self.diagonal)
        return lo + d, (min(hi, 0.0) if self.causal else hi) + d

    def key_ranges(self, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """For every query row ``i`` of ``n``: the keys ``jlo[i] .. jhi[i]`` of ``m`` that the
        causal and window rules allow (:meth:`band`; empty where ``jlo > jhi``), int64 ``(n,)``."""
        lo, hi = self.band()
        i = np.arange(n, dtype=np.int64)
        jlo = i + (-(n + m) if lo == -np.inf else int(lo))
        jhi = i + (n + m if hi == np.inf else int(hi))
        return np.maximum(jlo, 0), np.minimum(jhi, m - 1)

    def keys_per_row(self, n: int, m: int) -> np.ndarray:
        """How many of ``m`` keys every query row of ``n`` sees under the causal and window rules
        (:meth:`key_ranges`; documents and padding are not counted), int64 ``(n,)``."""
        jlo, jhi = self.key_ranges(n, m)
        return np.maximum(jhi - jlo + 1, 0)
