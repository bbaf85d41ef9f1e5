"""Distributed attention: the public forward/backward and the strategies that run them.

Every rank holds the rows of one global sequence given by a layout
(:mod:`mpiattn.layouts`): queries ``q`` of a length-``N`` sequence, keys and
values of a length-``M`` one. Shapes follow torch's
``scaled_dot_product_attention``: ``(batch, heads, sequence, feature)``.

Strategies (all exact; costs per rank, ``P`` ranks, ``n = N/P``, ``m = M/P``,
``E = Ev`` for brevity):

``ring``
    Queries stay; key/value blocks travel round the ring, the next one in
    flight while the current one is folded into an online softmax
    (:mod:`mpiattn.kernels`). FLOPs ``4 n M H E`` forward (``10 n M H E``
    backward); words sent ``(P-1) m Hkv (E+Ev)`` (backward: again that plus
    the travelling ``dK, dV``); extra memory ``O(block^2 + block Hkv (E+Ev))``
    per batch entry. Causal attention skips key blocks no query can see; with
    the zigzag layout every rank then does about half the non-causal work.
``allgather``
    Keys/values are gathered in rounds of ``block`` rows per rank (bounded
    memory ``P block Hkv (E+Ev)``), each round attended locally; ``dK, dV`` are
    summed to their owners by a reduce-scatter per round. Words received
    ``(P-1) m Hkv (E+Ev)``; no overlap.
``ulysses``
    All-to-all from sequence-sharded to head-sharded, exact local blocked
    attention over the whole sequence for ``H/P`` heads, all-to-all back
    (Jacobs et al. 2023). Four all-to-alls of ``n H E``-sized words forward;
    needs ``H`` and ``Hkv`` divisible by ``P``.
``materialized``
    The thesis' formulation through the distributed products:
    ``S = s nt(Q, K)``, ``P = softmax(S)``, ``O = nn(P, V)``, backward through
    their closure. Memory ``n M`` scores per head: a reproduction and a
    cross-check, never chosen by ``auto``.
``auto``
    ``ring`` on one rank; ``ulysses`` when the head counts divide by ``P`` and
    its all-to-all words ``(P-1)/P (n H (E+Ev) + m Hkv (E+Ev))`` are fewer than
    the ring's ``(P-1) m Hkv (E+Ev)``; ``allgather`` when every rank's keys fit
    in one block (one collective instead of ``P-1`` exchanges); otherwise
    ``ring``. The choice uses global sizes only, so all ranks agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import backend, kernels
from .comm import Comm, _row_segments_to_pieces, get_comm
from .layouts import all_segments, check_layout, check_shares, local_lengths, positions, to_global_order

__all__ = ["attention", "attention_backward", "STRATEGIES", "DEFAULT_BLOCK"]

STRATEGIES = ("auto", "ring", "allgather", "ulysses", "materialized")

#: Default rows per exchanged key/value block (and score-tile edge).
DEFAULT_BLOCK = kernels.DEFAULT_TILE

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class _Problem:
    """A validated call, identical on every rank except ``rank``."""

    B: int
    H: int
    Hkv: int
    E: int
    Ev: int
    N: int
    M: int
    dtype: np.dtype
    acc: np.dtype
    scale: float
    causal: bool
    layout: str
    strategy: str
    block: int
    masked: bool
    P: int
    rank: int

    @property
    def G(self) -> int:
        return self.H // self.Hkv

    def q_pos(self) -> np.ndarray:
        return positions(all_segments(self.N, self.P, self.layout)[self.rank])


# --------------------------------------------------------------- validation
def _local_meta(q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any], *, causal: bool,
                scale: float | None, layout: str, strategy: str, block_size: int | None,
                check_finite: bool) -> tuple:
    xp = backend.array_module(q, k, v, *extra.values())
    if mask is not None and backend.array_module(mask) is not xp:
        raise TypeError("key_padding_mask is not on the same backend (NumPy/CuPy) as q, k, v")
    check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
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
    return ((B, H, Hkv, E, Ev), str(q.dtype), n, m, bool(causal),
            None if scale is None else float(scale), layout, strategy, block_size,
            mask is not None, xp.__name__)


def _validate(c: Comm, q: Any, k: Any, v: Any, mask: Any, extra: dict[str, Any], **kw: Any) -> _Problem:
    metas = c.allgather_checked(lambda: _local_meta(q, k, v, mask, extra, **kw))
    head = metas[0]
    names = ("shapes (B, H, Hkv, E, Ev)", "dtype", None, None, "causal", "scale", "layout",
             "strategy", "block_size", "key_padding_mask presence", "backend")
    for r, meta in enumerate(metas):
        for i, name in enumerate(names):
            if name is not None and meta[i] != head[i]:
                raise ValueError(f"ranks disagree on {name}: rank 0 has {head[i]!r}, rank {r} has {meta[i]!r}")
    (B, H, Hkv, E, Ev), dtype, _, _, causal, scale, layout, strategy, block, masked, _ = head
    N = sum(meta[2] for meta in metas)
    M = sum(meta[3] for meta in metas)
    for what, col in (("query rows (q)", 2), ("key/value rows (k, v)", 3)):
        check_shares([meta[col] for meta in metas], layout, what)
    dt = np.dtype(dtype)
    prob = _Problem(B, H, Hkv, E, Ev, N, M, dt, backend.accum_dtype(dt),
                    1.0 / math.sqrt(E) if scale is None else scale, causal, layout, strategy,
                    int(block or DEFAULT_BLOCK), masked, c.size, c.rank)
    return _resolve(prob)


def _resolve(pb: _Problem) -> _Problem:
    from dataclasses import replace

    if pb.strategy == "ulysses" and (pb.H % pb.P or pb.Hkv % pb.P):
        raise ValueError(f"strategy 'ulysses' needs H ({pb.H}) and Hkv ({pb.Hkv}) divisible by "
                         f"the number of ranks ({pb.P}); use 'ring' or 'allgather'")
    if pb.strategy != "auto":
        return pb
    return replace(pb, strategy=choose_strategy(pb.N, pb.M, pb.H, pb.Hkv, pb.E, pb.Ev, pb.P, pb.block))


def choose_strategy(N: int, M: int, H: int, Hkv: int, E: int, Ev: int, P: int, block: int) -> str:
    """The cost model behind ``strategy="auto"`` (see the module docstring)."""
    if P == 1:
        return "ring"
    n, m = N / P, M / P
    ring_words = (P - 1) * m * Hkv * (E + Ev)
    ulysses_words = (P - 1) / P * (n * H * (E + Ev) + m * Hkv * (E + Ev))
    if H % P == 0 and Hkv % P == 0 and ulysses_words < ring_words:
        return "ulysses"
    if math.ceil(m) <= block:
        return "allgather"
    return "ring"


# ----------------------------------------------------------------- helpers
def _report(progress: Progress, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


@dataclass
class _KeyBlock:
    """Keys/values of global positions ``k_idx`` (row axis -2), their padding bias, gradient sinks."""

    k: Any
    v: Any
    k_idx: np.ndarray
    bias: Any
    dk: Any = None
    dv: Any = None


def _kv_data(pb: _Problem, k: Any, v: Any, mask: Any) -> list[Any]:
    return [k, v] + ([mask[:, :, None]] if pb.masked else [])


def _block(pb: _Problem, data: Sequence[Any], k_idx: np.ndarray, acc: Sequence[Any] = ()) -> _KeyBlock:
    bias = kernels.padding_bias(data[2][..., 0], pb.acc) if pb.masked else None
    return _KeyBlock(data[0], data[1], k_idx, bias, *acc)


# The two block sources below hand every key/value block to the same blocked
# forward/backward loops; with ``grads`` they also collect dK, dV for the owners.

def _ring_blocks(c: Comm, pb: _Problem, k: Any, v: Any, mask: Any,
                 grads: Sequence[Any] = ()) -> tuple[int, Iterator[_KeyBlock]]:
    """Ring: blocks arrive from the neighbour; dK, dV travel with them and come home."""
    total = sum(len(_row_segments_to_pieces(s, pb.block)) for s in all_segments(pb.M, pb.P, pb.layout))
    pieces = c.circulate(_kv_data(pb, k, v, mask), pb.M, pb.layout, pb.block, acc_out=grads)
    return total, (_block(pb, p.data, np.arange(p.start, p.stop), p.acc) for p in pieces)


def _gather_blocks(c: Comm, pb: _Problem, k: Any, v: Any, mask: Any,
                   grads: Sequence[Any] = ()) -> tuple[int, Iterator[_KeyBlock]]:
    """All-gather: round ``t`` gathers rows ``[t*block, (t+1)*block)`` of every rank's shard;
    its dK, dV are summed to their owners by a reduce-scatter."""
    xp = backend.array_module(k)
    pos = [positions(s) for s in all_segments(pb.M, pb.P, pb.layout)]
    rounds = max((math.ceil(p.size / pb.block) for p in pos), default=0)

    def blocks() -> Iterator[_KeyBlock]:
        for t in range(rounds):
            lo = t * pb.block
            counts = [max(0, min(pb.block, p.size - lo)) for p in pos]
            got = [xp.moveaxis(c.allgatherv_rows(_rows_first(x[..., lo:lo + counts[c.rank], :]), counts), 0, -2)
                   for x in _kv_data(pb, k, v, mask)]
            k_idx = np.concatenate([p[lo:lo + n] for p, n in zip(pos, counts)])
            sinks = [xp.zeros(x.shape, dtype=pb.acc) for x in got[:2]] if grads else []
            yield _block(pb, got, k_idx, sinks)
            for g, part in zip(grads, sinks):
                g[..., lo:lo + counts[c.rank], :] += xp.moveaxis(c.reduce_scatterv_rows(_rows_first(part), counts), 0, -2)

    return rounds, blocks()


def _rows_first(x: Any) -> Any:
    xp = backend.array_module(x)
    return xp.ascontiguousarray(xp.moveaxis(x, -2, 0))


_BLOCKS = {"ring": _ring_blocks, "allgather": _gather_blocks}


def _blocked_forward(c: Comm, pb: _Problem, q: Any, k: Any, v: Any, mask: Any,
                     progress: Progress) -> tuple[Any, Any]:
    st = kernels.ForwardState.start(q, pb.Hkv, pb.scale, pb.acc, pb.Ev)
    q_pos = pb.q_pos()
    total, blocks = _BLOCKS[pb.strategy](c, pb, k, v, mask)
    for i, b in enumerate(blocks):
        kernels.forward_block(st, q_pos, pb.G, b.k, b.v, b.k_idx, b.bias, pb.causal, pb.block)
        _report(progress, i + 1, total)
    o, lse = kernels.finalize(st)
    return kernels.unfold_rows(o, pb.H), kernels.unfold_rows(lse[..., None], pb.H)[..., 0]


def _blocked_backward(c: Comm, pb: _Problem, dout: Any, q: Any, k: Any, v: Any, lse: Any, D: Any,
                      mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    xp = backend.array_module(q)
    bi = kernels.BackwardInputs.start(q, dout, lse, D, pb.Hkv, pb.scale, pb.acc)
    q_pos = pb.q_pos()
    dq = xp.zeros(bi.qa.shape[:-1] + (pb.E,), dtype=pb.acc)
    dk = xp.zeros(k.shape, dtype=pb.acc)
    dv = xp.zeros(v.shape, dtype=pb.acc)
    total, blocks = _BLOCKS[pb.strategy](c, pb, k, v, mask, grads=[dk, dv])
    for i, b in enumerate(blocks):
        kernels.backward_block(bi, q_pos, pb.G, b.k, b.v, b.k_idx, dq, b.dk, b.dv, b.bias, pb.causal, pb.block)
        _report(progress, i + 1, total)
    dq *= pb.scale
    return kernels.unfold_rows(dq, pb.H), dk, dv


# ----------------------------------------------------------------- ulysses
def _seq_to_heads(c: Comm, x: Any, n_total: int, layout: str) -> Any:
    """``(B, Hx, n_r, F)`` sequence-sharded -> ``(B, Hx/P, n_total, F)`` head-sharded, global order."""
    xp = backend.array_module(x)
    P = c.size
    B, Hx, n, F = x.shape
    hp = Hx // P
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    send = xp.ascontiguousarray(x.reshape(B, P, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(-1, F)
    got = c.alltoallv_rows(send, [B * hp * n] * P, [B * hp * ln for ln in lengths])
    out = xp.empty((B, hp, n_total, F), dtype=x.dtype)
    pos = 0
    for s in range(P):
        block = got[pos:pos + B * hp * lengths[s]].reshape(B, hp, lengths[s], F)
        pos += B * hp * lengths[s]
        local = 0
        for g, ln in segs[s]:
            out[:, :, g:g + ln] = block[:, :, local:local + ln]
            local += ln
    return out


def _heads_to_seq(c: Comm, y: Any, n_total: int, layout: str) -> Any:
    """Inverse of :func:`_seq_to_heads`: ``(B, Hx/P, N, F)`` -> ``(B, Hx, n_r, F)``."""
    xp = backend.array_module(y)
    P = c.size
    B, hp, _, F = y.shape
    segs = all_segments(n_total, P, layout)
    lengths = local_lengths(n_total, P, layout)
    parts = []
    for d in range(P):
        rows = [y[:, :, g:g + ln] for g, ln in segs[d]]
        blk = xp.concatenate(rows, axis=2) if rows else xp.empty((B, hp, 0, F), dtype=y.dtype)
        parts.append(xp.ascontiguousarray(blk).reshape(-1, F))
    send = xp.concatenate(parts, axis=0) if parts else xp.empty((0, F), dtype=y.dtype)
    n = lengths[c.rank]
    got = c.alltoallv_rows(send, [B * hp * ln for ln in lengths], [B * hp * n] * P)
    return xp.ascontiguousarray(got.reshape(P, B, hp, n, F).transpose(1, 0, 2, 3, 4)).reshape(B, P * hp, n, F)


def _full_mask(c: Comm, pb: _Problem, mask: Any) -> Any:
    """Every rank's ``(B, m_r)`` padding mask -> the global ``(B, M)`` mask on every rank."""
    xp = backend.array_module(mask)
    rows = c.allgatherv_rows(xp.ascontiguousarray(mask.T), local_lengths(pb.M, pb.P, pb.layout))
    return xp.ascontiguousarray(to_global_order(rows, pb.M, pb.P, pb.layout).T)


def _ulysses_local(pb: _Problem) -> _Problem:
    from dataclasses import replace

    return replace(pb, H=pb.H // pb.P, Hkv=pb.Hkv // pb.P)


def _ulysses_forward(c: Comm, pb: _Problem, q: Any, k: Any, v: Any, mask: Any,
                     progress: Progress) -> tuple[Any, Any]:
    qh = _seq_to_heads(c, q, pb.N, pb.layout)
    kh = _seq_to_heads(c, k, pb.M, pb.layout)
    vh = _seq_to_heads(c, v, pb.M, pb.layout)
    bias = kernels.padding_bias(_full_mask(c, pb, mask), pb.acc) if pb.masked else None
    lp = _ulysses_local(pb)
    st = kernels.ForwardState.start(qh, lp.Hkv, pb.scale, pb.acc, pb.Ev)
    kernels.forward_block(st, np.arange(pb.N), lp.G, kh, vh, np.arange(pb.M), bias, pb.causal, pb.block)
    _report(progress, 1, 1)
    o, lse = kernels.finalize(st)
    o = kernels.unfold_rows(o.astype(pb.dtype, copy=False), lp.H)
    lse = kernels.unfold_rows(lse[..., None], lp.H)
    return _heads_to_seq(c, o, pb.N, pb.layout), _heads_to_seq(c, lse, pb.N, pb.layout)[..., 0]


def _ulysses_backward(c: Comm, pb: _Problem, dout: Any, q: Any, k: Any, v: Any, lse: Any, D: Any,
                      mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    xp = backend.array_module(q)
    qh = _seq_to_heads(c, q, pb.N, pb.layout)
    kh = _seq_to_heads(c, k, pb.M, pb.layout)
    vh = _seq_to_heads(c, v, pb.M, pb.layout)
    doh = _seq_to_heads(c, dout, pb.N, pb.layout)
    stats = _seq_to_heads(c, xp.stack([lse.astype(pb.acc), D], axis=-1), pb.N, pb.layout)
    bias = kernels.padding_bias(_full_mask(c, pb, mask), pb.acc) if pb.masked else None
    lp = _ulysses_local(pb)
    bi = kernels.BackwardInputs.start(qh, doh, stats[..., 0], stats[..., 1], lp.Hkv, pb.scale, pb.acc)
    dq = xp.zeros(bi.qa.shape[:-1] + (pb.E,), dtype=pb.acc)
    dk = xp.zeros(kh.shape, dtype=pb.acc)
    dv = xp.zeros(vh.shape, dtype=pb.acc)
    kernels.backward_block(bi, np.arange(pb.N), lp.G, kh, vh, np.arange(pb.M),
                           dq, dk, dv, bias, pb.causal, pb.block)
    _report(progress, 1, 1)
    dq *= pb.scale
    dq = kernels.unfold_rows(dq, lp.H)
    return (_heads_to_seq(c, dq, pb.N, pb.layout), _heads_to_seq(c, dk, pb.M, pb.layout),
            _heads_to_seq(c, dv, pb.M, pb.layout))


# ------------------------------------------------------------ materialized
def _scores(c: Comm, pb: _Problem, q: Any, k: Any, mask: Any) -> Any:
    """``S = s Q K^T`` with masks, shape ``(B, Hkv, G, n_r, M)`` (accumulation dtype)."""
    from .products import matmul_nt

    xp = backend.array_module(q)
    B, _, n, E = q.shape
    q5 = q.astype(pb.acc).reshape(B, pb.Hkv, pb.G, n, E) * pb.scale
    S = matmul_nt(q5, k.astype(pb.acc)[:, :, None], c.mpi, layout=pb.layout, block_size=pb.block)
    if pb.causal:
        hidden = np.arange(pb.M)[None, :] > pb.q_pos()[:, None]
        S[..., backend.to_device(hidden, xp)] = -np.inf
    if pb.masked:
        full = _full_mask(c, pb, mask)
        S += kernels.padding_bias(full, pb.acc)[:, :, :, None, :]
    return S


def _materialized_forward(c: Comm, pb: _Problem, q: Any, k: Any, v: Any, mask: Any,
                          progress: Progress) -> tuple[Any, Any]:
    from .products import matmul_nn

    xp = backend.array_module(q)
    S = _scores(c, pb, q, k, mask)
    m = S.max(axis=-1) if S.shape[-1] else xp.full(S.shape[:-1], -np.inf, dtype=pb.acc)
    shift = xp.where(xp.isneginf(m), pb.acc.type(0), m)
    Pm = xp.exp(S - shift[..., None])
    l = Pm.sum(axis=-1)
    seen = l > 0
    Pm /= xp.where(seen, l, pb.acc.type(1))[..., None]
    o = matmul_nn(Pm, v.astype(pb.acc)[:, :, None], c.mpi, layout=pb.layout, block_size=pb.block)
    lse = xp.where(seen, shift + xp.log(xp.where(seen, l, pb.acc.type(1))), pb.acc.type(-np.inf))
    _report(progress, 1, 1)
    B, _, n, _ = q.shape
    return o.reshape(B, pb.H, n, pb.Ev), lse.reshape(B, pb.H, n)


def _materialized_backward(c: Comm, pb: _Problem, dout: Any, q: Any, k: Any, v: Any, lse: Any,
                           D: Any, mask: Any, progress: Progress) -> tuple[Any, Any, Any]:
    from .products import matmul_nn, matmul_nt, matmul_tn

    xp = backend.array_module(q)
    B, _, n, E = q.shape
    kw = dict(layout=pb.layout, block_size=pb.block)
    S = _scores(c, pb, q, k, mask)
    lse5 = lse.astype(pb.acc).reshape(B, pb.Hkv, pb.G, n)
    lse5 = xp.where(xp.isneginf(lse5), pb.acc.type(np.inf), lse5)
    Pm = xp.exp(S - lse5[..., None])
    do5 = dout.astype(pb.acc).reshape(B, pb.Hkv, pb.G, n, pb.Ev)
    v5 = v.astype(pb.acc)[:, :, None]
    k5 = k.astype(pb.acc)[:, :, None]
    q5 = q.astype(pb.acc).reshape(B, pb.Hkv, pb.G, n, E)
    dv = matmul_tn(Pm, do5, c.mpi, **kw).sum(axis=2)
    dP = matmul_nt(do5, v5, c.mpi, **kw)
    dS = Pm * (dP - (dP * Pm).sum(axis=-1, keepdims=True))  # rowsum(dP * P) = D
    dq = pb.scale * matmul_nn(dS, k5, c.mpi, **kw)
    dk = pb.scale * matmul_tn(dS, q5, c.mpi, **kw).sum(axis=2)
    _report(progress, 1, 1)
    return dq.reshape(B, pb.H, n, E), dk, dv


# ------------------------------------------------------------------ public
_FORWARD = {"ring": _blocked_forward, "allgather": _blocked_forward,
            "ulysses": _ulysses_forward, "materialized": _materialized_forward}


_BACKWARD = {"ring": _blocked_backward, "allgather": _blocked_backward,
             "ulysses": _ulysses_backward, "materialized": _materialized_backward}


def attention(q: Any, k: Any, v: Any, comm: Any = None, *, causal: bool = False,
              scale: float | None = None, key_padding_mask: Any = None,
              layout: str = "contiguous", strategy: str = "auto", block_size: int | None = None,
              check_finite: bool = True, progress: Progress = None) -> tuple[Any, Any]:
    """Exact softmax attention over a sequence sharded across ranks.

    ``out[i] = sum_j softmax_j(scale * q_i . k_j) v_j`` over the keys ``j``
    visible to query ``i`` (all of them, minus padding, minus ``j > i`` when
    causal), for every batch entry and query head.

    Parameters
    ----------
    q : ndarray, shape (B, H, n_r, E)
        This rank's query rows of a global length ``N`` (rows follow ``layout``).
    k : ndarray, shape (B, Hkv, m_r, E)
        This rank's key rows of a global length ``M`` (``N != M`` allowed).
    v : ndarray, shape (B, Hkv, m_r, Ev)
        This rank's value rows.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    causal : bool
        Key ``j`` is visible to query ``i`` iff ``j <= i`` (global indices,
        top-left aligned as torch's ``is_causal``).
    scale : float, optional
        Softmax scale, default ``1/sqrt(E)``.
    key_padding_mask : bool ndarray, shape (B, m_r), optional
        This rank's part of a global ``(B, M)`` mask; True marks padding.
    layout : {"contiguous", "zigzag"}
        Row layout of ``q`` and of ``k``/``v`` (:mod:`mpiattn.layouts`).
    strategy : {"auto", "ring", "allgather", "ulysses", "materialized"}
        See the module docstring for costs.
    block_size : int, optional
        Rows per exchanged key/value block and edge of the score tile
        (default 512). Bounds the temporary memory.
    check_finite : bool
        Raise ValueError when an input holds NaN or Inf (default True).
    progress : callable(done, total), optional
        Called on every rank after each block step.

    Returns
    -------
    out : ndarray, shape (B, H, n_r, Ev), q's dtype
    lse : ndarray, shape (B, H, n_r)
        Natural log of the scaled softmax denominator, float32 (float64 for
        float64 inputs). A query that sees no key gets ``out = 0`` and
        ``lse = -inf``.

    Raises
    ------
    ValueError, TypeError
        On every rank, for inconsistent shapes, dtypes, layouts or
        strategies, lengths that do not match the layout, or non-finite input.

    Notes
    -----
    GQA/MQA: ``H`` must be a multiple of ``Hkv``; query head ``h`` uses
    key/value head ``h // (H // Hkv)``. float16 and float32 accumulate in
    float32. NumPy and CuPy inputs run the same code.
    """
    c = get_comm(comm)
    pb = _validate(c, q, k, v, key_padding_mask, {}, causal=causal, scale=scale, layout=layout,
                   strategy=strategy, block_size=block_size, check_finite=check_finite)
    with c.abort_on_error():
        o, lse = _FORWARD[pb.strategy](c, pb, q, k, v, key_padding_mask, progress)
    return o.astype(pb.dtype, copy=False), lse.astype(pb.acc, copy=False)


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm: Any = None, *,
                       causal: bool = False, scale: float | None = None,
                       key_padding_mask: Any = None, layout: str = "contiguous",
                       strategy: str = "auto", block_size: int | None = None,
                       check_finite: bool = True, progress: Progress = None) -> tuple[Any, Any, Any]:
    """Gradients of :func:`attention` with respect to ``q``, ``k`` and ``v``.

    Recomputes the probabilities from ``lse`` (FlashAttention-2 style) with
    ``D = rowsum(dout * out)``; see :mod:`mpiattn.kernels` for the formulas.

    Parameters
    ----------
    dout : ndarray, shape (B, H, n_r, Ev)
        Gradient of the loss with respect to ``out``.
    q, k, v, out, lse
        The forward inputs and outputs (``out`` and ``lse`` as returned by
        :func:`attention` with the same keywords).
    comm, causal, scale, key_padding_mask, layout, strategy, block_size, check_finite, progress
        As in :func:`attention`; pass the same values as to the forward call.

    Returns
    -------
    dq : ndarray, shape (B, H, n_r, E)
    dk : ndarray, shape (B, Hkv, m_r, E)
    dv : ndarray, shape (B, Hkv, m_r, Ev)
        In the dtypes of ``q``, ``k``, ``v``. Queries that saw no key get
        zero gradients.

    Raises
    ------
    ValueError, TypeError
        As :func:`attention`, and when ``dout``, ``out`` or ``lse`` do not
        match ``q`` and ``v``.
    """
    c = get_comm(comm)
    pb = _validate(c, q, k, v, key_padding_mask, {"dout": dout, "out": out, "lse": lse},
                   causal=causal, scale=scale, layout=layout, strategy=strategy,
                   block_size=block_size, check_finite=check_finite)
    D = (dout.astype(pb.acc) * out.astype(pb.acc)).sum(axis=-1)
    with c.abort_on_error():
        dq, dk, dv = _BACKWARD[pb.strategy](c, pb, dout, q, k, v, lse, D, key_padding_mask, progress)
    return (dq.astype(pb.dtype, copy=False), dk.astype(pb.dtype, copy=False),
            dv.astype(pb.dtype, copy=False))
