"""A call, as one object: what the user chose (:class:`Options`) and the whole call (:class:`AttentionSpec`).

:class:`Options` bundles the keywords that configure an attention call, the
same for :func:`mpiattn.attention`, :func:`mpiattn.attention_backward`,
:class:`mpiattn.MultiheadAttention`, the command line and the benchmark, so
a configuration is written once and passed on whole (``options=``).

:class:`AttentionSpec` is a validated call: global shapes, dtype, device,
scale, the mask rules (:class:`mpiattn.masks.MaskSpec`), the layouts and the
options. It is built from this rank's arrays, then agreed by every rank
field by field (:mod:`mpiattn.strategies.problem`); the strategies, the cost
model, the command line and the benchmark all read it, and it can also be
made from global shapes alone (:meth:`AttentionSpec.from_shapes`), with no
arrays and no communication, to plan or estimate a run.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .. import backend
from ..layouts import check_block_size, check_layout, layout_key
from ..masks import MaskSpec, check_causal, check_window, diagonal, softmax_scale
from ..masks.score import NAMES as SCORE_NAMES

__all__ = ["Options", "AttentionSpec", "SKIP_FINITE"]

#: How an error about NaN or Inf values tells the way around its check (:attr:`Options.check_finite`).
SKIP_FINITE = "check_finite=False, --allow-nonfinite on the command line, skips this check"


@dataclass(frozen=True)
class Options:
    """The keywords that configure an attention call (checked when made, locally).

    Attributes
    ----------
    causal : bool or {"top-left", "bottom-right"}
        Key ``j`` is visible to query ``i`` iff ``j <= i`` (global indices;
        True is ``"top-left"``, torch's ``is_causal``), or with
        ``"bottom-right"`` iff ``j <= i + M - N`` (the last query sees every
        key: FlashAttention >= 2.1, decode). Stored as False, True or
        ``"bottom-right"``.
    scale : float, optional
        Softmax scale, default ``1/sqrt(E)``.
    window : (left, right), optional
        Sliding window: key ``j`` is visible to query ``i`` only if
        ``i - left <= j <= i + right``; each bound an int >= 0 or None
        (bottom-right causal: measured from ``i + M - N``).
    layout : {"contiguous", "zigzag"} or Layout
        Row layout of the queries (and of the keys, unless ``kv_layout``).
    kv_layout : str or Layout, optional
        Row layout of the keys and values (default: ``layout``).
    strategy : str
        ``"auto"``, a registered strategy (:mod:`mpiattn.strategies.registry`),
        ``"hybrid"`` (the cost model picks its split) or ``"hybrid:UxR"``.
    engine : str
        ``"auto"`` or a registered engine (:mod:`mpiattn.kernels.engines`).
    block_size : int, optional
        Rows per exchanged key/value block and edge of the native engine's
        score tile; default the engine's preference.
    check_finite : bool
        Raise ValueError when an input holds NaN or Inf.
    machine : str, optional
        What the cost model assumes when it chooses (``strategy="auto"`` or
        ``"hybrid"``): a profile of :data:`mpiattn.strategies.machines.PROFILES`
        or a JSON file written by ``python -m mpiattn calibrate``; default the
        environment variable ``MPIATTN_MACHINE``, else the device's profile.

    The score modifiers (softcap, max_logit, ALiBi, masks, sinks, score functions) are not
    options: they are :class:`mpiattn.Score`'s, given as keywords of the calls or as one
    ``score=``.

    Raises
    ------
    TypeError, ValueError
        For a field of the wrong type or out of range (checked locally; the
        public calls check them inside their agreement, so every rank raises).
    """

    causal: bool | str = False
    scale: float | None = None
    window: tuple | None = None
    layout: Any = "contiguous"
    kv_layout: Any = None
    strategy: str = "auto"
    engine: str = "auto"
    block_size: int | None = None
    check_finite: bool = True
    machine: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "causal", check_causal(self.causal))
        scale = self.scale
        if scale is not None:
            if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real) \
                    or not math.isfinite(scale):
                raise ValueError(f"scale must be a finite number, got {scale!r}")
            object.__setattr__(self, "scale", float(scale))
        object.__setattr__(self, "window", check_window(self.window))
        check_layout(self.layout)
        if self.kv_layout is not None:
            check_layout(self.kv_layout)
        for name in ("strategy", "engine"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a name (str), got {getattr(self, name)!r}")
        if self.machine is not None and not isinstance(self.machine, str):
            raise TypeError(f"machine must be a profile name or a file path (str), got {self.machine!r}")
        object.__setattr__(self, "block_size", check_block_size(self.block_size, "attention"))
        object.__setattr__(self, "check_finite", bool(self.check_finite))

    @classmethod
    def of(cls, options: "Options | None" = None, **keywords: Any) -> "Options":
        """``options`` (default: the defaults) with ``keywords`` replacing its fields.

        Raises
        ------
        TypeError
            A keyword that is not a field, or ``options`` that is not Options.
        """
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"options must be mpiattn.Options, got {type(base).__name__}")
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        modifiers = [k for k in unknown if k in SCORE_NAMES]
        if modifiers:
            raise TypeError(f"{modifiers[0]} is a score modifier, not an option: give it to the call "
                            f"({modifiers[0]}=...) or in a mpiattn.Score (score=...)")
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; the options "
                            f"are {', '.join(f.name for f in fields(cls))}")
        return replace(base, **keywords) if keywords else base

    def by_field(self) -> dict:
        """``{field: value}``, comparable and small (an explicit layout by its digest)."""
        return {f.name: (layout_key(getattr(self, f.name))
                         if f.name in ("layout", "kv_layout") and getattr(self, f.name) is not None
                         else getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class AttentionSpec:
    """A validated attention call, the same on every rank.

    Attributes
    ----------
    B, H, Hkv, E, Ev : int
        Batch, query heads, key/value heads, query/key and value head dims.
    N, M : int
        Global query and key/value lengths.
    dtype : numpy.dtype
        The inputs' dtype (also of ``out`` and the gradients).
    device : {"numpy", "cupy"}
    scale : float
        The softmax scale (``1/sqrt(E)`` unless given).
    mask : MaskSpec
        The mask rules.
    layout, kv_layout : str or Layout
        The rows of the queries and of the keys/values.
    options : Options
        What the user chose (strategy, engine, block size, check_finite).
    tile : int or None
        The score tile the ranks' devices agreed on (the smallest of their
        engines' :meth:`~mpiattn.kernels.engine.Engine.tile_rows`), None on the host.
    """

    B: int
    H: int
    Hkv: int
    E: int
    Ev: int
    N: int
    M: int
    dtype: np.dtype
    device: str
    scale: float
    mask: MaskSpec
    layout: Any
    kv_layout: Any
    options: Options
    tile: int | None = None

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return self.H // self.Hkv

    @property
    def acc_dtype(self) -> np.dtype:
        """The accumulation dtype (:func:`mpiattn.backend.accum_dtype`)."""
        return backend.accum_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @classmethod
    def from_shapes(cls, q: tuple, k: tuple, v: tuple, dtype: Any, options: Options | None = None,
                    *, device: str = "numpy", padding: bool = False, segments: bool = False,
                    kv_segments: bool = False, alibi: bool = False, attn_mask: str | None = None,
                    mask_mod: bool = False, sinks: bool = False, score_mod: bool = False,
                    softcap: float | None = None, max_logit: bool = False) -> "AttentionSpec":
        """The spec of a call on shapes ``q (B, H, N, E)``, ``k (B, Hkv, M, E)``, ``v (B, Hkv, M,
        Ev)``: the one constructor (global shapes to plan or estimate a run; a rank's local
        shapes inside a validation, whose agreement then sets the global lengths). The
        keywords say which arrays come beside them (``attn_mask``: ``"bool"`` or ``"float"``).

        The shapes are trusted (checked where arrays are read).
        """
        o = Options() if options is None else options
        B, H, N, E = (int(x) for x in q)
        Hkv, M, Ev = int(k[1]), int(k[2]), int(v[3])
        mask = MaskSpec(causal=bool(o.causal), window=o.window, segments=segments,
                        kv_segments=kv_segments, padding=padding, diagonal=diagonal(o.causal, N, M),
                        softcap=softcap, alibi=alibi, attn_mask=attn_mask, mask_mod=mask_mod,
                        sinks=sinks, max_logit=max_logit, score_mod=score_mod)
        return cls(B=B, H=H, Hkv=Hkv, E=E, Ev=Ev, N=N, M=M, dtype=np.dtype(dtype), device=device,
                   scale=softmax_scale(o.scale, E), mask=mask, layout=o.layout,
                   kv_layout=o.layout if o.kv_layout is None else o.kv_layout, options=o)
