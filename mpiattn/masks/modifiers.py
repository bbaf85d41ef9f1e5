"""Score modifiers: how the score of a visible pair is formed beyond ``s q_i . k_j``.

With ``x = s q_i . k_j`` (``s`` the scale), global positions ``i``, ``j``,
``d`` the call's diagonal (:func:`mpiattn.masks.diagonal`), batch entry
``b`` and global query head ``h``, a call's score is::

    y = c tanh(x / c)                  softcap c           (:mod:`mpiattn.masks.softcap`)
    y = score_mod(x, b, h, i, j)       a user's transform  (:mod:`mpiattn.masks.scoremod`)
    y += -slope[b, h] |i + d - j|      ALiBi               (no gradient to the slopes)
    y += mask[b, h, i, j]              a float attn_mask
    hidden where not mask[b, h, i, j]  a bool attn_mask    (True = the pair takes part)
    hidden where not mask_mod(b, h, i, j)

and a hidden pair takes no part (as the rules of :mod:`mpiattn.masks.spec`,
which combine with these by AND). Sinks enter the softmax itself
(:mod:`mpiattn.masks.sinks`). :class:`Modifiers` holds one rank's arrays of
a call; :class:`mpiattn.masks.BlockMask` asks it, tile by tile, which pairs
it hides and what it adds, so that every engine and strategy reads the same
rules. Everything here is host (NumPy) work on positions: a tile's answer
is uploaded once where the engine runs on a device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .. import backend
from .maskmod import MaskMod
from .softcap import Softcap

__all__ = ["MODIFIERS", "ENGINE_MODIFIERS", "Modifiers", "check_slopes", "check_attn_mask",
           "mask_kind", "check_mask_mod", "ask", "fold_tile"]

#: The score modifiers, in the order :attr:`mpiattn.masks.MaskSpec.modifiers` lists the active ones.
MODIFIERS = ("softcap", "score_mod", "alibi", "attn_mask", "mask_mod", "sinks", "max_logit")

#: The modifiers an engine applies (and declares, :class:`mpiattn.kernels.engine.Capabilities`);
#: the sinks are added to each row once its blocks are merged, whatever the engine.
ENGINE_MODIFIERS = tuple(m for m in MODIFIERS if m != "sinks")


def _host_floats(name: str, x: Any) -> np.ndarray:
    a = backend.to_host(x)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    a = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf")
    return a


def check_slopes(slopes: Any, B: int, H: int) -> np.ndarray:
    """ALiBi slopes ``(H,)`` or ``(B, H)`` as a host float64 ``(1 or B, H)`` array (checked)."""
    a = _host_floats("alibi_slopes", slopes)
    if a.shape == (H,):
        return a[None]
    if a.shape == (B, H):
        return a
    raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), got {a.shape}")


def check_attn_mask(mask: Any, B: int, H: int, n: int) -> np.ndarray:
    """This rank's rows of an ``attn_mask``, ``(1 or B, 1 or H, n, M)``, bool or float, as a host
    array (bool, or float64). The key axis ``M`` is checked once the ranks agree on ``M``."""
    a = backend.to_host(mask)
    if a.ndim != 4:
        raise ValueError("attn_mask must be 4-D (B or 1, H or 1, this rank's query rows, M), got "
                         f"shape {a.shape}")
    if a.shape[0] not in (1, B) or a.shape[1] not in (1, H) or a.shape[2] != n:
        raise ValueError(f"attn_mask must have shape (1 or {B}, 1 or {H}, {n}, M) here (this rank's "
                         f"{n} query rows), got {a.shape}")
    if a.dtype == np.bool_:
        return a
    if a.dtype.kind != "f":
        raise TypeError(f"attn_mask must be bool (True = the pair takes part) or floating point "
                        f"(added to the scores), got {a.dtype}")
    a = np.asarray(a, dtype=np.float64)
    if np.isnan(a).any() or np.isposinf(a).any():
        raise ValueError("a float attn_mask may hold -inf (hidden) but not NaN or +inf")
    return a


def mask_kind(mask: Any) -> str | None:
    """The kind of a checked ``attn_mask`` as :class:`mpiattn.masks.MaskSpec` names it: ``"bool"``,
    ``"float"``, or None without one."""
    if mask is None:
        return None
    return "bool" if mask.dtype == np.bool_ else "float"


def check_mask_mod(fn: Any, B: int = 1, H: int = 1) -> Callable:
    """``fn`` if it is a callable that answers a probe ``fn(b, h, q_idx, kv_idx)`` (every batch
    entry and head at the pair (0, 0): int64 arrays of shapes (B, 1, 1, 1), (1, H, 1, 1),
    (1, 1, 1, 1)) with a bool array that broadcasts to (B, H, 1, 1) without growing it; else
    TypeError (not callable, not bool) or ValueError (its shape)."""
    if not callable(fn):
        raise TypeError(f"mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx) -> bool array, got {fn!r}")
    ask(fn, np.arange(B), np.arange(H), [0], [0])
    return fn


def _indices(b: Any, h: Any, q: Any, k: Any) -> tuple:
    """``mask_mod``'s arguments: int64 arrays of shapes (B, 1, 1, 1), (1, H, 1, 1), (1, 1, q, 1)
    and (1, 1, 1, k) that broadcast against each other."""
    return tuple(np.asarray(x, dtype=np.int64).reshape([-1 if a == axis else 1 for a in range(4)])
                 for axis, x in enumerate((b, h, q, k)))


def ask(fn: Callable, b: Any, h: Any, q: Any, k: Any) -> np.ndarray:
    """``fn``'s bool answer on those indices as a ``(1 or len(b), 1 or len(h), len(q), len(k))``
    array: leading axes of length 1 added, the query and key axes always spelt out (a view
    where ``fn`` ignored them), so that a region of the answer is the answer of that region.

    A rule may ignore any index (FlexAttention's ``noop_mask`` returns a 0-d array, a key-only
    rule reads ``kv_idx`` alone); its answer must broadcast to the indices' shape without
    growing it, else ValueError naming ``mask_mod``.
    """
    full = tuple(np.size(x) for x in (b, h, q, k))
    got = np.asarray(fn(*_indices(b, h, q, k)))
    if got.dtype != np.bool_:
        raise TypeError(f"mask_mod returned dtype {got.dtype}, not bool")
    shape = (1,) * (4 - got.ndim) + got.shape
    if got.ndim > 4 or any(g not in (1, f) for g, f in zip(shape, full)):
        raise ValueError(f"mask_mod returned shape {got.shape} on indices b, h, q_idx, kv_idx that "
                         f"broadcast to {full}: its answer must broadcast to that shape (each axis "
                         "of length 1 or of the index's length)")
    return np.broadcast_to(got.reshape(shape), shape[:2] + full[2:])


def fold_tile(a: np.ndarray, hkv: int, group: int) -> np.ndarray:
    """``(Bx, Hx, r, k)`` per query head (``Hx`` 1 or ``hkv * group``) -> the engines' folded rows
    ``(Bx, 1 or hkv, r * group, k)`` (row ``i * group + g`` is query head ``kv * group + g``)."""
    Bx, Hx, r, k = a.shape
    if Hx == 1:
        return np.repeat(a, group, axis=2) if group > 1 else a
    return a.reshape(Bx, hkv, group, r, k).transpose(0, 1, 3, 2, 4).reshape(Bx, hkv, r * group, k)


@dataclass(frozen=True)
class Modifiers:
    """One rank's score modifiers of a call (see the module docstring).

    Attributes
    ----------
    softcap : float or None
    alibi : (1 or B, H) float64 host array or None
        The ALiBi slopes of every query head.
    attn_mask : (1 or B, 1 or H, n_r, M) host array or None
        This rank's query rows of the mask (bool: True = visible; float64: added); a
        head-sharded strategy's moved rows (:meth:`moved`).
    mask_mod : callable or None
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on broadcasting int64 arrays of
        global indices (True = visible); the same function on every rank (compared by
        :mod:`mpiattn.masks.fingerprint`).
    score_mod : score transform or None
        A user's ``score_mod`` (:class:`mpiattn.masks.scoremod.ScoreMod`, or mpiattn.torch's),
        the call's transform in place of a softcap (one or the other).
    B, H : int
        The batch size and the query heads (``mask_mod``'s ``b`` and ``h`` range over them).
    mask_head0 : int
        The global query head of ``attn_mask``'s first head (0 unless :meth:`moved`).
    """

    softcap: float | None = None
    alibi: np.ndarray | None = None
    attn_mask: np.ndarray | None = None
    mask_mod: Callable | None = None
    score_mod: Any = None
    B: int = 1
    H: int = 1
    mask_head0: int = 0

    @property
    def transform(self) -> Any:
        """The elementwise score transform ``y = f(x, b, h, i, j)`` the kernels apply before the
        bias (:mod:`mpiattn.masks.scoremod`: the ``score_mod``, or
        :class:`mpiattn.masks.softcap.Softcap`), or None."""
        if self.score_mod is not None:
            return self.score_mod
        return None if self.softcap is None else Softcap(self.softcap)

    @property
    def has_rows(self) -> bool:
        """Some modifier holds data per query row (today an ``attn_mask``): a strategy that moves
        the queries moves it with them (:meth:`with_rows`)."""
        return self.attn_mask is not None

    def with_rows(self, move: Callable[[np.ndarray], np.ndarray], head0: int) -> "Modifiers":
        """The same modifiers with each array held per query row, ``(1 or B, 1 or H, rows, M)``,
        replaced by ``move(array)``: the rows a strategy moved to this rank, ``(1 or B, 1 or h,
        rows', M)``, their heads from global head ``head0`` (ignored for one broadcast head).
        ``move`` sees the array's head axis as given (1: one head for all)."""
        if not self.has_rows:
            return self
        m = move(self.attn_mask)
        return replace(self, attn_mask=m, mask_head0=int(head0) if m.shape[1] > 1 else 0)

    def __post_init__(self) -> None:
        if self.softcap is not None and self.score_mod is not None:
            raise ValueError("softcap and score_mod are both score transforms: give one (a "
                             "score_mod may cap its own result: c * tanh(f(x) / c))")
        m = self.attn_mask
        object.__setattr__(self, "_mask_hides", m is not None and (
            m.dtype == np.bool_ or bool(np.isneginf(m).any())))
        object.__setattr__(self, "_mod_shape", (1, 1) if self.mask_mod is None else self._probe())

    def _probe(self) -> tuple[int, int]:
        """Whether ``mask_mod`` reads the batch and head indices: ``(1 or B, 1 or H)`` of its
        answer on every ``b`` and ``h`` at one pair (sizes a region's cost)."""
        got = ask(self.mask_mod, np.arange(max(self.B, 1)), np.arange(max(self.H, 1)), [0], [0])
        return int(got.shape[0]), int(got.shape[1])

    def cost(self, pairs: int, heads: int) -> int:
        """How many entries the hiding modifiers answer for ``pairs`` (query, key) pairs of
        ``heads`` query heads (the size of :meth:`visible`'s answer)."""
        mb, mh = self._mod_shape
        ab, ah = (1, 1) if self.attn_mask is None else self.attn_mask.shape[:2]
        return pairs * max(mb, ab) * (heads if max(mh, ah) > 1 else 1)

    @property
    def hides(self) -> bool:
        """Some pairs may be hidden: a bool ``attn_mask``, a float one holding ``-inf``, or a
        ``mask_mod``."""
        return self.mask_mod is not None or self._mask_hides

    @property
    def adds(self) -> bool:
        """Something is added to the scores: ALiBi or a float ``attn_mask``."""
        return self.alibi is not None or (self.attn_mask is not None
                                          and self.attn_mask.dtype != np.bool_)

    @property
    def rule(self) -> MaskMod | None:
        """The ``mask_mod`` when it is a named rule (:class:`~mpiattn.masks.maskmod.MaskMod`,
        which tells whole tiles from their hulls), else None."""
        return self.mask_mod if isinstance(self.mask_mod, MaskMod) else None

    def hull(self, q0: int, q1: int, k0: int, k1: int) -> str | None:
        """What the hiding modifiers decide for every pair of queries ``[q0, q1]`` and keys
        ``[k0, k1]`` (global, inclusive) without evaluating a pair: ``"none"`` (all hidden),
        ``"all"`` (none hidden), or None (evaluate). Only a :attr:`rule` can tell; an
        ``attn_mask`` that hides leaves "all" untold."""
        if self.rule is None:
            return None
        told = self.rule.hull(int(q0), int(q1), int(k0), int(k1))
        if told == "none" or (told == "all" and not self._mask_hides):
            return told
        return None

    def visible(self, heads: np.ndarray, rows: np.ndarray, q_pos: np.ndarray,
                k_pos: np.ndarray) -> np.ndarray | None:
        """Bool ``(Bx, Hx, r, k)`` (``Bx`` 1 or B, ``Hx`` 1 or ``len(heads)``): True where neither
        the ``attn_mask`` (False, or -inf) nor ``mask_mod`` hides the pair; None when nothing hides.

        ``heads``: the global query heads; ``rows``: the queries' rows of ``attn_mask``;
        ``q_pos``, ``k_pos``: global positions of the queries and keys.
        """
        ok = None
        if self._mask_hides:  # a float mask hides where it is -inf
            ok = self._mask_rows(heads, rows, k_pos)
            if ok.dtype != np.bool_:
                ok = ok > -np.inf
        if self.mask_mod is not None:
            got = ask(self.mask_mod, np.arange(max(self.B, 1)), heads, q_pos, k_pos)
            ok = got if ok is None else ok & got
        return ok

    def added(self, heads: np.ndarray, rows: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
              diagonal: int, group: int = 1, dtype: Any = np.float64) -> np.ndarray | None:
        """What is added to the scores (ALiBi and a float ``attn_mask``) in the engines' folded rows,
        ``(Bx, 1 or hkv, r * group, k)`` in ``dtype`` (:func:`fold_tile`), or None.

        ``heads`` are the global query heads of the engine's ``hkv * group`` heads.
        """
        dt = np.dtype(dtype)
        out = None
        if self.alibi is not None:  # written straight into the folded rows: (Bs, hkv, r, G, k)
            h = np.asarray(heads, dtype=np.int64)
            hkv = max(h.size // group, 1)
            q = np.asarray(q_pos).astype(dt)[:, None] + dt.type(diagonal)
            dist = np.abs(q - np.asarray(k_pos).astype(dt)[None, :])[None, None, :, None, :]
            slopes = -self.alibi[:, h].astype(dt).reshape(-1, hkv, 1, group, 1)
            out = np.multiply(slopes, dist)
            out = out.reshape(out.shape[0], hkv, dist.shape[2] * group, dist.shape[4])
        if self.attn_mask is not None and self.attn_mask.dtype != np.bool_:
            h = np.asarray(heads, dtype=np.int64)
            m = fold_tile(self._mask_rows(heads, rows, k_pos).astype(dt), max(h.size // group, 1), group)
            out = m if out is None else out + m
        return out

    def _mask_rows(self, heads: np.ndarray, rows: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        m = self.attn_mask
        if m.shape[1] > 1:
            m = m[:, np.asarray(heads, dtype=np.int64) - self.mask_head0]
        return m[:, :, np.asarray(rows, dtype=np.int64)][..., np.asarray(k_pos, dtype=np.int64)]
