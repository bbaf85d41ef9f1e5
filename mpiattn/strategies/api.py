"""Distributed attention: the public forward and backward, and the strategies behind them.

Every rank holds the rows of one global sequence given by a layout
(:mod:`mpiattn.layouts`): queries ``q`` of a length-``N`` sequence, keys and
values of a length-``M`` one. Shapes follow torch's
``scaled_dot_product_attention``: ``(batch, heads, sequence, feature)``.

Strategies (all exact; costs per rank, ``P`` ranks, ``n = N/P``, ``m = M/P``,
``E = Ev`` for brevity):

``ring``
    Queries stay; key/value blocks travel round the ring, the next one in
    flight while the current one is folded into an online softmax
    (:mod:`mpiattn.strategies.blocked`). FLOPs ``4 n M H E`` forward (``10 n M H E``
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

from typing import Any

from ..comm.core import get_comm
from .blocked import blocked_backward, blocked_forward
from .materialized import materialized_backward, materialized_forward
from .problem import Progress, validate
from .ulysses import ulysses_backward, ulysses_forward

__all__ = ["attention", "attention_backward"]

_FORWARD = {"ring": blocked_forward, "allgather": blocked_forward,
            "ulysses": ulysses_forward, "materialized": materialized_forward}


_BACKWARD = {"ring": blocked_backward, "allgather": blocked_backward,
             "ulysses": ulysses_backward, "materialized": materialized_backward}


def attention(q: Any, k: Any, v: Any, comm: Any = None, *, causal: bool = False,
              scale: float | None = None, key_padding_mask: Any = None,
              layout: Any = "contiguous", strategy: str = "auto", block_size: int | None = None,
              check_finite: bool = True, progress: Progress = None,
              engine: str = "auto", window: tuple | None = None, segment_ids: Any = None,
              kv_segment_ids: Any = None, kv_layout: Any = None,
              details: dict | None = None) -> tuple[Any, Any]:
    """Exact softmax attention over a sequence sharded across ranks.

    ``out[i] = sum_j softmax_j(scale * q_i . k_j) v_j`` over the keys ``j``
    visible to query ``i`` (all of them, minus padding, minus ``j > i`` when
    causal, minus those outside the window or in another document), for
    every batch entry and query head. Key tiles and ring blocks with no
    visible pair are skipped, so the work follows the visible pairs.

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
    layout : {"contiguous", "zigzag"} or Layout
        Row layout of ``q`` and of ``k``/``v`` (:mod:`mpiattn.layouts`); an
        explicit :class:`mpiattn.Layout` (e.g. from :func:`mpiattn.balance`)
        must be the same on every rank and cover ``N`` rows.
    strategy : {"auto", "ring", "allgather", "ulysses", "materialized"}
        See the module docstring for costs.
    window : (left, right), optional
        Sliding window: key ``j`` is visible to query ``i`` only if
        ``i - left <= j <= i + right`` (global positions); each bound an int
        >= 0 or None (unbounded on that side). Combines with ``causal``.
    segment_ids : integer ndarray, shape (B, n_r), optional
        This rank's rows of the global ``(B, N)`` document ids of the
        queries (NumPy, or the backend of ``q``; any integers): query ``i``
        sees key ``j`` only when their ids are equal. See
        :func:`mpiattn.segment_ids_from_cu_seqlens`.
    kv_segment_ids : integer ndarray, shape (B, m_r), optional
        The keys' document ids; needs ``segment_ids``. Omitted: the keys
        take the query ids (needs ``N == M`` and one layout).
    kv_layout : str or Layout, optional
        Row layout of ``k``/``v`` (default: ``layout``); for cross
        attention with an explicit :class:`mpiattn.Layout`.
    block_size : int, optional
        Rows per exchanged key/value block and edge of the native engine's
        score tile. Default: 512 for the native engine; for the torch engine
        blocks of up to 64 MiB (few kernel calls). Bounds the temporary memory.
    check_finite : bool
        Raise ValueError when an input holds NaN or Inf (default True).
    progress : callable(done, total), optional
        Called on every rank after each block step.
    engine : {"auto", "native", "torch"}
        The local kernel engine (:mod:`mpiattn.kernels.engines`): ``native``
        (mpiattn's own kernels, every case), ``torch`` (torch's fused
        kernels: NumPy float16/32/64 or CuPy float16/32, causal and padding
        masks), ``auto`` (torch on NumPy float32/float64 inputs when torch
        is already imported in the process and supports the case, else
        native). Every rank uses the same engine.
    details : dict, optional
        Filled with what was used: ``strategy``, ``engine``, ``engine_reason``,
        ``block_size`` (rows per exchanged key/value block).

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
    pb = validate(c, q, k, v, key_padding_mask, {}, causal=causal, scale=scale, layout=layout,
                  strategy=strategy, block_size=block_size, check_finite=check_finite,
                  engine=engine, window=window, segment_ids=segment_ids,
                  kv_segment_ids=kv_segment_ids, kv_layout=kv_layout)
    if details is not None:
        details.update(strategy=pb.strategy, engine=pb.engine, engine_reason=pb.engine_reason,
                       block_size=pb.block)
    with c.abort_on_error():
        o, lse = _FORWARD[pb.strategy](c, pb, q, k, v, key_padding_mask, progress)
    return o.astype(pb.dtype, copy=False), lse.astype(pb.acc_dtype, copy=False)


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm: Any = None, *,
                       causal: bool = False, scale: float | None = None,
                       key_padding_mask: Any = None, layout: Any = "contiguous",
                       strategy: str = "auto", block_size: int | None = None,
                       check_finite: bool = True, progress: Progress = None,
                       engine: str = "auto", window: tuple | None = None,
                       segment_ids: Any = None, kv_segment_ids: Any = None,
                       kv_layout: Any = None) -> tuple[Any, Any, Any]:
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
    comm, causal, scale, key_padding_mask, layout, strategy, block_size, check_finite, progress, engine,
    window, segment_ids, kv_segment_ids, kv_layout
        As in :func:`attention`; pass the same values as to the forward call
        (the engine may differ: the gradients only need ``out`` and ``lse``).

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
    pb = validate(c, q, k, v, key_padding_mask, {"dout": dout, "out": out, "lse": lse},
                  causal=causal, scale=scale, layout=layout, strategy=strategy,
                  block_size=block_size, check_finite=check_finite, engine=engine,
                  window=window, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                  kv_layout=kv_layout)
    D = (dout.astype(pb.acc_dtype) * out.astype(pb.acc_dtype)).sum(axis=-1)
    with c.abort_on_error():
        dq, dk, dv = _BACKWARD[pb.strategy](c, pb, dout, q, k, v, out, lse, D, key_padding_mask,
                                            progress)
    return (dq.astype(pb.dtype, copy=False), dk.astype(pb.dtype, copy=False),
            dv.astype(pb.dtype, copy=False))
