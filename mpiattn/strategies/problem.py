"""A validated attention call: built from this rank's arrays, agreed by every rank, then planned.

:func:`validate` runs the local checks of every rank and one metadata
allgather; the ranks' specs are compared field by field (an error names the
field they disagree on), and from then on every rank holds the same
:class:`~mpiattn.strategies.spec.AttentionSpec`, so every later decision
(engine, block size, strategy, error) is the same everywhere. The result is
a :class:`Problem`: the spec, the chosen strategy and engine, the block
sizes, and the gathered document ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm
from ..comm.device import prepare
from ..kernels import DEFAULT_TILE, engines
from ..kernels.call import KernelCall
from ..kernels.engine import Engine
from ..layouts import Layout, all_segments, check_shares, describe, layout_key, positions
from ..masks import QuerySide, diagonal
from ..masks.counts import key_step_for, visible_keys
from ..masks.ids import global_rows, local_ids
from ..masks.modifiers import Modifiers
from ..masks.score import Checked, Score, agree_answers
from . import machines, registry
from .base import Strategy
from .blocked import Attend
from .spec import SKIP_FINITE, AttentionSpec, Options

__all__ = ["Problem", "Arguments", "validate", "visible_pairs"]


@dataclass(frozen=True)
class Problem:
    """A validated, planned call: the same on every rank except ``rank``.

    Attributes
    ----------
    spec : AttentionSpec
    P, rank : int
    strategy : Strategy
        With ``strategy_reason``, why it was chosen.
    engine : Engine
        With ``engine_reason``.
    block : int
        Rows per exchanged key/value block.
    tile : int
        Edge of the native engine's score tile.
    finite : bool
        Every rank checked its inputs to hold no NaN or Inf.
    seg_q, seg_k : (B, N), (B, M) host int64 arrays or None
        The global document ids (global order).
    mods : Modifiers or None
        This rank's score modifiers (softcap, ALiBi, ``attn_mask``, ``mask_mod``); None when the
        call has none and no ``max_logit``.
    sinks : (H,) float64 host array or None
        The sinks (:mod:`mpiattn.masks.sinks`), the same on every rank.
    heads : tuple of int or None
        The global query heads of this call's arrays (a head-sharded strategy's share of a
        call); None: all ``H``.
    tally : HeadMax or None
        Filled by a forward pass with what it measured (:mod:`mpiattn.masks.maxlogit`).
    """

    spec: AttentionSpec
    P: int
    rank: int
    strategy: Strategy
    engine: Engine
    block: int
    tile: int
    finite: bool
    strategy_reason: str = ""
    engine_reason: str = ""
    seg_q: Any = field(default=None, compare=False, repr=False)
    seg_k: Any = field(default=None, compare=False, repr=False)
    mods: Any = field(default=None, compare=False, repr=False)
    sinks: Any = field(default=None, compare=False, repr=False)
    heads: tuple | None = None
    tally: Any = field(default=None, compare=False, repr=False)

    def q_pos(self) -> np.ndarray:
        """Global positions of this rank's queries (local order)."""
        return positions(all_segments(self.spec.N, self.P, self.spec.layout)[self.rank])

    def query_heads(self) -> np.ndarray:
        """The global query heads of this call's arrays (:attr:`heads`, default ``0..H-1``)."""
        return np.arange(self.spec.H) if self.heads is None else np.asarray(self.heads)

    def queries(self, q_pos: np.ndarray | None = None, heads: Any = None) -> QuerySide:
        """This rank's queries (or those at global positions ``q_pos``, of the global query heads
        ``heads``) as the key blocks of this call see them (one per call)."""
        return QuerySide.of(self.q_pos() if q_pos is None else q_pos, self.seg_q, self.mods,
                            self.query_heads() if heads is None else heads)

    def kernel_call(self, heads: int = 1) -> KernelCall:
        """What the engine is told of this call; ``heads``: the ranks its key/value heads are
        shared among (a head-sharded strategy)."""
        return KernelCall.of(self.spec, tile=self.tile, finite=self.finite, heads=heads)

    def attend(self, queries: QuerySide | None = None, heads: int = 1) -> Attend:
        """This rank's side of the call for the blocked runner (:mod:`mpiattn.strategies.blocked`):
        its queries (default :meth:`queries`) against key blocks at global positions."""
        return Attend(self.engine, self.kernel_call(heads), self.spec.mask,
                      self.queries() if queries is None else queries, self.seg_k, self.tally)

    def relaid(self, layout: Any) -> "Problem":
        """The same call with queries and keys in ``layout`` (the ids are global: unchanged)."""
        return replace(self, spec=replace(self.spec, layout=layout, kv_layout=layout))

    def details(self) -> dict:
        """What the call used: ``strategy``, ``engine`` and their reasons, ``block_size``."""
        return {"strategy": self.strategy.label, "strategy_reason": self.strategy_reason,
                "engine": self.engine.name, "engine_reason": self.engine_reason,
                "block_size": self.block}


@dataclass(frozen=True)
class Arguments:
    """One rank's arguments of an attention call, as given: what :func:`validate` checks.

    Attributes
    ----------
    q, k, v : arrays, shapes (B, H, n_r, E), (B, Hkv, m_r, E), (B, Hkv, m_r, Ev)
    key_padding_mask : bool array (B, m_r) or None
    segment_ids, kv_segment_ids : integer arrays (B, n_r), (B, m_r) or None
    grads : dict
        A backward's ``dout``, ``out`` and ``lse`` (empty for a forward or a plan).
    settings : dict
        The :class:`Options` keywords (and ``options``) the caller passed.
    score : Score
        The score modifiers (:class:`mpiattn.masks.score.Score`; a softcap or max_logit among
        the settings joins it).
    """

    q: Any
    k: Any
    v: Any
    key_padding_mask: Any = None
    segment_ids: Any = None
    kv_segment_ids: Any = None
    grads: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    score: Score = field(default_factory=Score)

    @property
    def call(self) -> str:
        """The public call these arguments are of (errors name it)."""
        return "attention_backward" if "dout" in self.grads else "attention"


# --------------------------------------------------------------- local checks
def _check_arrays(q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any]) -> Any:
    """The local shape and dtype checks; returns the array module."""
    xp = backend.array_module(q, k, v, *extra.values())
    if mask is not None and backend.array_module(mask) is not xp:
        raise TypeError("key_padding_mask is not on the same backend (NumPy/CuPy) as q, k, v")
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
    Ev = v.shape[3]
    want = {"dout": (B, H, n, Ev), "out": (B, H, n, Ev), "lse": (B, H, n)}
    for name, x in extra.items():
        if x.shape != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {x.shape}")
        if name != "lse" and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        if name == "lse" and x.dtype.kind != "f":
            raise TypeError(f"lse must be floating point, got {x.dtype}")
    return xp


class _Rank:
    """This rank's view of a call: :meth:`shared` checks the arguments (inside the validation
    allgather: errors are agreed) and returns what the ranks compare; what it made stays here
    for the agreed part (the checked score modifiers, the local document ids)."""

    def __init__(self, args: Arguments):
        self.args = args
        self.score: Checked | None = None
        self.seg_q = self.seg_k = None

    def shared(self) -> dict:
        """The fields every rank must hold alike (names with ``_``: gathered, not compared)."""
        a = self.args
        q, k, v, mask, extra = a.q, a.k, a.v, a.key_padding_mask, a.grads
        segment_ids, kv_segment_ids = a.segment_ids, a.kv_segment_ids
        settings = dict(a.settings)
        options = Options.of(settings.pop("options", None), **settings)
        score = a.score if a.score is not None else Score()
        if options.strategy != "auto":
            registry.get(options.strategy)  # an unknown name or configuration raises here
        if options.engine not in engines.NAMES:
            raise ValueError(f"unknown engine {options.engine!r}; expected one of {', '.join(engines.NAMES)}")
        xp = _check_arrays(q, k, v, mask, extra)
        if options.check_finite:
            for name, x in (("q", q), ("k", k), ("v", v), *[(nm, x) for nm, x in extra.items() if nm != "lse"]):
                if x.size and not bool(xp.isfinite(x).all()):
                    raise ValueError(f"{name} contains NaN or Inf ({SKIP_FINITE})")
        B, H, n, E = q.shape
        Hkv, m, Ev = k.shape[1], k.shape[2], v.shape[3]
        if kv_segment_ids is not None and segment_ids is None:
            raise ValueError("kv_segment_ids needs segment_ids (the queries' document ids)")
        if segment_ids is not None:
            self.seg_q = local_ids("segment_ids", segment_ids, (B, n), xp)
        if kv_segment_ids is not None:
            self.seg_k = local_ids("kv_segment_ids", kv_segment_ids, (B, m), xp)
        checked = self.score = score.checked(B, H, n)
        if "dout" in extra and checked.score_mod is not None and not getattr(
                checked.score_mod, "differentiable", True):
            raise ValueError("score_mod has no derivative: a backward needs mpiattn.ScoreMod(fn, grad), "
                             "grad(score, b, h, q_idx, kv_idx) = d fn / d score")
        here = AttentionSpec.from_shapes(q.shape, k.shape, v.shape, q.dtype, options, device=xp.__name__,
                                         padding=mask is not None, segments=segment_ids is not None,
                                         kv_segments=kv_segment_ids is not None, **checked.flags())
        mask_spec = here.mask
        machine = None
        if registry.needs_choice(options.strategy) or options.engine == "auto":
            # the cost model, or the engines' measured speeds, decide: on which machine
            machine = machines.load(machines.resolve_name(options.machine, xp.__name__))
        return {"shapes (B, H, Hkv, E, Ev)": (B, H, Hkv, E, Ev), "dtype": str(q.dtype),
                "backend": xp.__name__, **options.by_field(),
                "segment_ids / kv_segment_ids / key_padding_mask presence": (
                    mask_spec.segments, mask_spec.kv_segments, mask_spec.padding),
                "the cost model's machine (machine= or $" + machines.MACHINE_VARIABLE + ")": (
                    None if machine is None else {**machine.to_dict(), "sources": None}),
                **checked.agreement(), "_mask_keys": checked.mask_keys, "_hides": checked.hides,
                "_n": n, "_m": m, "_spec": here, "_machine": machine,
                "_engine": (choice := engines.local_choice(
                    options.engine, here, None if machine is None else machine.engines,
                    backward="dout" in extra)),
                "_tile": engines.get(choice[0]).tile_rows(here) if choice[0] else None}


def _key_layout(options: Options, N: int, M: int) -> Any:
    """The keys' layout (``kv_layout``, default ``layout``), checked against ``M``."""
    if options.kv_layout is not None:
        return options.kv_layout
    if isinstance(options.layout, Layout) and options.layout.n != M:
        raise ValueError(f"the layout is an explicit Layout of {options.layout.n} rows, but the keys "
                         f"have M = {M} rows; pass kv_layout= for the keys")
    return options.layout


#: The most (pair x batch x head) entries of an ``attn_mask`` or ``mask_mod`` a rank evaluates to
#: count its rows' visible pairs for the cost model (more: every few keys, scaled).
PAIRS_LIMIT = 2**22


def visible_pairs(c: Comm, spec: AttentionSpec, mods: Modifiers) -> np.ndarray:
    """The visible keys of every global query row under the rules, ``attn_mask`` and ``mask_mod``
    (each rank counts its rows, :func:`mpiattn.masks.counts.visible_keys`; collective)."""
    segs = all_segments(spec.N, c.size, spec.layout)
    q_pos = positions(segs[c.rank])
    step = key_step_for(q_pos.size, spec.M, mods, PAIRS_LIMIT)
    got = c.allgather_checked(lambda: visible_keys(spec.mask, mods, q_pos, spec.M, key_step=step))
    pairs = np.zeros(spec.N, dtype=np.float64)
    for seg, w in zip(segs, got):
        pairs[positions(seg)] = w
    return pairs


# --------------------------------------------------------------- the call
def validate(c: Comm, args: Arguments) -> Problem:
    """Check a call on every rank (one metadata allgather) and plan it: its :class:`Problem`.

    Raises the same (:class:`mpiattn.comm.errors.Agreed`) ValueError/TypeError on every rank
    when any rank's arguments are bad or the ranks disagree; then chooses the device transport
    for CuPy arrays and gathers the document ids (collective points every rank reaches).
    """
    mine = _Rank(args)
    got = c.agree(mine.shared, call=args.call)
    q, k, v = args.q, args.k, args.v
    with errors.alike():  # from here on every rank decides on the same gathered data
        here: AttentionSpec = got[0]["_spec"]
        options = here.options
        N, M = sum(g["_n"] for g in got), sum(g["_m"] for g in got)
        check_shares([g["_n"] for g in got], options.layout, "query rows (q)")
        kv_layout = _key_layout(options, N, M)
        check_shares([g["_m"] for g in got], kv_layout, "key/value rows (k, v)")
        if here.mask.segments and not here.mask.kv_segments and (
                N != M or layout_key(options.layout) != layout_key(kv_layout)):
            raise ValueError(
                "kv_segment_ids omitted: the keys take the queries' document ids, which needs "
                f"N == M and one layout for queries and keys (here N = {N}, M = {M}, layouts "
                f"{describe(options.layout)} and {describe(kv_layout)}); pass kv_segment_ids")
        bad = [r for r, g in enumerate(got) if g["_mask_keys"] not in (None, M)]
        if bad:
            raise ValueError(f"attn_mask must span every key: its last axis must be M = {M} (the "
                             f"global key length), but rank {bad[0]} has {got[bad[0]]['_mask_keys']}")
        engine_name, engine_reason = engines.agreed_choice([g["_engine"] for g in got], options.engine)
        # (the tiles the ranks prefer for the engine they run; where auto fell back: its default)
        tiles = [g["_tile"] for g in got if g["_tile"] and g["_engine"][0] == engine_name]
        spec = replace(here, N=N, M=M, kv_layout=kv_layout, tile=min(tiles) if tiles else None,
                       mask=replace(here.mask, diagonal=diagonal(options.causal, N, M)))
        engine = engines.get(engine_name)
        max_m = max(g["_m"] for g in got)
        block = options.block_size or engine.block_rows(spec, max_m)
        checked: Checked = mine.score
        mods = checked.modifiers()
        agree_answers(c, checked, N, M, spec.mask.diagonal, args.call)
        # whether some pair is hidden: from every rank's rows (a float attn_mask may hold -inf
        # on some ranks only), so that every rank counts the pairs, or none does
        hides = any(g["_hides"] for g in got)
        pairs = None
        if registry.needs_choice(options.strategy) and hides:
            pairs = visible_pairs(c, spec, mods)
        strategy, strategy_reason = registry.resolve(spec, c.topology, block, got[0]["_machine"],
                                                     pairs=pairs)
    prepare(c, q, k, v)  # every rank is here, with the same backend
    seg_q = seg_k = None
    if spec.mask.segments:
        seg_q = global_rows(c, mine.seg_q, N, spec.layout)
        seg_k = global_rows(c, mine.seg_k, M, kv_layout) if spec.mask.kv_segments else seg_q
    return Problem(spec=spec, P=c.size, rank=c.rank, strategy=strategy, engine=engine, block=int(block),
                   tile=int(options.block_size or spec.tile or DEFAULT_TILE), finite=options.check_finite,
                   strategy_reason=strategy_reason, engine_reason=engine_reason, seg_q=seg_q,
                   seg_k=seg_k, mods=mods, sinks=checked.sinks)
