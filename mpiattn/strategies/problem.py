"""A validated attention call: the checks every rank agrees on, and what they produce.

:func:`validate` runs the local checks of every rank and one metadata
allgather; from then on every rank holds the same facts, so every later
decision (strategy, block size, error) is the same everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .. import backend
from ..comm.core import Comm
from ..comm.device import prepare
from ..kernels import DEFAULT_TILE, engines
from ..layouts import (all_segments, check_layout, check_shares, layout_key, local_lengths, positions,
                       to_global_order)
from . import masking
from .cost import choose_strategy

__all__ = ["STRATEGIES", "DEFAULT_BLOCK", "Progress", "Problem", "validate", "report", "full_mask"]

STRATEGIES = ("auto", "ring", "allgather", "ulysses", "materialized")

#: Default rows per exchanged key/value block (and score-tile edge).
DEFAULT_BLOCK = DEFAULT_TILE

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class Problem:
    """A validated call, identical on every rank except ``rank``.

    ``acc_dtype`` is the accumulation dtype (:func:`mpiattn.backend.accum_dtype`).
    ``block`` is the rows per exchanged key/value block, ``tile`` the edge of
    the native engine's score tile, ``engine`` the local engine every rank
    agreed on (:mod:`mpiattn.kernels.engines`) and ``engine_reason`` why;
    ``finite`` says every rank's inputs were checked to hold no NaN or Inf.
    ``layout`` and ``kv_layout`` are the rows' layouts of queries and keys
    (names or :class:`mpiattn.Layout`), ``window`` the ``(left, right)``
    window or None, ``seg_q`` ``(B, N)`` and ``seg_k`` ``(B, M)`` the global
    document ids (host int64, global order) or None
    (:mod:`mpiattn.strategies.masking`).
    """

    B: int
    H: int
    Hkv: int
    E: int
    Ev: int
    N: int
    M: int
    dtype: np.dtype
    acc_dtype: np.dtype
    scale: float
    causal: bool
    layout: Any
    strategy: str
    block: int
    masked: bool
    P: int
    rank: int
    engine: str = "native"
    engine_reason: str = ""
    tile: int = DEFAULT_TILE
    kv_layout: Any = None
    window: tuple | None = None
    seg_q: Any = field(default=None, compare=False, repr=False)
    seg_k: Any = field(default=None, compare=False, repr=False)
    finite: bool = False

    def __post_init__(self) -> None:
        if self.kv_layout is None:
            object.__setattr__(self, "kv_layout", self.layout)

    @property
    def G(self) -> int:
        return self.H // self.Hkv

    @property
    def rules(self) -> tuple[str, ...]:
        """The active mask rules (see :data:`mpiattn.kernels.masks.RULES`)."""
        return masking.rules_of(self.causal, self.window, self.seg_q, True if self.masked else None)

    def q_pos(self) -> np.ndarray:
        return positions(all_segments(self.N, self.P, self.layout)[self.rank])


# --------------------------------------------------------------- validation
def _local_meta(q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any], *, causal: bool,
                scale: float | None, layout: str, strategy: str, block_size: int | None,
                check_finite: bool, engine: str = "auto", window: Any = None,
                segment_ids: Any = None, kv_segment_ids: Any = None, kv_layout: Any = None,
                ids: dict | None = None) -> tuple:
    xp = backend.array_module(q, k, v, *extra.values())
    if mask is not None and backend.array_module(mask) is not xp:
        raise TypeError("key_padding_mask is not on the same backend (NumPy/CuPy) as q, k, v")
    check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if engine not in engines.ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(engines.ENGINES)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, sequence, feature), got shape {x.shape}")
        backend.check_dtype(x.dtype, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, n, E = q.shape
    Bk, Hkv, m, Ek = k.shape
    if Bk != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if Ek != E:
        raise ValueError(f"feature size of q ({E}) and k ({Ek}) differ")
    if v.shape[1] != Hkv or v.shape[2] != m:
        raise ValueError(f"k {k.shape} and v {v.shape} must agree in heads and sequence length")
    if Hkv < 1 or H < 1 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a positive multiple of key/value heads ({Hkv})")
    if E < 1:
        raise ValueError("feature size E must be >= 1")
    if mask is not None:
        if mask.dtype != np.bool_:
            raise TypeError(f"key_padding_mask must be bool (True = padding), got {mask.dtype}")
        if mask.shape != (B, m):
            raise ValueError(f"key_padding_mask must have shape (B, m_r) = {(B, m)}, got {mask.shape}")
    if scale is not None and not (isinstance(scale, (int, float, np.floating)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if block_size is not None and (not isinstance(block_size, (int, np.integer)) or block_size < 1):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    Ev = v.shape[3]
    want = {"dout": (B, H, n, Ev), "out": (B, H, n, Ev), "lse": (B, H, n)}
    for name, x in extra.items():
        if x.shape != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {x.shape}")
        if name != "lse" and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        if name == "lse" and x.dtype.kind != "f":
            raise TypeError(f"lse must be floating point, got {x.dtype}")
    if check_finite:
        for name, x in (("q", q), ("k", k), ("v", v), *[(nm, x) for nm, x in extra.items() if nm != "lse"]):
            if x.size and not bool(xp.isfinite(x).all()):
                raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
    masks = masking.local_meta(window, segment_ids, kv_segment_ids, kv_layout, B, n, m, xp,
                               {} if ids is None else ids)
    rules = masking.rules_of(causal, masks[0], segment_ids, mask)
    return ((B, H, Hkv, E, Ev), str(q.dtype), n, m, bool(causal),
            None if scale is None else float(scale), layout_key(layout), strategy, block_size,
            mask is not None, xp.__name__, masks, engine,
            engines.local_choice(engine, xp.__name__, q.dtype, E, v.shape[3], rules))


def validate(c: Comm, q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any], **kw: Any) -> Problem:
    """Check a call on every rank (one metadata allgather) and return its :class:`Problem`.

    Raises the same ValueError/TypeError on every rank when any rank's
    arguments are bad or the ranks disagree; then chooses the device
    transport for CuPy arrays (a collective point every rank reaches).
    """
    ids: dict = {}
    metas = c.allgather_checked(lambda: _local_meta(q, k, v, mask, extra, ids=ids, **kw))
    head = metas[0]
    names = ("shapes (B, H, Hkv, E, Ev)", "dtype", None, None, "causal", "scale", "layout",
             "strategy", "block_size", "key_padding_mask presence", "backend",
             "masks (window, kv_layout, segment_ids and kv_segment_ids presence)", "engine", None)
    for r, meta in enumerate(metas):
        for i, name in enumerate(names):
            if name is not None and meta[i] != head[i]:
                raise ValueError(f"ranks disagree on {name}: rank 0 has {head[i]!r}, rank {r} has {meta[i]!r}")
    (B, H, Hkv, E, Ev), dtype, _, _, causal, scale, _, strategy, block, masked, _, _, _, _ = head
    layout = kw.get("layout", "contiguous")  # the same on every rank (its key was compared)
    N = sum(meta[2] for meta in metas)
    M = sum(meta[3] for meta in metas)
    check_shares([meta[2] for meta in metas], layout, "query rows (q)")
    dt = np.dtype(dtype)
    engine, why = _agree_engine([meta[-1] for meta in metas], head[-2])
    engines.notice_fallback(c.rank, head[-2], engine, why)
    tile = int(block or DEFAULT_BLOCK)
    prob = Problem(B, H, Hkv, E, Ev, N, M, dt, backend.accum_dtype(dt),
                   1.0 / math.sqrt(E) if scale is None else scale, causal, layout, strategy,
                   tile, masked, c.size, c.rank, engine, why, tile)
    kv_layout = masking.key_layout(prob, layout, kw.get("kv_layout"))
    check_shares([meta[3] for meta in metas], kv_layout, "key/value rows (k, v)")
    prob = _resolve(prob)
    if block is None:  # the engine's preferred ring block (the cost model used the default)
        row_bytes = B * Hkv * (E + Ev) * dt.itemsize
        rows = engines.get(engine).block_rows(DEFAULT_BLOCK, row_bytes=row_bytes,
                                              max_rows=max(meta[3] for meta in metas))
        prob = replace(prob, block=int(rows))
    if kw.get("check_finite"):  # every rank checked its inputs: engines need not look for NaN again
        prob = replace(prob, finite=True)
    prepare(c, q, k, v)  # every rank is here, with the same backend
    return masking.complete(c, prob, [meta[11] for meta in metas], ids, kv_layout)


def _agree_engine(choices: list[tuple[str, str]], requested: str) -> tuple[str, str]:
    """The engine every rank uses, from each rank's local choice (the same answer everywhere)."""
    for r, (name, why) in enumerate(choices):
        if requested == "torch" and not name:
            raise ValueError(f"engine 'torch' cannot run on rank {r}: {why}; use engine='native' or 'auto'")
    native = [(r, why) for r, (name, why) in enumerate(choices) if name != "torch"]
    if not native:
        return "torch", choices[0][1]
    r, why = native[0]
    return "native", why if len(choices) == 1 else f"rank {r}: {why}"


def _resolve(pb: Problem) -> Problem:
    if pb.strategy == "ulysses" and (pb.H % pb.P or pb.Hkv % pb.P):
        raise ValueError(f"strategy 'ulysses' needs H ({pb.H}) and Hkv ({pb.Hkv}) divisible by "
                         f"the number of ranks ({pb.P}); use 'ring' or 'allgather'")
    if pb.strategy != "auto":
        return pb
    return replace(pb, strategy=choose_strategy(pb.N, pb.M, pb.H, pb.Hkv, pb.E, pb.Ev, pb.P, pb.block))


def report(progress: Progress, done: int, total: int) -> None:
    """Call ``progress(done, total)`` when a callback was given."""
    if progress is not None:
        progress(done, total)


def full_mask(c: Comm, pb: Problem, mask: Any) -> Any:
    """Every rank's ``(B, m_r)`` padding mask -> the global ``(B, M)`` mask on every rank."""
    xp = backend.array_module(mask)
    rows = c.allgatherv_rows(xp.ascontiguousarray(mask.T), local_lengths(pb.M, pb.P, pb.kv_layout))
    return xp.ascontiguousarray(to_global_order(rows, pb.M, pb.P, pb.kv_layout).T)
