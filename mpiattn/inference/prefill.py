"""Chunked prefill: a new chunk of queries, sharded over the ranks, attends the cache and itself.

The chunk's ``C`` rows stand at positions ``M .. M + C - 1`` after the
cache's ``M`` (bottom-right causal: chunk query ``i`` sees keys
``j <= M + i``; a window is measured from ``M + i``). Every rank holds some
of the chunk's rows (``q``, ``k``, ``v``, by a layout of ``C`` rows) and
its own cache rows. Two exact ways to bring them together (Yang et al.
2024, "Context Parallelism for Scalable Million-Token Inference", Meta):

``pass-kv``
    Keys and values travel: each rank's cache rows plus its chunk rows go
    round the ring (:func:`mpiattn.attention` with ``strategy="ring"`` and
    ``causal="bottom-right"``) past queries that stay. Words sent per rank
    ``(P - 1) (M + C) / P x B Hkv (E + Ev)``, overlapped with compute where
    the transport allows; one extra copy of the rank's cache rows (the ring
    sends one contiguous array).
``pass-q``
    Queries and partial results travel: the chunk's queries are gathered
    on every rank (``(P - 1) C / P x B H E`` words sent per rank), each rank
    attends all of them with its own keys, and the partials ``(o, lse)`` go
    back to the queries' owners in one all-to-all (``(P - 1) C / P x B H
    (Ev + 1)`` words), merged there in rank order (:func:`mpiattn.inference.merge.merge`).
    Nothing overlaps; no copy of the cache.

:func:`choose` takes the one with the shorter forward the cost model
predicts on a :class:`~mpiattn.strategies.machines.Machine` (its links, its
compute rate and how much of a ring's transfer hides behind compute), the two
priced through the model's one entry point as the attention strategies are
(:mod:`mpiattn.inference.pricing`), the visible pairs counted under the
window and any ``attn_mask`` or ``mask_mod``: pass-Q when the chunk is short
next to the cache, as in the paper's rule (pass-KV once ``C / (C + M)``
exceeds about ``2 Hkv / H``, or its transfer hides behind the compute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import Comm
from ..kernels import engines
from ..kernels.engine import Engine
from ..layouts import Layout
from ..masks.score import Checked, Score
from ..masks.sinks import add_sinks
from ..strategies.api import attention
from ..strategies import machines, model
from ..strategies.machines import Machine
from ..strategies.ring import Ring
from ..strategies.spec import AttentionSpec, Options
from .decode import step_spec
from .local import partial_attention, step_attend
from .merge import merge
from .placement import PAGE_ROWS
from .pricing import PassKV, PassQ
from .shard import Shard

__all__ = ["VARIANTS", "Choice", "choose", "chunk_checks", "pass_kv", "pass_q", "runs_of"]

#: Accepted values of ``variant=``.
VARIANTS = ("auto", "pass-kv", "pass-q")


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided and why (seconds and bytes per rank, predicted)."""

    variant: str
    pass_kv_s: float
    pass_q_s: float
    pass_kv_bytes: float
    pass_q_bytes: float

    @property
    def reason(self) -> str:
        return (f"predicted pass-kv {self.pass_kv_s * 1e3:.3g} ms ({self.pass_kv_bytes / 2**20:.3g} MiB "
                f"sent), pass-q {self.pass_q_s * 1e3:.3g} ms ({self.pass_q_bytes / 2**20:.3g} MiB)")


def choose(spec: AttentionSpec, topology: Any, machine: Machine, pairs: Any = None,
           rate_dtype: str | None = None, page: int = PAGE_ROWS, block: int | None = None) -> Choice:
    """pass-KV or pass-Q for the chunk's call ``spec`` (:func:`~mpiattn.inference.pricing.chunk_spec`)
    on ``topology``'s ranks: the one with the shorter forward the cost model predicts
    (:func:`mpiattn.strategies.model.predict` of :class:`~mpiattn.inference.pricing.PassKV` and
    :class:`~mpiattn.inference.pricing.PassQ`; module docstring for the words).

    ``pairs``: the visible keys of the chunk's rows when an ``attn_mask`` or ``mask_mod`` hides
    some (counted; default the causal and window rules'); ``page``: the cache's rows per page;
    ``block``: the ring's key block (default one piece per step). One rank: pass-Q (nothing
    travels, nothing is copied).
    """
    if topology.P == 1:
        return Choice("pass-q", 0.0, 0.0, 0.0, 0.0)
    block = block or -(-spec.M // topology.P)
    kv, q = (model.predict(s, spec, topology, block, machine, pairs, rate_dtype)
             for s in (PassKV(), PassQ(page)))
    return Choice("pass-q" if q.forward_s < kv.forward_s else "pass-kv", kv.forward_s,
                  q.forward_s, kv.inside + kv.between, q.inside + q.between)


def runs_of(pos: np.ndarray) -> list[tuple[int, int]]:
    """``pos`` (in local order) as half-open ranges of consecutive positions, in that order."""
    if pos.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [pos.size]))
    return [(int(pos[a]), int(pos[b - 1]) + 1) for a, b in zip(starts, stops)]


def pass_kv(c: Comm, shard: Shard, length: int, q: Any, k: Any, v: Any, chunk_pos: np.ndarray,
            layout: Any, options: dict, score: Score | None = None) -> tuple[Any, Any]:
    """pass-KV (module docstring): ``(out (B, H, c_r, Ev), lse (B, H, c_r))`` for this rank's queries.

    ``chunk_pos`` are this rank's chunk rows (``0 .. C - 1``, local order by
    ``layout``); ``options`` the :class:`mpiattn.Options` fields to pass on
    (``window``, ``scale``, ``engine``, ``check_finite``, ``causal``); ``score``:
    the score modifiers as given (the bottom-right diagonal ``length`` makes ALiBi's distance
    that of absolute positions; an ``attn_mask`` holds this rank's query rows, its key axis the
    absolute positions, the keys' global order here; functions given absolute query positions
    take them shifted, :meth:`~mpiattn.masks.score.Score.shifted`).
    """
    xp = shard.xp
    kc, vc, pc = shard.whole()
    keys = xp.concatenate([kc, k], axis=2) if pc.size else k
    values = xp.concatenate([vc, v], axis=2) if pc.size else v
    pos = np.concatenate([pc, length + chunk_pos])
    kv_layout = Layout(c.allgather_obj(runs_of(pos)))
    causal = "bottom-right" if options.get("causal", True) else False
    return attention(q, keys, values, c, layout=layout, kv_layout=kv_layout, strategy=Ring.name,
                     score=score, **{**options, "causal": causal})


def pass_q(c: Comm, shard: Shard, length: int, q: Any, k: Any, v: Any, chunk_pos: np.ndarray,
           counts: list, engine: Engine, spec: AttentionSpec, finite: bool = True,
           score: Checked | None = None) -> tuple[Any, Any]:
    """pass-Q (module docstring): ``(out (B, H, c_r, Ev), lse (B, H, c_r))`` for this rank's queries.

    ``counts[r]`` is rank ``r``'s number of chunk rows; ``spec`` the call of
    the chunk against the cache (its rules, scale and value dim); ``score``: the checked score
    modifiers (an ``attn_mask`` of this rank's query rows over absolute key positions,
    gathered with the queries).
    """
    xp = backend.array_module(q)
    B, H, n, E = q.shape
    Ev = shard.Ev
    acc = backend.accum_dtype(q.dtype)
    P = c.size
    rows = xp.ascontiguousarray(xp.moveaxis(q, 2, 0))  # (c_r, B, H, E)
    every = c.allgatherv_rows(rows, counts) if P > 1 else rows
    Q = xp.ascontiguousarray(xp.moveaxis(every, 0, 2))  # (B, H, C, E), rank order
    all_pos = c.allgather_obj(chunk_pos) if P > 1 else [chunk_pos]
    q_pos = length + np.concatenate(all_pos).astype(np.int64)
    blocks = list(shard.views()) + ([(k, v, length + chunk_pos)] if n else [])
    score = score if score is not None else Score().checked(B, H, n)
    if score.attn_mask is not None and P > 1:  # every rank's rows, in rank order as the queries
        m = np.ascontiguousarray(np.moveaxis(score.attn_mask, 2, 0))
        score = score.with_mask(np.moveaxis(c.allgatherv_rows(m, counts), 0, 2))
    o, lse, _ = partial_attention(step_attend(engine, spec, q_pos, finite, score.modifiers()), Q,
                                  blocks)
    C = q_pos.size
    buf = xp.empty((C, B, H, Ev + 1), dtype=acc)
    buf[..., 0] = xp.moveaxis(lse, 2, 0)
    buf[..., 1:] = xp.moveaxis(o, 2, 0)
    got = c.alltoallv_rows(buf, counts, [n] * P) if P > 1 else buf
    parts = got.reshape(P, n, B, H, Ev + 1)
    out_o, out_l = parts[0, ..., 1:], parts[0, ..., 0]
    for s in range(1, P):  # in rank order: the same association on every run
        out_o, out_l = merge(out_o, out_l, parts[s, ..., 1:], parts[s, ..., 0])
    out = xp.ascontiguousarray(xp.moveaxis(out_o, 0, 2))
    out_l = xp.ascontiguousarray(xp.moveaxis(out_l, 0, 2))
    if score.sinks is not None:  # the merged rows, at their owner
        out, out_l = add_sinks(out, out_l, score.sinks)
    return out.astype(q.dtype, copy=False), out_l


def chunk_checks(s: Shard, length: int, q: Any, k: Any, v: Any, options: dict, layout: Any,
                 variant: str, machine: str | None, score: Score, kept: dict) -> dict:
    """This rank's checks of a chunk of :meth:`mpiattn.inference.KVCache.prefill` (local; inside
    its agreement: errors are agreed), against the cache's rows ``s`` of ``length`` positions.

    ``score`` holds the call's score modifiers (an ``attn_mask`` of this rank's chunk rows);
    the checked form is put in ``kept["score"]``
    (:class:`~mpiattn.masks.score.Checked`). Returns the fields the ranks agree on (names
    starting with ``_`` are not compared).
    """
    o = Options.of(None, **options, layout=layout)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    xp = backend.array_module(q, k, v)
    if xp is not s.xp:
        raise TypeError(f"prefill: the chunk is {xp.__name__}, the cache {s.xp.__name__}")
    for name, x, heads, F in (("q", q, None, s.E), ("k", k, s.Hkv, s.E), ("v", v, s.Hkv, s.Ev)):
        if x.dtype != s.dtype:
            raise TypeError(f"prefill: {name} has dtype {x.dtype}, the cache holds {s.dtype}")
        if x.ndim != 4 or x.shape[0] != s.B or x.shape[3] != F or \
                (heads is not None and x.shape[1] != heads):
            raise ValueError(f"prefill: {name} has shape {x.shape}; the cache needs (B, "
                             f"{'H' if heads is None else heads}, c_r, {F}) with B = {s.B}")
    if q.shape[1] % s.Hkv or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"prefill: q {q.shape}, k {k.shape}, v {v.shape}: heads must be a "
                         f"multiple of {s.Hkv} and the rows the same")
    name = machines.resolve_name(machine, xp.__name__) if variant == "auto" else None
    H = int(q.shape[1])
    checked = kept["score"] = score.checked(s.B, H, int(q.shape[2]))
    spec = step_spec(s, length + q.shape[2], q, Options.of(o, causal=True), **checked.flags())
    return {"q's heads": H, **o.by_field(), "variant": variant,
            "machine": name, "_n": int(q.shape[2]), "_spec": spec, **checked.agreement(),
            "_keys": checked.mask_keys, "_hides": checked.hides,
            "_engine": engines.local_choice(options.get("engine", "auto"), spec)}
