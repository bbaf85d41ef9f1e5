"""Distributed attention: the public forward and backward.

Every rank holds the rows of one global sequence given by a layout
(:mod:`mpiattn.layouts`): queries ``q`` of a length-``N`` sequence, keys and
values of a length-``M`` one. Shapes follow torch's
``scaled_dot_product_attention``: ``(batch, heads, sequence, feature)``.

A call is validated and agreed by every rank (:mod:`mpiattn.strategies.problem`)
and planned (:mod:`mpiattn.strategies.plan`: :func:`plan_attention` makes the
plan once for a loop; these are the one-shot forms), then runs its strategy (:mod:`mpiattn.strategies.registry`: ``ring``,
``allgather``, ``ulysses``, ``materialized``, or ``auto``, the cheapest
supported; each strategy's module states its costs), which feeds key/value
blocks to a local engine (:mod:`mpiattn.kernels.engines`).
"""

from __future__ import annotations

from typing import Any

from ..comm.core import get_comm
from ..masks.score import Score
from .base import Progress
from .plan import backward_problem, plan_attention
from .problem import Arguments, validate

__all__ = ["attention", "attention_backward"]


def attention(q: Any, k: Any, v: Any, comm: Any = None, *, key_padding_mask: Any = None,
              segment_ids: Any = None, kv_segment_ids: Any = None, attn_mask: Any = None,
              mask_mod: Any = None, score_mod: Any = None, alibi_slopes: Any = None,
              sinks: Any = None, softcap: float | None = None, max_logit: bool = False,
              score: Score | None = None, progress: Progress = None,
              details: dict | None = None, **options: Any) -> tuple[Any, Any]:
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
    key_padding_mask : bool ndarray, shape (B, m_r), optional
        This rank's part of a global ``(B, M)`` mask; True marks padding.
    segment_ids : integer ndarray, shape (B, n_r), optional
        This rank's rows of the global ``(B, N)`` document ids of the
        queries (NumPy, or the backend of ``q``; any integers): query ``i``
        sees key ``j`` only when their ids are equal. See
        :func:`mpiattn.segment_ids_from_cu_seqlens`.
    kv_segment_ids : integer ndarray, shape (B, m_r), optional
        The keys' document ids; needs ``segment_ids``. Omitted: the keys
        take the query ids (needs ``N == M`` and one layout).
    attn_mask : ndarray, shape (B or 1, H or 1, n_r, M), optional
        This rank's query rows of a global mask (the key axis global, rows
        in the query layout). Bool: True = the pair takes part (torch's
        convention); float: added to the scores (after the softcap, beside
        ALiBi; ``-inf`` hides).
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array`` (True = visible), vectorised
        over broadcasting int64 arrays of global batch, head, query and key
        indices (FlexAttention's convention); combined by AND with every other
        rule. The same function on every rank: its module and name are
        compared, its code is the caller's duty. A named rule of
        :mod:`mpiattn.masks.mods` (e.g. ``mods.parse("chunked:4096")``) is compared
        by its name and parameters, and skips the blocks and tiles it hides whole.
    score_mod : mpiattn.ScoreMod or callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``: a transform of the raw scores
        ``scale q . k`` (FlexAttention's convention), elementwise on broadcasting arrays of
        global indices, applied tile by tile before ALiBi, a float ``attn_mask`` and the rules
        (:mod:`mpiattn.masks.scoremod`); ``ScoreMod(fn, grad)`` gives its derivative with respect
        to the score, which a backward needs. The same function on every rank (its code and the
        values it captures are compared). Not with ``softcap`` (a score_mod may cap).
    alibi_slopes : ndarray, shape (H,) or (B, H), optional
        ALiBi: ``-slope[b, h] |i + d - j|`` is added to the scores (``d`` the
        diagonal: ``M - N`` with bottom-right causal, else 0).
    sinks : ndarray, shape (H,), optional
        One more term ``exp(sinks[h])`` in every row's softmax denominator
        (:mod:`mpiattn.masks.sinks`); ``lse`` includes it, and a query that
        sees no key gets ``out = 0``, ``lse = sinks[h]``.
    softcap : float, optional
        Cap the scores: ``c tanh(scale q . k / c)`` before any bias or mask (Gemma 2;
        :mod:`mpiattn.masks.softcap`). Not with ``score_mod``.
    max_logit : bool
        Report the largest ``scale q . k`` of a visible pair per query head in ``details``
        (:mod:`mpiattn.masks.maxlogit`).
    score : mpiattn.Score, optional
        The score modifiers as one object (the keywords above add to it; one given both ways
        is a ValueError).
    progress : callable(done, total), optional
        Called on every rank after each block step.
    details : dict, optional
        Filled with what was used: ``strategy``, ``engine``, their reasons
        (``strategy_reason``, ``engine_reason``), ``block_size`` (rows per
        exchanged key/value block); with ``max_logit=True`` also ``max_logit``,
        float64 ``(H,)``, the largest ``scale q . k`` of a visible pair of
        each query head over every batch entry and rank (``-inf``: none).
    **options
        The fields of :class:`mpiattn.Options`, or ``options=`` an Options
        (keywords given beside it replace its fields): ``causal`` (key ``j``
        visible to query ``i`` iff ``j <= i``, top-left aligned), ``scale``
        (default ``1/sqrt(E)``), ``window=(left, right)``, ``layout`` and
        ``kv_layout`` (a name or a :class:`mpiattn.Layout`, the same on every
        rank), ``strategy`` (``"auto"``, ``"ring"``, ``"allgather"``,
        ``"ulysses"``, ``"materialized"``), ``engine`` (``"auto"``, i.e. the
        native engine, ``"native"`` or ``"torch"``), ``block_size``,
        and ``check_finite`` (default True).

    Returns
    -------
    out : ndarray, shape (B, H, n_r, Ev), q's dtype
    lse : ndarray, shape (B, H, n_r)
        Natural log of the scaled softmax denominator, float32 (float64 for
        float64 inputs). A query that sees no key gets ``out = 0`` and
        ``lse = -inf`` (with sinks ``lse = sinks[h]``).

    Raises
    ------
    ValueError, TypeError
        On every rank alike (they carry :class:`mpiattn.comm.errors.Agreed`),
        for inconsistent shapes, dtypes, layouts, options or strategies,
        lengths that do not match the layout, ranks that disagree, or
        non-finite input.

    Notes
    -----
    GQA/MQA: ``H`` must be a multiple of ``Hkv``; query head ``h`` uses
    key/value head ``h // (H // Hkv)``. float16, bfloat16 (``ml_dtypes``) and
    float32 accumulate in float32. NumPy and CuPy inputs run the same code.

    Examples
    --------
    Run under ``mpiexec -n P``, each rank passes its rows; here one process:

    >>> import numpy as np, mpiattn
    >>> x = np.random.default_rng(0).standard_normal((1, 2, 6, 4))
    >>> x_r = mpiattn.shard(x)                      # this rank's rows
    >>> out, lse = mpiattn.attention(x_r, x_r, x_r, causal=True)
    >>> out.shape, lse.shape
    ((1, 2, 6, 4), (1, 2, 6))
    >>> bool(np.allclose(out[:, :, 0], x[:, :, 0]))  # query 0 sees key 0 only
    True
    """
    plan = plan_attention(q, k, v, comm, key_padding_mask=key_padding_mask,
                          segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                          attn_mask=attn_mask, mask_mod=mask_mod, score_mod=score_mod,
                          alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap,
                          max_logit=max_logit, score=score, **options)
    if details is not None:
        details.update(plan.details())
    return plan.run_forward(q, k, v, key_padding_mask, progress, details=details)


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm: Any = None, *,
                       key_padding_mask: Any = None, segment_ids: Any = None,
                       kv_segment_ids: Any = None, attn_mask: Any = None, mask_mod: Any = None,
                       score_mod: Any = None, alibi_slopes: Any = None, sinks: Any = None,
                       softcap: float | None = None, max_logit: bool = False,
                       score: Score | None = None, progress: Progress = None,
                       details: dict | None = None, **options: Any) -> tuple:
    """Gradients of :func:`attention` with respect to ``q``, ``k`` and ``v``.

    Recomputes the probabilities from ``lse`` (FlashAttention-2 style) with
    ``D = rowsum(dout * out)``; see :mod:`mpiattn.kernels.native` for the formulas.

    Parameters
    ----------
    dout : ndarray, shape (B, H, n_r, Ev)
        Gradient of the loss with respect to ``out``.
    q, k, v, out, lse
        The forward inputs and outputs (``out`` and ``lse`` as returned by
        :func:`attention` with the same options).
    comm, key_padding_mask, segment_ids, kv_segment_ids, progress, details, **options
        As in :func:`attention`; pass the same values as to the forward call
        (the engine may differ: the gradients only need ``out`` and ``lse``).
    attn_mask, mask_mod, score_mod, alibi_slopes, sinks, softcap, max_logit, score
        As in :func:`attention` (the same values as the forward call's; ``score_mod`` with its
        derivative: a ``ScoreMod(fn, grad)``).

    Returns
    -------
    dq : ndarray, shape (B, H, n_r, E)
    dk : ndarray, shape (B, Hkv, m_r, E)
    dv : ndarray, shape (B, Hkv, m_r, Ev)
        In the dtypes of ``q``, ``k``, ``v``. Queries that saw no key get
        zero gradients.
    dsinks : ndarray, shape (H,), float64
        Only with ``sinks``: ``-sum_{b,i} exp(sinks[h] - lse) D`` over every
        rank's rows (``D = rowsum(dout * out)``), the same on every rank.

    Raises
    ------
    ValueError, TypeError
        As :func:`attention`, and when ``dout``, ``out`` or ``lse`` do not
        match ``q`` and ``v``.

    Examples
    --------
    >>> import numpy as np, mpiattn
    >>> q = np.random.default_rng(1).standard_normal((1, 1, 5, 3))
    >>> out, lse = mpiattn.attention(q, q, q, window=(1, 0))
    >>> dq, dk, dv = mpiattn.attention_backward(np.ones_like(out), q, q, q, out, lse, window=(1, 0))
    >>> dq.shape == q.shape and dv.shape == q.shape
    True
    """
    c = get_comm(comm)
    pb = validate(c, Arguments(q, k, v, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids,
                               grads={"dout": dout, "out": out, "lse": lse}, settings=options,
                               score=Score.of(score, attn_mask=attn_mask, mask_mod=mask_mod,
                                              score_mod=score_mod, alibi_slopes=alibi_slopes,
                                              sinks=sinks, softcap=softcap, max_logit=max_logit)))
    if details is not None:
        details.update(pb.details())
    return backward_problem(c, pb, dout, q, k, v, out, lse, key_padding_mask, progress)
