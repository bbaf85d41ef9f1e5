"""Decode: a few new queries, held by every rank, against a key/value cache sharded over the ranks.

The ``t`` queries are the last ``t`` positions of the cache's ``M`` rows
(their keys appended already): query ``i`` stands at position ``M - t + i``
and, causal, sees keys ``j <= M - t + i`` (bottom-right alignment), with a
window measured from the same position. Every rank

1. checks the call with one metadata allgather (the queries' shapes, dtype
   and a CRC-32 of their bytes must be the same on every rank; the engine
   must run here): a bad input raises the same error on every rank;
2. attends its own rows with its engine (:mod:`mpiattn.inference.local`;
   a rank whose rows no query sees computes nothing);
3. takes part in the tree merge of the partials (:mod:`mpiattn.inference.merge`):
   one message of ``B t H (Ev + 1)`` words sent per rank, the result
   bitwise identical on every rank.

Cost per rank and step: FLOPs ``4 B H t (E + Ev) / 2 x M / P`` (the visible
pairs), words read ``M / P x B Hkv (E + Ev)`` (memory bound for small
``t``), words sent ``B t H (Ev + 1)``, ``2 ceil(log2 P)`` message steps.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm
from ..comm.device import prepare
from ..kernels import engines
from ..masks.modifiers import check_attn_mask, mask_kind
from ..masks.score import Checked, Score, agree_answers
from ..masks.sinks import add_sinks
from ..strategies import model
from ..strategies.machines import Machine
from ..strategies.spec import SKIP_FINITE, AttentionSpec, Options
from .placement import PAGE_ROWS
from .pricing import DecodeStep
from .local import partial_attention, step_attend
from .merge import tree_merge
from .shard import Shard

__all__ = ["decode", "DecodePlan", "checksum", "step_spec", "Step", "predict_step"]


def checksum(x: Any) -> int:
    """CRC-32 of an array's bytes (host copy for CuPy): ranks compare replicated inputs by it."""
    return zlib.crc32(np.ascontiguousarray(backend.to_host(x)).view(np.uint8).reshape(-1))


class Step:
    """What a decode step used: ``engine``, ``blocks`` computed on this rank, ``merge_words``."""

    def __init__(self, engine: str, blocks: int, merge_words: int):
        self.engine, self.blocks, self.merge_words = engine, blocks, merge_words

    def as_dict(self) -> dict:
        return {"engine": self.engine, "blocks": self.blocks, "merge_words": self.merge_words}


def step_spec(shard: Shard, length: int, q: Any, options: Options, **modifiers: Any) -> AttentionSpec:
    """The call of queries ``q (B, H, t, E)`` against the ``length`` rows of ``shard``'s cache as an
    :class:`AttentionSpec` (:meth:`~AttentionSpec.from_shapes`; ``modifiers``: its ``alibi`` and
    ``sinks`` flags), bottom-right aligned when causal (what engines' declared capabilities are
    read on)."""
    B, H, t, E = q.shape
    o = Options.of(options, causal="bottom-right" if options.causal else False, layout="contiguous",
                   kv_layout="contiguous")
    return AttentionSpec.from_shapes(q.shape, (B, shard.Hkv, length, E), (B, shard.Hkv, length, shard.Ev),
                                     q.dtype, o, device=backend.array_module(q).__name__, **modifiers)


def _local(shard: Shard, length: int, q: Any, settings: dict, score: Score, kept: dict) -> dict:
    """This rank's checks of a step (inside the validation allgather: errors are agreed); the
    checked score modifiers go into ``kept["score"]`` (functions stay on their rank)."""
    options = Options.of(None, **settings)
    if options.engine not in engines.NAMES:
        raise ValueError(f"unknown engine {options.engine!r}; expected one of {', '.join(engines.NAMES)}")
    xp = backend.array_module(q)
    if xp is not shard.xp:
        raise TypeError(f"the queries are {xp.__name__} arrays, the cache holds {shard.xp.__name__} "
                        "arrays")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (batch, heads, new tokens, feature), got shape {q.shape}")
    B, H, t, E = q.shape
    if q.dtype != shard.dtype:
        raise TypeError(f"q has dtype {q.dtype}, the cache holds {shard.dtype}")
    if B != shard.B:
        raise ValueError(f"q has batch {B}, the cache has batch {shard.B}")
    if E != shard.E:
        raise ValueError(f"q has head dim E = {E}, the cache's keys have E = {shard.E}")
    if H < 1 or H % shard.Hkv:
        raise ValueError(f"q's heads ({H}) must be a positive multiple of the cache's key/value "
                         f"heads ({shard.Hkv})")
    if t < 1:
        raise ValueError("q holds no new token (t = 0)")
    if options.check_finite and not bool(xp.isfinite(q).all()):
        raise ValueError(f"q contains NaN or Inf ({SKIP_FINITE})")
    checked = kept["score"] = score.checked(B, H, t, "replicated")
    if checked.max_logit:
        raise ValueError("max_logit is not reported by a decode step")
    if checked.mask_keys not in (None, length):
        raise ValueError(f"attn_mask must span the whole cache: its last axis must be {length} "
                         f"(the cache's length, the new tokens' keys appended), got {checked.mask_keys}")
    spec = step_spec(shard, length, q, options, **checked.flags())
    return {"q's shape (B, H, t, E)": tuple(q.shape), "q's dtype": str(q.dtype),
            "q's values (CRC-32)": checksum(q), **options.by_field(), **checked.agreement(),
            "_spec": spec, "_engine": engines.local_choice(options.engine, spec)}


class DecodePlan:
    """Decode steps of one shape against a growing cache, planned once (collective to make).

    Made by :meth:`mpiattn.inference.KVCache.plan_attend`. Making it does what every one-shot
    step does first (step 1 of the module docstring: the local checks, the agreement of every
    setting and score modifier, the engine); calling it only checks, on every rank, that the
    queries are the planned ones (shape, dtype, backend, finiteness with ``check_finite``, the
    ``attn_mask``'s shape) and that every rank holds the same queries (CRC-32), in one small
    allgather, then attends the cache as it is then (its length grows with each append).

    Attributes
    ----------
    shape : tuple
        The planned ``q`` shape ``(B, H, t, E)``.
    dtype : numpy.dtype
    engine : str
        The engine every step uses.
    """

    def __init__(self, c: Comm, shard: Shard, length_of: Callable[[], int], q: Any, settings: dict,
                 score: Score | None = None, call: str = "KVCache.plan_attend"):
        length = length_of()
        kept: dict = {}
        got = c.agree(lambda: _local(shard, length, q, dict(settings), score or Score(), kept),
                      call=call)
        self._score: Checked = kept["score"]
        self._spec: AttentionSpec = got[0]["_spec"]
        with errors.alike():
            engines.agreed_choice([g["_engine"] for g in got], settings.get("engine"))
            agree_answers(c, self._score, self._spec.N, length, length - self._spec.N, call)
        self.comm, self.shard, self._length_of = c, shard, length_of
        self.shape, self.dtype = tuple(q.shape), q.dtype
        self.engine = got[0]["_engine"][0]
        self._mask_kind = mask_kind(self._score.attn_mask)

    def __repr__(self) -> str:
        return (f"DecodePlan(shape={self.shape}, dtype={self.dtype}, engine={self.engine!r}, "
                f"ranks={self.comm.size})")

    def _misfit(self, q: Any, attn_mask: Any, length: int) -> tuple:
        """This rank's check of a step (local; raises): ``(CRC-32 of q, of attn_mask)``."""
        xp = backend.array_module(q)
        if xp is not self.shard.xp or tuple(q.shape) != self.shape or q.dtype != self.dtype:
            raise ValueError(f"DecodePlan: q is a {xp.__name__} array of shape {tuple(q.shape)} "
                             f"and dtype {q.dtype}; the plan is for {self.shard.xp.__name__} "
                             f"arrays of {self.shape} {self.dtype} (make another plan for others)")
        if self._spec.options.check_finite and not bool(xp.isfinite(q).all()):
            raise ValueError(f"q contains NaN or Inf ({SKIP_FINITE})")
        if (attn_mask is None) != (self._mask_kind is None):
            raise ValueError(f"DecodePlan: the plan was made {'without' if attn_mask is not None else 'with'}"
                             " an attn_mask; pass one exactly when the plan has one")
        if attn_mask is None:
            return checksum(q), None
        B, H, t, _ = self.shape
        mask = check_attn_mask(attn_mask, B, H, t)
        if mask.shape[3] != length or mask_kind(mask) != self._mask_kind:
            raise ValueError(f"DecodePlan: attn_mask must be a {self._mask_kind} mask spanning the "
                             f"cache ({length} keys), got {mask.dtype} {tuple(mask.shape)}")
        return checksum(q), checksum(mask)

    def __call__(self, q: Any, *, attn_mask: Any = None, details: dict | None = None
                 ) -> tuple[Any, Any]:
        """One step (collective): ``q (B, H, t, E)``, the planned shape, the same on every rank,
        against the cache's ``length`` rows; ``attn_mask (B or 1, H or 1, t, length)`` when the
        plan was made with one. Returns ``out (B, H, t, Ev)``, ``lse (B, H, t)`` as
        :meth:`mpiattn.inference.KVCache.attend`; ValueError on every rank alike."""
        length = self._length_of()
        got = self.comm.allgather_checked(lambda: self._misfit(q, attn_mask, length),
                                          call="DecodePlan")
        errors.same_everywhere(got, "the queries (CRC-32 of q, attn_mask)")
        B, H, t, _ = self.shape
        mask = None if attn_mask is None else check_attn_mask(attn_mask, B, H, t)
        return self.run(q, length, mask, details)

    def run(self, q: Any, length: int, mask: Any = None, used: dict | None = None
            ) -> tuple[Any, Any]:
        """The step on queries known to fit (no check); ``mask`` checked, or the plan's own."""
        c = self.comm
        spec = self._spec
        score = self._score if mask is None else self._score.with_mask(mask)
        if spec.M != length:
            spec = step_spec(self.shard, length, q, spec.options, **score.flags())
        engine = engines.get(self.engine)
        prepare(c, q)
        t = spec.N
        attend = step_attend(engine, spec, np.arange(length - t, length), spec.options.check_finite,
                             score.modifiers())
        with c.abort_on_error():
            o, lse, blocks = partial_attention(attend, q, self.shard.views())
            o, lse = tree_merge(c, o, lse)
            if score.sinks is not None:  # the merged rows, the same on every rank
                o, lse = add_sinks(o, lse, score.sinks)
        if used is not None:
            used.update(Step(engine.name, blocks, int(lse.size) * (spec.Ev + 1)).as_dict())
        return o.astype(spec.dtype, copy=False), lse


def decode(c: Comm, shard: Shard, length: int, q: Any, settings: dict,
           used: dict | None = None, score: Score | None = None) -> tuple[Any, Any]:
    """One decode step (see the module docstring); collective on ``c``: a :class:`DecodePlan`
    made for it and run once.

    Parameters
    ----------
    c : Comm
    shard : Shard
        This rank's cache rows.
    length : int
        The cache's global length ``M`` (the same on every rank).
    q : array, shape (B, H, t, E)
        The new queries, the same on every rank.
    settings : dict
        :class:`mpiattn.Options` fields: ``causal`` (True: bottom-right, the
        default; False), ``window``, ``scale``, ``engine``, ``check_finite``.
    used : dict, optional
        Filled with :meth:`Step.as_dict`.
    score : Score, optional
        The score modifiers (:class:`mpiattn.Score`: an ``attn_mask`` ``(B or 1, H or 1, t, M)``
        with its key axis the cache's absolute positions, a softcap), the same on every rank.

    Returns
    -------
    out : array, shape (B, H, t, Ev), q's dtype
    lse : array, shape (B, H, t), the accumulation dtype
        Bitwise identical on every rank.

    Raises
    ------
    ValueError, TypeError
        On every rank alike (marked :class:`mpiattn.comm.errors.Agreed`).
    """
    plan = DecodePlan(c, shard, lambda: length, q, settings, score, call="KVCache.attend")
    return plan.run(q, length, None, used)


def predict_step(spec: AttentionSpec, topology: Any, machine: Machine, pairs: Any = None,
                 rate_dtype: str | None = None, page: int = PAGE_ROWS) -> dict:
    """The cost model's decode step: ``spec`` the new queries' call against the cache
    (:func:`~mpiattn.inference.pricing.chunk_spec`: ``N`` new tokens at the end of ``M`` keys) on
    ``topology``'s ranks, priced by :func:`mpiattn.strategies.model.predict` as
    :class:`~mpiattn.inference.pricing.DecodeStep`.

    Per rank: the compute of the visible pairs it holds, or reading those keys at the memory
    bandwidth, whichever is longer (a decode step is memory-bound for few new tokens); then the
    tree merge. ``pairs``: the new rows' visible keys when a mask hides some (counted; default
    the causal and window rules'); ``page``: the cache's rows per page.

    Returns
    -------
    dict
        ``compute_s``, ``read_s``, ``merge_s``, ``step_s`` (seconds) and ``merge_bytes`` (one
        merge message).
    """
    step = DecodeStep(page)
    pairs = model.RowPairs.of(spec, pairs)
    pred = model.predict(step, spec, topology, spec.M, machine, pairs, rate_dtype)
    dtype = rate_dtype or spec.dtype
    flops = model.flops_per_pair(spec.B, spec.H, spec.E, spec.Ev) * pairs.total
    compute = model.compute_time(flops * step.work(spec, topology, pairs), machine, dtype)
    read = model.compute_time(0.0, machine, dtype, step.reads(spec, topology))
    return {"compute_s": compute, "read_s": read, "merge_s": pred.forward_s - pred.compute_s,
            "step_s": pred.forward_s, "merge_bytes": step.merge_bytes(spec)}
