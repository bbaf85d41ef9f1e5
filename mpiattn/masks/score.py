"""A call's score as one object: every modifier of how a pair's score is formed, checked and agreed once.

:class:`Score` holds what a caller gave (the formulas: :mod:`mpiattn.masks.modifiers`):

=============  ==========================================================  ==================
field          what it does                                                kind
=============  ==========================================================  ==================
softcap        ``y = c tanh(x / c)``                                       transform
score_mod      ``y = score_mod(x, b, h, q_idx, kv_idx)``                   transform
temperature    ``y = x / tau[h]``                                          transform
alibi_slopes   ``y += -slope[b, h] |i + d - j|``                            additive term
attn_mask      float: ``y += mask``; bool: hides where False               term or rule
mask_mod       hides where ``mask_mod(b, h, q_idx, kv_idx)`` is False      rule
sinks          one more logit per head in each row's softmax               softmax
max_logit      report the largest ``s q . k`` of a visible pair per head   measurement
=============  ==========================================================  ==================

Every entry point builds one with :meth:`Score.of` (from its keywords, or a ``score=`` the
caller made), and :meth:`Score.checked` turns it into :class:`Checked`: one rank's host
forms, the fields every rank must agree on (:meth:`Checked.agreement`, one rule for every
caller), the flags of the call's :class:`~mpiattn.masks.MaskSpec` (:meth:`Checked.flags`)
and the :class:`~mpiattn.masks.Modifiers` the kernels read (:meth:`Checked.modifiers`).
Once the ranks agree on the sequence lengths, :func:`agree_answers` compares the functions'
answers on a fixed sample (collective, on the Comm it is given).

An ``attn_mask``'s rows are either this rank's query rows (``rows="sharded"``, a sharded
call: the ranks agree on its kind and broadcast shape) or every rank's same queries
(``rows="replicated"``, decode: the ranks agree on a CRC-32 of its values).

A call has at most one transform. Adding a score-forming modifier: a module with its check
and formula (a transform: :mod:`mpiattn.masks.temperature` is the worked example) and a
field here (its check, agreement, flag and the :class:`~mpiattn.masks.Modifiers` it makes);
the kernels, strategies and interfaces read it through these.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from . import fingerprint
from .maskmod import MaskMod
from .modifiers import Modifiers, check_attn_mask, check_mask_mod, check_slopes, mask_kind
from .scoremod import check_score_mod, shift_score_mod
from .sinks import check_sinks
from .softcap import check_softcap
from .temperature import Temperature, check_temperature

__all__ = ["Score", "Checked", "agree_answers", "NAMES", "ROWS", "ARRAYS"]

#: How an ``attn_mask``'s query rows are held: this rank's, or every rank's same ones.
ROWS = ("sharded", "replicated")
#: The fields that hold arrays (the others hold numbers, flags or functions).
ARRAYS = ("temperature", "alibi_slopes", "attn_mask", "sinks")


@dataclass(frozen=True)
class Score:
    """The score modifiers of one call, as given (see the module docstring).

    Parameters
    ----------
    softcap : float, optional
        ``c`` of ``c tanh(x / c)`` (not with ``score_mod``).
    score_mod : ScoreMod or callable, optional
        A user's transform (:class:`mpiattn.ScoreMod`; in ``mpiattn.torch`` a function of
        torch ops).
    temperature : array, shape (H,), optional
        Per-head temperatures ``tau > 0``: ``y = x / tau[h]`` (:mod:`mpiattn.masks.temperature`).
    alibi_slopes : array, shape (H,) or (B, H), optional
    attn_mask : array, shape (B or 1, H or 1, rows, M), optional
        Bool (True = the pair takes part) or float (added; ``-inf`` hides).
    mask_mod : callable or MaskMod, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
    sinks : array, shape (H,), optional
    max_logit : bool
        Report the largest logit of a visible pair per head.

    Examples
    --------
    >>> import numpy as np
    >>> from mpiattn.masks.score import Score
    >>> s = Score.of(softcap=30.0, alibi_slopes=np.array([0.5, 0.25]))
    >>> s.given()
    ('softcap', 'alibi_slopes')
    """

    softcap: float | None = None
    score_mod: Any = None
    temperature: Any = None
    alibi_slopes: Any = None
    attn_mask: Any = None
    mask_mod: Any = None
    sinks: Any = None
    max_logit: bool = False

    @classmethod
    def of(cls, score: "Score | None" = None, **given: Any) -> "Score":
        """A Score from keywords (None or False: not given), added to ``score`` when one is passed
        (a modifier given both ways is a ValueError; an unknown keyword a TypeError)."""
        unknown = sorted(set(given) - set(NAMES))
        if unknown:
            raise TypeError(f"unknown score modifier {unknown[0]!r}; expected one of {', '.join(NAMES)}")
        given = {k: v for k, v in given.items() if not _absent(v)}
        if score is None:
            return cls(**given)
        if not isinstance(score, Score):
            raise TypeError(f"score must be a mpiattn.Score, got {type(score).__name__}")
        both = [k for k in given if not _absent(getattr(score, k))]
        if both:
            raise ValueError(f"{both[0]} is given twice: in score= and as a keyword")
        return replace(score, **given)

    def map_arrays(self, fn: Any) -> "Score":
        """The same Score with each given array ``x`` (:data:`ARRAYS`) replaced by ``fn(name, x)``
        (e.g. a tensor checked and made an array by an interface)."""
        return replace(self, **{n: fn(n, getattr(self, n)) for n in ARRAYS if getattr(self, n) is not None})

    def shifted(self, offset: int) -> "Score":
        """The same Score with the functions (``mask_mod``, ``score_mod``) given query positions
        ``q_idx + offset``: a call whose query rows stand ``offset`` places into its keys' axis
        (a prefill chunk after ``offset`` cached rows) shows them their absolute positions."""
        return _shifted(self, offset)

    def given(self) -> tuple[str, ...]:
        """The names of the modifiers given, in :data:`NAMES` order."""
        return tuple(n for n in NAMES if not _absent(getattr(self, n)))

    def keywords(self) -> dict:
        """The modifiers given, by name: the keywords of a call that takes them one by one (the
        dense reference)."""
        return {n: getattr(self, n) for n in self.given()}

    def flags(self) -> dict:
        """The flags of the call's :class:`~mpiattn.masks.MaskSpec`, from the modifiers as given (a
        description before any check: :meth:`Checked.flags` gives the same from checked ones)."""
        mask = self.attn_mask
        kind = None if mask is None else "bool" if str(mask.dtype).endswith("bool") else "float"
        return _flags(self.alibi_slopes is not None, kind,
                      self.mask_mod is not None, self.sinks is not None,
                      self.score_mod is not None or self.temperature is not None, self.softcap,
                      bool(self.max_logit))

    def checked(self, B: int, H: int, rows: int, layout: str = "sharded") -> "Checked":
        """This rank's checks (local; raises ValueError/TypeError): :class:`Checked`.

        ``B``, ``H``: the batch and query heads; ``rows``: this rank's query rows (an
        ``attn_mask``'s third axis); ``layout``: :data:`ROWS`, how those rows are held.
        """
        if layout not in ROWS:
            raise ValueError(f"layout must be one of {ROWS}, got {layout!r}")
        softcap = check_softcap(self.softcap)
        transforms = [n for n in ("softcap", "score_mod", "temperature") if getattr(self, n) is not None]
        if len(transforms) > 1:
            raise ValueError(f"{' and '.join(transforms)} are {'both' if len(transforms) == 2 else 'all'} "
                             "score transforms: give one (a "
                             "score_mod may cap its own result: c * tanh(f(x) / c))")
        if not isinstance(self.max_logit, (bool, np.bool_)):
            raise TypeError(f"max_logit must be True or False, got {self.max_logit!r}")
        return Checked(
            softcap=softcap,
            score_mod=None if self.score_mod is None else check_score_mod(self.score_mod, H),
            temperature=None if self.temperature is None else check_temperature(self.temperature, H),
            alibi=None if self.alibi_slopes is None else check_slopes(self.alibi_slopes, B, H),
            attn_mask=None if self.attn_mask is None else check_attn_mask(self.attn_mask, B, H, rows),
            mask_mod=None if self.mask_mod is None else check_mask_mod(self.mask_mod, B, H),
            sinks=None if self.sinks is None else check_sinks(self.sinks, H),
            max_logit=bool(self.max_logit), B=B, H=H, layout=layout)


#: The modifiers, in the order of :class:`Score`'s fields.
NAMES = tuple(f.name for f in fields(Score))


@dataclass(frozen=True)
class _ShiftedMask:
    """``mask_mod`` given query positions ``q_idx + offset`` (:meth:`Score.shifted`)."""

    fn: Any
    offset: int

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.fn(b, h, q_idx + self.offset, kv_idx)


def _shifted(score: Any, offset: int) -> Any:
    """``score`` (a :class:`Score` or :class:`Checked`) with its ``mask_mod`` and ``score_mod``
    given query positions ``q_idx + offset``."""
    if offset == 0 or (score.mask_mod is None and score.score_mod is None):
        return score
    return replace(score, mask_mod=None if score.mask_mod is None else _ShiftedMask(score.mask_mod, offset),
                   score_mod=None if score.score_mod is None else shift_score_mod(score.score_mod, offset))


def _flags(alibi: bool, attn_mask: str | None, mask_mod: bool, sinks: bool, transform: bool,
           softcap: float | None, max_logit: bool) -> dict:
    """The keywords of :meth:`mpiattn.strategies.spec.AttentionSpec.from_shapes` a score sets."""
    return {"alibi": alibi, "attn_mask": attn_mask, "mask_mod": mask_mod, "sinks": sinks,
            "score_mod": transform, "softcap": softcap, "max_logit": max_logit}


def _absent(value: Any) -> bool:
    return value is None or value is False


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


@dataclass(frozen=True)
class Checked:
    """One rank's score modifiers, checked (:meth:`Score.checked`): host arrays.

    Attributes
    ----------
    softcap : float or None
    score_mod : transform or None
    temperature : (H,) float64 array or None
    alibi : (1 or B, H) float64 array or None
    attn_mask : (1 or B, 1 or H, rows, M) bool or float64 array or None
    mask_mod : callable or None
    sinks : (H,) float64 array or None
    max_logit : bool
    B, H : int
    layout : str
        :data:`ROWS`.
    """

    softcap: float | None
    score_mod: Any
    temperature: np.ndarray | None
    alibi: np.ndarray | None
    attn_mask: np.ndarray | None
    mask_mod: Any
    sinks: np.ndarray | None
    max_logit: bool
    B: int
    H: int
    layout: str

    def agreement(self) -> dict:
        """What every rank must hold alike, by modifier name (values of the small arrays, the
        functions' identities, the mask's kind and shape, or its CRC-32 where it is replicated)."""
        m = self.attn_mask
        if m is None:
            mask = None
        elif self.layout == "sharded":
            mask = (mask_kind(m), m.shape[0], m.shape[1])
        else:
            mask = (mask_kind(m), tuple(m.shape), _crc(m))
        return {"softcap": self.softcap, "max_logit": self.max_logit,
                "score_mod (its code and captured values)":
                    None if self.score_mod is None else fingerprint.identity(self.score_mod),
                "temperature": None if self.temperature is None else tuple(map(float, self.temperature)),
                "alibi_slopes": None if self.alibi is None else tuple(map(float, self.alibi.ravel())),
                "attn_mask (kind, shape)" if self.layout == "sharded" else "attn_mask (kind, shape, CRC-32)": mask,
                "mask_mod (a named rule's text; a function's module, name, and a CRC-32 of its code "
                "and captured values)": None if self.mask_mod is None else fingerprint.identity(self.mask_mod),
                "sinks": None if self.sinks is None else tuple(map(float, self.sinks))}

    @property
    def mask_keys(self) -> int | None:
        """The ``attn_mask``'s key axis (checked against the agreed ``M`` by the caller), or None."""
        return None if self.attn_mask is None else int(self.attn_mask.shape[3])

    @property
    def hides(self) -> bool:
        """This rank's modifiers may hide a pair (a ``mask_mod``, a bool ``attn_mask`` or a float one
        holding ``-inf``): a rank-local answer, to be agreed before it decides a collective."""
        return self.mask_mod is not None or (self.attn_mask is not None and Modifiers(
            attn_mask=self.attn_mask).hides)

    def flags(self) -> dict:
        """The modifiers' flags of the call's :class:`~mpiattn.masks.MaskSpec` (keywords of
        :meth:`mpiattn.strategies.spec.AttentionSpec.from_shapes`; ``softcap`` its value)."""
        return _flags(self.alibi is not None, mask_kind(self.attn_mask), self.mask_mod is not None,
                      self.sinks is not None, self.score_mod is not None or self.temperature is not None,
                      self.softcap, self.max_logit)

    def shifted(self, offset: int) -> "Checked":
        """The same modifiers with the functions given query positions ``q_idx + offset``
        (:meth:`Score.shifted`, on what was checked)."""
        return _shifted(self, offset)

    def with_mask(self, attn_mask: np.ndarray | None) -> "Checked":
        """The same modifiers with another checked ``attn_mask`` (a decode step's own)."""
        return replace(self, attn_mask=attn_mask)

    def modifiers(self, B: int | None = None, H: int | None = None) -> Modifiers | None:
        """What the kernels read (:class:`~mpiattn.masks.Modifiers`), or None when the call has no
        modifier an engine applies (the sinks join the merged rows instead)."""
        if (self.softcap is None and self.score_mod is None and self.temperature is None
                and self.alibi is None and self.attn_mask is None and self.mask_mod is None
                and not self.max_logit):
            return None
        transform = self.score_mod if self.temperature is None else Temperature(self.temperature)
        return Modifiers(self.softcap, self.alibi, self.attn_mask, self.mask_mod, transform,
                         self.B if B is None else B, self.H if H is None else H)


def agree_answers(c: Any, checked: Checked, N: int, M: int, diagonal: int, call: str) -> None:
    """Compare the functions' answers on a fixed sample of pairs on every rank (collective on the
    Comm ``c``, every rank or none: the functions' presence is agreed first): a plain
    ``mask_mod``'s exactly (CRC-32), a ``score_mod``'s to a relative 1e-6. Raises the same
    ValueError on every rank when they differ."""
    fn = checked.mask_mod
    if fn is not None and not isinstance(fn, MaskMod):  # a named rule is its text
        c.agree(lambda: {"mask_mod's answers on a fixed sample of pairs (CRC-32)":
                         fingerprint.answers(fn, checked.B, checked.H, N, M, diagonal)},
                call=f"{call}'s mask_mod")
    if checked.score_mod is not None:
        said = c.allgather_checked(lambda: fingerprint.score_answers(
            checked.score_mod, checked.B, checked.H, N, M, diagonal), call=f"{call}'s score_mod")
        bad = [r for r, a in enumerate(said) if not fingerprint.same_answers(a, said[0])]
        if bad:
            raise ValueError(f"ranks disagree on score_mod's answers on a fixed sample of scores "
                             f"and pairs (to a relative 1e-6): rank {bad[0]}'s differ from rank "
                             "0's (one function on every rank, reading the same values?)")
