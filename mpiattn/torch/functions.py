"""Autograd functions: distributed attention and the three products on torch tensors.

Each function takes this rank's rows as tensors, runs the library call on
the same memory (:mod:`mpiattn.torch.tensors`), and returns tensors; its
backward is the library's backward (:func:`mpiattn.attention_backward`, the
products' closure :func:`mpiattn.matmul_nt_backward` and its siblings).

Collective, in both directions: every rank of the communicator calls the
function, and every rank runs its backward (a loss that reaches the output on
every rank, e.g. a global mean; a rank with no rows still backpropagates its
empty output). Before any work one agreement checks the tensors on every rank
(contiguous, one device, one dtype, masks that need no gradient, the same
``requires_grad`` pattern everywhere, since a rank that builds no backward node
would leave the others waiting); a fault on any rank raises the same error on
every rank (:class:`mpiattn.comm.errors.Agreed`). The library call then checks
shapes and options as it always does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .. import products
from ..comm.core import Comm, get_comm
from ..masks.score import NAMES, Score
from ..strategies import attention as np_attention
from ..strategies import attention_backward as np_attention_backward
from ..strategies.plan import reuse_or_plan
from .ops import (EXTRA, MATMUL_NN, MATMUL_NT, MATMUL_TN, agree, compiled_attention,
                  compiled_product, product, product_gradients, sink_gradient, with_lse_gradient)
from .scoremod import TorchScoreMod, captured
from .tensors import on_device, to_array, to_tensor

__all__ = ["attention", "plan_for", "matmul_nt", "matmul_nn", "matmul_tn"]


@dataclass
class _Call:
    """What a call passes through autograd besides its tensors."""

    comm: Comm
    keywords: dict
    details: dict | None = None
    progress: Any = None
    lse_grad: bool = False
    plan: Any = None  # an AttentionPlan every rank's arrays fit (checked already)
    sinks: Any = None  # (H,) float64 host: the sinks' values (their tensor is an autograd input)
    mod: Any = None  # the TorchScoreMod of a score_mod (its captured tensors: autograd inputs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None, call: _Call,
                *captured: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device(q.device):
            if call.plan is not None:
                if call.details is not None:
                    call.details.update(call.plan.details())
                out, lse = call.plan.run_forward(to_array(q), to_array(k), to_array(v),
                                                 call.keywords.get("key_padding_mask"), call.progress,
                                                 call.sinks, call.details)
            else:
                out, lse = np_attention(to_array(q), to_array(k), to_array(v), call.comm,
                                        progress=call.progress, details=call.details,
                                        sinks=call.sinks, **call.keywords)
            out_t, lse_t = to_tensor(out), to_tensor(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.call = call
        ctx.sinks_to = None if sinks is None else {"dtype": sinks.dtype, "device": sinks.device}
        ctx.set_materialize_grads(False)
        if not call.lse_grad:
            ctx.mark_non_differentiable(lse_t)
        return out_t, lse_t

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
        _first_order_only("attention")
        return _Attention._backward(ctx, dout, dlse)

    @staticmethod
    @once_differentiable
    def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        # dense, in q's dtype (e.g. the expanded ones of a sum()); None: the output was unused
        dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype).contiguous()
        Ev = v.shape[-1]
        dsinks = None
        if call.sinks is not None and ctx.needs_input_grad[3]:
            with on_device(q.device):
                dsinks = sink_gradient(call.sinks, out, lse, dout, dlse).to(**ctx.sinks_to)
        if call.lse_grad:  # the same on every rank (agreed): see ops.with_lse_gradient
            v, dout, out = with_lse_gradient(v, dout, out, dlse)
        if call.mod is not None:  # its captured tensors' gradients, anew
            call.mod.start_backward()
        with on_device(q.device):
            arrays = (to_array(dout), to_array(q), to_array(k), to_array(v), to_array(out),
                      to_array(lse))
            if call.plan is not None and not call.lse_grad:  # (lse's gradient: v has a column more)
                grads = call.plan.run_backward(*arrays, call.keywords.get("key_padding_mask"),
                                               call.progress)
            else:  # (lse holds the sinks: the blocks' gradients need nothing else of them)
                grads = np_attention_backward(*arrays, call.comm, progress=call.progress,
                                              **call.keywords)
            dq, dk, dv = (to_tensor(g) for g in grads[:3])
        return (dq, dk, dv[..., :Ev], dsinks, None, *(() if call.mod is None else call.mod.gradients()))


def _first_order_only(what: str) -> None:
    """Refuse a backward that builds a graph (``create_graph=True``): its gradients would come
    back detached, and a second-order loss would get silently wrong gradients."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"mpiattn.torch.{what}: second-order gradients (backward or "
                           "torch.autograd.grad with create_graph=True) are not supported; its "
                           "backward is the library's hand-derived first-order one")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: Any = None,
              key_padding_mask: Any = None, segment_ids: Any = None, kv_segment_ids: Any = None,
              attn_mask: Any = None, mask_mod: Any = None, score_mod: Any = None,
              alibi_slopes: Any = None, sinks: Any = None, score: Score | None = None,
              return_lse: bool = False, progress: Any = None,
              details: dict | None = None, planned: Any = None, **options: Any) -> Any:
    """Exact attention over a sequence sharded across ranks, differentiable by torch's autograd.

    :func:`mpiattn.attention` on tensors: the same keywords, the same result,
    and a backward that is :func:`mpiattn.attention_backward`.

    Parameters
    ----------
    q : torch.Tensor, shape (B, H, n_r, E)
        This rank's query rows (contiguous; float16, bfloat16, float32 or
        float64; CPU, or CUDA for float16/32/64).
    k : torch.Tensor, shape (B, Hkv, m_r, E)
        This rank's key rows, same device and dtype.
    v : torch.Tensor, shape (B, Hkv, m_r, Ev)
        This rank's value rows, same device and dtype.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``.
    key_padding_mask : bool tensor or ndarray, shape (B, m_r), optional
        True marks padding keys.
    segment_ids, kv_segment_ids : integer tensor or ndarray, optional
        Document ids ``(B, n_r)``, ``(B, m_r)`` (see :func:`mpiattn.attention`).
    attn_mask, mask_mod, alibi_slopes : optional
        Score modifiers (see :func:`mpiattn.attention`; tensors need no gradient).
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score`` written with torch ops (see
        :func:`mpiattn.attention`): differentiated by autograd on each tile
        (:mod:`mpiattn.torch.scoremod`); the tensors it captures (closure, defaults) that
        require grad get this rank's part of their gradient, which
        :func:`mpiattn.torch.reduce_gradients` sums. The same function and values on every rank.
    sinks : torch.Tensor or ndarray, shape (H,), optional
        The sinks (:mod:`mpiattn.masks.sinks`). A tensor that requires grad gets this rank's
        part of its gradient, like every replicated parameter
        (:func:`mpiattn.torch.reduce_gradients` sums the parts); the same values on every rank.
    score : mpiattn.Score, optional
        The score modifiers as one object (the keywords above, ``softcap`` and ``max_logit``
        among them, may join it; one given both ways is a ValueError): the same call.
    return_lse : bool
        Also return ``lse`` (differentiable: its gradient joins the backward).
    progress, details
        As in :func:`mpiattn.attention` (``details`` is filled by the forward).
    planned : mpiattn.AttentionPlan, optional
        A plan every rank's tensors are known to fit (:func:`plan_for`): the forward and
        backward run it, without the library's per-call validation.
    **options
        The fields of :class:`mpiattn.Options` (``causal``, ``scale``,
        ``window``, ``layout``, ``kv_layout``, ``strategy``, ``engine``,
        ``block_size``, ``check_finite``) or ``options=``.

    Returns
    -------
    out : torch.Tensor, shape (B, H, n_r, Ev)
        In q's dtype and on its device, on memory the library allocated (no
        copy).
    lse : torch.Tensor, shape (B, H, n_r)
        Only with ``return_lse``: float32 (float64 for float64 inputs),
        differentiable (``d lse_i / d score_ij`` is the probability; the
        backward then works on ``v`` with one more column, a copy).

    Raises
    ------
    TypeError, ValueError
        On every rank alike: non-tensor or non-contiguous operands, mixed
        devices or dtypes, a mask or ids tensor that requires grad, ranks
        that disagree on which operands require grad, and everything
        :func:`mpiattn.attention` rejects.

    Notes
    -----
    Collective forward and backward (see the module notes). bfloat16
    accumulates in float32, as float16 does.

    Examples
    --------
    >>> import torch, mpiattn.torch as mt
    >>> q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    >>> out = mt.attention(q, q, q, causal=True)
    >>> out.shape
    torch.Size([1, 2, 5, 4])
    >>> bool(torch.allclose(out[:, :, 0], q[:, :, 0]))   # query 0 sees key 0 only
    True
    >>> out.sum().backward(); q.grad.shape
    torch.Size([1, 2, 5, 4])
    """
    if torch.compiler.is_compiling():  # custom operators a full graph holds (mpiattn.torch.ops)
        given = dict(sinks=sinks, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
                     kv_segment_ids=kv_segment_ids, attn_mask=attn_mask, alibi_slopes=alibi_slopes)
        loose = dict(options, mask_mod=mask_mod, score_mod=score_mod, **(
            {} if score is None else {"score": score}))
        return _compiled(q, k, v, comm, given, loose, return_lse, details, progress, planned)
    c = get_comm(comm)
    if score is not None:  # one object, or its fields as keywords: the same call
        score = Score.of(score, attn_mask=attn_mask, mask_mod=mask_mod, score_mod=score_mod,
                         alibi_slopes=alibi_slopes, sinks=sinks,
                         **{n: options.pop(n) for n in NAMES if n in options})
        attn_mask, mask_mod, score_mod, alibi_slopes, sinks = (
            score.attn_mask, score.mask_mod, score.score_mod, score.alibi_slopes, score.sinks)
        score = replace(score, attn_mask=None, mask_mod=None, score_mod=None, alibi_slopes=None,
                        sinks=None)  # what is left goes to the library as it is
    mod = None
    if score_mod is not None:
        mod = TorchScoreMod(score_mod, captured(score_mod) if torch.is_grad_enabled() else ())
    sinks_t = sinks if isinstance(sinks, torch.Tensor) else None
    sinks_grad = bool(torch.is_grad_enabled() and sinks_t is not None and sinks_t.requires_grad)
    ids = agree(c, "attention", {"q": q, "k": k, "v": v}, {"key_padding_mask": key_padding_mask,
                                                 "segment_ids": segment_ids,
                                                 "kv_segment_ids": kv_segment_ids},
                 {"return_lse": bool(return_lse), "sinks (given, requires_grad)": (
                     sinks is not None, sinks_grad), "score_mod (given, tensors it captures that "
                     "require grad)": (mod is not None, 0 if mod is None else len(mod.params)),
                  "a plan (planned=) beside a score_mod": planned is not None and mod is not None},
                 Score.of(attn_mask=attn_mask, mask_mod=mask_mod, alibi_slopes=alibi_slopes))
    lse_grad = bool(return_lse) and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, *(() if sinks_t is None else (sinks_t,))))
    host = None
    if sinks is not None:  # values only: the library agrees and checks them
        host = (sinks_t.detach().to("cpu", torch.float64).numpy() if sinks_t is not None
                else np.asarray(sinks, dtype=np.float64))
    if mod is not None:
        if planned is not None:  # (agreed above: every rank raises alike)
            raise ValueError("mpiattn.torch.attention: a plan (planned=) does not take a score_mod; "
                             "call without planned=")
        ids["score"] = Score.of(ids["score"], score_mod=mod)
    if score is not None:
        ids["score"] = Score.of(ids["score"], **score.keywords())
    call = _Call(c, dict(options, **ids), details, progress, lse_grad, planned, host, mod)
    out, lse = _Attention.apply(q, k, v, sinks_t, call, *(() if mod is None else mod.params))
    return (out, lse) if return_lse else out


def _compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Any, given: dict,
              loose: dict, return_lse: bool, details: Any, progress: Any, planned: Any) -> Any:
    """:func:`attention` while ``torch.compile`` traces it (:mod:`mpiattn.torch.ops`): the
    tensors as the operator's inputs, the rest in its handle; what it cannot take named."""
    score = loose.pop("score", None)
    if score is not None:  # (a Score's fields join the keywords; tensors among them too)
        for name in score.given():
            (given if name in EXTRA else loose)[name] = getattr(score, name)
    refused = tuple(n for n, given in (("details", details is not None),
                                       ("progress", progress is not None),
                                       ("planned", planned is not None),
                                       ("max_logit", bool(loose.get("max_logit"))),
                                       ("score_mod", loose.get("score_mod") is not None)) if given)
    keywords = {n: x for n, x in loose.items() if x is not None and n not in ("max_logit", "score_mod")}
    return compiled_attention(q, k, v, comm, {n: x for n, x in given.items() if x is not None},
                              keywords, return_lse, refused)


def plan_for(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Comm,
             key_padding_mask: Any = None, **options: Any) -> Any:
    """``plan`` when every rank's tensors (and ``options``) fit it, else a new
    :class:`mpiattn.AttentionPlan` for them (collective; the same answer on every rank):
    :func:`mpiattn.strategies.plan.reuse_or_plan` on the tensors' arrays.

    What a module that attends arrays of the same shapes call after call keeps between calls
    (:class:`mpiattn.torch.MultiheadAttention`); pass the result as ``planned=`` to
    :func:`attention`, which then skips the library's per-call validation.
    """
    def array(x: Any) -> Any:  # (the rules on tensors are checked later, on every rank alike)
        return to_array(x.detach().contiguous()) if isinstance(x, torch.Tensor) else x
    mask = None if key_padding_mask is None else array(key_padding_mask)
    arrays = (array(q), array(k), array(v))
    with on_device(q.device):
        return reuse_or_plan(plan, *arrays, c, key_padding_mask=mask, **options)


# ------------------------------------------------------------------ the products
def _product(forward: Callable, backward: Callable, name: str) -> type:
    class _Product(torch.autograd.Function):
        call = name
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, call: _Call) -> torch.Tensor:
            out = product(forward, a, b, call.comm, call.keywords)
            ctx.save_for_backward(a, b)
            ctx.call = call
            return out

        @staticmethod
        def backward(ctx: Any, dc: torch.Tensor) -> tuple:
            _first_order_only(name)
            return _Product._backward(ctx, dc)

        @staticmethod
        @once_differentiable
        def _backward(ctx: Any, dc: torch.Tensor) -> tuple:
            a, b = ctx.saved_tensors
            return (*product_gradients(backward, dc, a, b, ctx.call.comm, ctx.call.keywords), None)

    return _Product


_NT = _product(products.matmul_nt, products.matmul_nt_backward, "matmul_nt")
_NN = _product(products.matmul_nn, products.matmul_nn_backward, "matmul_nn")
_TN = _product(products.matmul_tn, products.matmul_tn_backward, "matmul_tn")


def _run(fn: type, op: Any, a: torch.Tensor, b: torch.Tensor, comm: Any, layout: Any,
         block_size: int | None) -> torch.Tensor:
    """The product ``fn`` (its operator ``op`` while compiling, :mod:`mpiattn.torch.ops`)."""
    keywords = {"layout": layout, "block_size": block_size}
    if torch.compiler.is_compiling():
        return compiled_product(op, a, b, comm, keywords)
    c = get_comm(comm)
    agree(c, fn.call, {"a": a, "b": b})
    return fn.apply(a, b, _Call(c, keywords))


def matmul_nt(a: torch.Tensor, b: torch.Tensor, *, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None) -> torch.Tensor:
    """This rank's rows of ``A·Bᵀ`` (:func:`mpiattn.matmul_nt`), differentiable.

    Parameters
    ----------
    a : torch.Tensor, shape (..., n_r, d)
    b : torch.Tensor, shape (..., m_r, d)
        This rank's rows of A and B (contiguous, one device and dtype).
    comm, layout, block_size
        As in :func:`mpiattn.matmul_nt`.

    Returns
    -------
    torch.Tensor, shape (..., n_r, M)
        Its backward: ``dA = nn(dC, B)``, ``dB = tn(dC, A)``
        (:func:`mpiattn.matmul_nt_backward`).

    Examples
    --------
    >>> import torch, mpiattn.torch as mt
    >>> a = torch.ones(3, 2, dtype=torch.float64)
    >>> mt.matmul_nt(a, a)
    tensor([[2., 2., 2.],
            [2., 2., 2.],
            [2., 2., 2.]], dtype=torch.float64)
    """
    return _run(_NT, MATMUL_NT, a, b, comm, layout, block_size)


def matmul_nn(a: torch.Tensor, b: torch.Tensor, *, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None) -> torch.Tensor:
    """This rank's rows of ``A·B`` (:func:`mpiattn.matmul_nn`), differentiable.

    Parameters
    ----------
    a : torch.Tensor, shape (..., n_r, M)
        This rank's rows of A, all ``M`` columns.
    b : torch.Tensor, shape (..., m_r, d)
        This rank's rows of B.
    comm, layout, block_size
        As in :func:`mpiattn.matmul_nn`.

    Returns
    -------
    torch.Tensor, shape (..., n_r, d)
        Its backward: ``dA = nt(dC, B)``, ``dB = tn(A, dC)``.
    """
    return _run(_NN, MATMUL_NN, a, b, comm, layout, block_size)


def matmul_tn(a: torch.Tensor, b: torch.Tensor, *, comm: Any = None, layout: Any = "contiguous",
              block_size: int | None = None) -> torch.Tensor:
    """This rank's rows of ``Aᵀ·B`` (:func:`mpiattn.matmul_tn`), differentiable.

    Parameters
    ----------
    a : torch.Tensor, shape (..., m_r, N)
        This rank's rows of A (M x N).
    b : torch.Tensor, shape (..., m_r, d)
        This rank's rows of B (M x d).
    comm, layout, block_size
        As in :func:`mpiattn.matmul_tn`.

    Returns
    -------
    torch.Tensor, shape (..., n_r, d)
        This rank's rows of the ``N x d`` result. Its backward:
        ``dA = nt(B, dC)``, ``dB = nn(A, dC)``.
    """
    return _run(_TN, MATMUL_TN, a, b, comm, layout, block_size)
