"""Attention and the products as torch custom operators, for ``torch.compile(fullgraph=True)``.

Dynamo cannot trace the library's Python (MPI, NumPy, the ranks' agreement), so under
``torch.compile`` :func:`mpiattn.torch.attention` calls two operators registered with
``torch.library`` instead of its autograd function:

``mpiattn::attention(q, k, v, sinks?, key_padding_mask?, segment_ids?, kv_segment_ids?,
attn_mask?, alibi_slopes?, position_ids?, handle) -> (out, lse)``
    the forward: the same agreement and library call as the eager path, at run time (and a
    caller's checks first: the transformers adapter's of its first layer, with the positions);
``mpiattn::attention_backward(dout, q, k, v, out, lse, dlse?, ...) -> (dq, dk, dv, dsinks)``
    its backward (registered as the first operator's autograd formula).

Each has a fake implementation (the output shapes and dtypes: ``out`` like ``q`` with ``v``'s
last axis, ``lse`` in the accumulation dtype), so the compiler sees them as single graph
nodes with known outputs. What is not a tensor (the communicator, the options, a
``mask_mod``, ``softcap``, whether ``lse`` is differentiable) is held by a *handle*, an
integer :func:`handle` hands out while the graph is traced (marked
``torch.compiler.assume_constant_result``: traced once, a constant of the graph).

Each product has two more, ``mpiattn::matmul_nt(a, b, handle) -> c`` and
``mpiattn::matmul_nt_backward(dc, a, b, handle) -> (da, db)`` (and so on). A product's output has a length no single rank's tensors give:
``matmul_nt``'s ``M`` columns (every rank's key rows) and ``matmul_tn``'s ``n_r`` rows (this
rank's share of ``N`` by the layout); its fake implementation gives it as an *unbacked* size
(known when the operator has run, as for ``torch.nonzero``). So the compiler never
communicates (a rank that retraces alone waits on no other), and a graph holds no length that
depends on the rank, the layout or the other ranks (inductor's cache of compiled graphs, which
the ranks of a node share, takes two graphs of the same operations and input shapes for one;
a length computed while tracing, e.g. ``matmul_tn``'s share, would differ between them).

Not compiled, and refused while compiling with the reason: ``details=`` and ``progress=``
(Python objects the operator would fill outside the graph), ``planned=`` (a plan is a
collective made outside it), ``max_logit`` (reported in ``details``), and ``score_mod``
(its captured tensors are autograd inputs an operator's fixed signature cannot list;
call such an attention outside the compiled region, e.g. under
``torch.compiler.disable``). Eager calls are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import products
from ..comm.core import Comm, get_comm
from ..masks.score import Score
from ..masks.sinks import local_sink_gradient
from ..strategies import attention as np_attention
from ..strategies import attention_backward as np_attention_backward
from .tensors import check_extra, check_operands, facts, on_device, to_array, to_tensor

__all__ = ["agree", "sink_gradient", "with_lse_gradient", "handle", "compiled_attention",
           "compiled_product", "product", "product_gradients", "REFUSED", "MATMUL_NT", "MATMUL_NN",
           "MATMUL_TN"]

#: What a compiled call cannot take, and why.
REFUSED = {"details": "it is filled outside the compiled graph",
           "progress": "it is called outside the compiled graph",
           "planned": "a plan is made by a collective outside the compiled graph",
           "max_logit": "it is reported in details=",
           "score_mod": "its captured tensors are autograd inputs an operator cannot list",
           "a Llama 4 NoPE layer": "its query scales need the rows' global positions, in Python"}

#: The tensors an operator takes besides q, k and v, in its signature's order.
EXTRA = ("sinks", "key_padding_mask", "segment_ids", "kv_segment_ids", "attn_mask", "alibi_slopes")


def agree(c: Comm, call: str, operands: dict[str, Any], extra: dict[str, Any] | None = None,
          flags: dict | None = None, score: Score | None = None) -> dict:
    """Check the tensors on every rank (one allgather, the call ``call``); returns the extra
    arguments as arrays (and ``score``, its tensors made arrays, as ``"score"``).

    ``flags`` are further facts every rank must share (e.g. ``return_lse``).
    """
    got: dict = {}

    def local() -> dict:
        check_operands(operands)
        device = next(iter(operands.values())).device
        got.update(check_extra(extra or {}, device))
        if score is not None:
            got["score"] = score.map_arrays(lambda name, x: check_extra({name: x}, device)[name])
        return {**facts(operands), **(flags or {})}

    c.agree(local, call=f"mpiattn.torch.{call}")
    return got


def sink_gradient(sinks: Any, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  dlse: torch.Tensor | None) -> torch.Tensor:
    """This rank's part of the sinks' gradient (``reduce_gradients`` sums the ranks' parts, as
    for every other parameter): :func:`mpiattn.masks.sinks.local_sink_gradient` with
    ``D = rowsum(dout * out) - dlse`` (``d lse / d σ_h = exp(σ_h - lse)``; ``dlse`` only when
    ``lse`` is returned)."""
    acc = lse.dtype
    D = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        D = D - dlse.to(acc)
    return to_tensor(local_sink_gradient(sinks, to_array(lse), to_array(D.contiguous())))


def with_lse_gradient(v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                      dlse: torch.Tensor | None) -> tuple:
    """``v``, ``dout``, ``out`` with one more column, so the attention backward adds ``lse``'s.

    ``d lse_i / d S_ij = P_ij``, so the score gradient ``P * (dP - D)`` gains
    ``P * dlse``. Appending a column of ones to ``v``, ``dlse`` to ``dout`` and
    zeros to ``out`` gives ``dP'_ij = dP_ij + dlse_i`` and leaves ``D`` as it
    was: the library's backward (any engine) then returns the gradients of
    both outputs. Costs a copy of ``v``, ``dout`` and ``out``.
    """
    ones = torch.ones(v.shape[:-1] + (1,), dtype=v.dtype, device=v.device)
    g = torch.zeros(out.shape[:-1], dtype=out.dtype, device=out.device) if dlse is None else \
        dlse.to(out.dtype)
    return (torch.cat([v, ones], dim=-1), torch.cat([dout, g[..., None]], dim=-1),
            torch.cat([out, torch.zeros_like(g)[..., None]], dim=-1))


# ------------------------------------------------------------------ the handles
@dataclass(frozen=True)
class _Settings:
    """What a compiled call holds besides its tensors."""

    comm: Any
    keywords: dict  # the Options fields and the modifiers that are no tensors (softcap, mask_mod)
    lse_grad: bool  # lse is returned, so its gradient joins the backward
    check: tuple | None = None  # (function, its arguments): a caller's checks of the forward


_SETTINGS: dict[int, _Settings] = {}


@torch.compiler.assume_constant_result
def handle(comm: Any, keywords: dict, return_lse: bool, refused: tuple,
           check: tuple | None = None) -> int:
    """A new handle for a compiled call's settings (run while the graph is traced: a constant of
    the graph). ``refused``: the names of :data:`REFUSED` the call was given (a TypeError);
    ``check``: ``(function, arguments)`` the forward runs first, ``function(c, *arguments,
    query=, key=, position_ids=)``, collective (the transformers adapter's, on its first layer)."""
    if refused:
        raise TypeError(f"mpiattn.torch under torch.compile takes no {refused[0]} "
                        f"({REFUSED[refused[0]]}); call it outside the compiled region "
                        "(torch.compiler.disable) for that")
    key = len(_SETTINGS)
    _SETTINGS[key] = _Settings(comm, dict(keywords), bool(return_lse), check)
    return key


def _call(st: _Settings, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict) -> tuple:
    """The communicator, the agreed arrays and the host sinks of a call (collective)."""
    c = get_comm(st.comm)
    masks = {n: extra[n] for n in ("key_padding_mask", "segment_ids", "kv_segment_ids")}
    sinks = extra["sinks"]
    ids = agree(c, "attention", {"q": q, "k": k, "v": v}, masks,
                {"return_lse": st.lse_grad, "sinks (given)": sinks is not None},
                Score.of(attn_mask=extra["attn_mask"], mask_mod=st.keywords.get("mask_mod"),
                         alibi_slopes=extra["alibi_slopes"]))
    host = None if sinks is None else sinks.detach().to("cpu", torch.float64).numpy()
    keywords = {k: x for k, x in st.keywords.items() if k != "mask_mod"}
    return c, {**keywords, **ids}, host


# ------------------------------------------------------------------ the operators
@torch.library.custom_op("mpiattn::attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
             key_padding_mask: torch.Tensor | None, segment_ids: torch.Tensor | None,
             kv_segment_ids: torch.Tensor | None, attn_mask: torch.Tensor | None,
             alibi_slopes: torch.Tensor | None, position_ids: torch.Tensor | None,
             handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    st = _SETTINGS[handle]
    if st.check is not None:
        fn, args = st.check
        fn(get_comm(st.comm), *args, query=q, key=k, position_ids=position_ids)
    extra = dict(zip(EXTRA, (sinks, key_padding_mask, segment_ids, kv_segment_ids, attn_mask,
                             alibi_slopes)))
    c, keywords, host = _call(st, q, k, v, extra)
    with on_device(q.device):
        out, lse = np_attention(to_array(q), to_array(k), to_array(v), c, sinks=host, **keywords)
        return to_tensor(out).contiguous(), to_tensor(lse).contiguous()


@_forward.register_fake
def _forward_fake(q, k, v, sinks, key_padding_mask, segment_ids, kv_segment_ids, attn_mask,
                  alibi_slopes, position_ids, handle):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty(q.shape[:-1], dtype=acc)


@torch.library.custom_op("mpiattn::attention_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
              sinks: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
              segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None,
              attn_mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
              handle: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    st = _SETTINGS[handle]
    extra = dict(zip(EXTRA, (sinks, key_padding_mask, segment_ids, kv_segment_ids, attn_mask,
                             alibi_slopes)))
    c, keywords, host = _call(st, q, k, v, extra)
    dout = dout.to(q.dtype).contiguous()
    Ev = v.shape[-1]
    dsinks = torch.zeros(0, dtype=torch.float64)
    with on_device(q.device):
        if host is not None:
            dsinks = sink_gradient(host, out, lse, dout, dlse if st.lse_grad else None)
        if st.lse_grad:
            v, dout, out = with_lse_gradient(v, dout, out, dlse)
        grads = np_attention_backward(*(to_array(x.contiguous()) for x in (dout, q, k, v, out, lse)),
                                      c, **keywords)
        dq, dk, dv = (to_tensor(g) for g in grads[:3])
    return dq.contiguous(), dk.contiguous(), dv[..., :Ev].contiguous(), dsinks


@_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, sinks, key_padding_mask, segment_ids,
                   kv_segment_ids, attn_mask, alibi_slopes, handle):
    n = 0 if sinks is None else sinks.shape[0]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((n,), dtype=torch.float64))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, sinks, *masks, _, handle_ = inputs  # (position_ids: the forward's checks only)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, *masks)
    ctx.handle = handle_


def _autograd(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse, sinks, *masks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = torch.ops.mpiattn.attention_backward(dout, q, k, v, out, lse, dlse, sinks,
                                                              *masks, ctx.handle)
    ds = None if sinks is None else dsinks.to(sinks.dtype)
    return (dq, dk, dv, ds) + (None,) * (len(masks) + 2)


_forward.register_autograd(_autograd, setup_context=_setup)


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Any,
                       tensors: dict, keywords: dict, return_lse: bool, refused: tuple,
                       check: tuple | None = None, position_ids: torch.Tensor | None = None) -> Any:
    """:func:`mpiattn.torch.attention` while compiling (the module docstring): ``tensors`` the
    :data:`EXTRA` given, ``keywords`` the rest (Options fields, ``softcap``, ``mask_mod``);
    ``check``: ``(function, arguments)`` the forward runs first (:func:`handle`)."""
    h = handle(comm, keywords, return_lse, refused, check)
    out, lse = torch.ops.mpiattn.attention(q, k, v, *(tensors.get(n) for n in EXTRA), position_ids, h)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ the products
def product(forward: Any, a: torch.Tensor, b: torch.Tensor, c: Comm,
            keywords: dict) -> torch.Tensor:
    """The library product ``forward`` (:func:`mpiattn.matmul_nt`, ...) on tensors' memory: eager
    (:mod:`mpiattn.torch.functions`) and compiled alike."""
    with on_device(a.device):
        return to_tensor(forward(to_array(a), to_array(b), c, **keywords))


def product_gradients(backward: Any, dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: Comm,
                      keywords: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, db)`` of :func:`product` by the library's ``backward``
    (:func:`mpiattn.matmul_nt_backward`, ...), ``dc`` taken in ``a``'s dtype."""
    with on_device(a.device):
        da, db = backward(to_array(dc.to(a.dtype).contiguous()), to_array(a), to_array(b), c,
                          **keywords)
        return to_tensor(da), to_tensor(db)


def _unbacked() -> Any:
    """A length the compiler learns when the operator has run."""
    return torch.library.get_ctx().new_dynamic_size()


def _nt_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(lead, n_r, M)``, ``M`` unbacked."""
    return torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], _unbacked())


def _nn_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(lead, n_r, d)``: known from this rank's tensors."""
    return torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])


def _tn_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(lead, n_r, d)``, ``n_r`` unbacked."""
    return torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (_unbacked(), b.shape[-1])


def _product_ops(name: str, forward: Any, backward: Any, shape: Any) -> Any:
    """Register ``mpiattn::NAME`` and ``mpiattn::NAME_backward`` (the module docstring); returns
    the first (``shape(a, b)``: its output's shape for the fake)."""

    def run(a: torch.Tensor, b: torch.Tensor, handle: int) -> torch.Tensor:
        st = _SETTINGS[handle]
        c = get_comm(st.comm)
        agree(c, name, {"a": a, "b": b})
        return product(forward, a, b, c, st.keywords).contiguous()

    def fake(a, b, handle):
        return a.new_empty(shape(a, b))

    def run_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     handle: int) -> tuple[torch.Tensor, torch.Tensor]:
        st = _SETTINGS[handle]
        da, db = product_gradients(backward, dc, a, b, get_comm(st.comm), st.keywords)
        return da.contiguous(), db.contiguous()

    def fake_backward(dc, a, b, handle):
        return torch.empty_like(a), torch.empty_like(b)

    op_backward = torch.library.custom_op(f"mpiattn::{name}_backward", run_backward,
                                          mutates_args=())
    op_backward.register_fake(fake_backward)

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        a, b, handle_ = inputs
        ctx.save_for_backward(a, b)
        ctx.handle = handle_

    def gradient(ctx: Any, dc: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        return (*op_backward(dc, a, b, ctx.handle), None)

    op = torch.library.custom_op(f"mpiattn::{name}", run, mutates_args=())
    op.register_fake(fake)
    op.register_autograd(gradient, setup_context=setup)
    return op


#: The products' operators (the module docstring).
MATMUL_NT = _product_ops("matmul_nt", products.matmul_nt, products.matmul_nt_backward, _nt_shape)
MATMUL_NN = _product_ops("matmul_nn", products.matmul_nn, products.matmul_nn_backward, _nn_shape)
MATMUL_TN = _product_ops("matmul_tn", products.matmul_tn, products.matmul_tn_backward, _tn_shape)


def compiled_product(op: Any, a: torch.Tensor, b: torch.Tensor, comm: Any,
                     keywords: dict) -> torch.Tensor:
    """A product while compiling: its operator ``op`` (:data:`MATMUL_NT`, ...), with ``comm`` and
    ``keywords`` (``layout``, ``block_size``) in a handle."""
    return op(a, b, handle(comm, keywords, False, ()))
