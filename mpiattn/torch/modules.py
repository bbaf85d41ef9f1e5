"""``MultiheadAttention`` as a ``torch.nn.Module`` over sequence-sharded rows.

The projections of :class:`mpiattn.MultiheadAttention` (``Q = x Wq + bq`` ...,
stored as torch stores them: ``q_proj_weight`` is ``Wq`` transposed, ``(out,
in)``) around :func:`mpiattn.torch.attention`; torch's autograd differentiates
the projections and mpiattn's backward the attention.

Parity with ``torch.nn.MultiheadAttention``
--------------------------------------------
The constructor and ``forward`` take torch's arguments where they overlap,
with torch's meanings:

======================================  ===================================================
torch's argument                        here
======================================  ===================================================
``embed_dim``, ``num_heads``            the same
``bias``                                the same (``in_proj_bias`` and ``out_proj.bias``)
``kdim``, ``vdim``                      the same
``batch_first``                         the same, default False: ``(n_r, B, E)``;
                                        True: ``(B, n_r, E)``
``device``, ``dtype``                   the same (float16, bfloat16, float32, float64)
``dropout``                             0.0 only (mpiattn never forms the attention weights)
``add_bias_kv``, ``add_zero_attn``      False only
``key_padding_mask``                    bool, True = ignore (torch's float masks are not taken)
``need_weights``                        False only (default False here, True in torch): the
                                        ``(N, M)`` weights are never formed; returns
                                        ``(output, None)`` as torch does with False
``attn_mask``                           None only; use ``is_causal``, ``window``, ``segment_ids``
``is_causal``                           the causal rule itself (torch: a hint beside ``attn_mask``)
``average_attn_weights``                accepted, unused
======================================  ===================================================

Parameter names follow torch's (the layout it uses when ``kdim``/``vdim``
differ from ``embed_dim``): ``q_proj_weight (E, E)``, ``k_proj_weight
(Hkv*D, kdim)``, ``v_proj_weight (Hkv*D, vdim)``, ``in_proj_bias (E +
2*Hkv*D)``, ``out_proj.weight (E, E)``, ``out_proj.bias (E)``;
:meth:`MultiheadAttention.load_torch` copies a ``torch.nn.MultiheadAttention``'s
weights (either of its layouts). Added: ``num_kv_heads`` (grouped-query
attention), ``seed``, ``comm`` and the :class:`mpiattn.Options` fields
(``causal``, ``window``, ``layout``, ``strategy``, ``engine``, ...), at
construction or per call.

Parameter gradients are partial sums over this rank's rows: call
:func:`mpiattn.torch.reduce_gradients` on the model before the optimizer step
(the module does not reduce them itself, since every other replicated
parameter of the model needs the same step).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..comm.core import get_comm
from ..layer import MultiheadAttention as NumpyMultiheadAttention
from ..strategies import Options
from .functions import attention, plan_for

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.Module):
    """Multi-head (grouped-query) attention over rows sharded across MPI ranks.

    Parameters
    ----------
    embed_dim : int
        Model width ``E``; ``D = E // num_heads``.
    num_heads : int
        Query heads ``H``.
    dropout : float
        Must be 0.0.
    bias : bool
        Biases on the four projections.
    add_bias_kv, add_zero_attn : bool
        Must be False.
    kdim, vdim : int, optional
        Widths of the key and value inputs (default ``embed_dim``).
    batch_first : bool
        Inputs and output ``(B, n_r, E)`` when True, ``(n_r, B, E)`` when
        False (torch's default).
    device, dtype
        Of the parameters (dtype float16, bfloat16, float32 or float64;
        default torch's default dtype).
    num_kv_heads : int, optional
        Key/value heads ``Hkv`` (default ``H``), dividing ``H``.
    seed : int
        Initial parameters: those of ``mpiattn.MultiheadAttention(..., seed=seed)``
        (Xavier-uniform weights from NumPy's generator, zero biases), the
        same on every rank whatever the number of ranks.
    comm : mpi4py.MPI.Intracomm, optional
        The ranks that share the sequence (default ``MPI.COMM_WORLD``).
    sinks : bool
        Own learnable attention sinks, a parameter ``sinks`` of shape ``(num_heads,)``
        (initially 0; :mod:`mpiattn.masks.sinks`), replicated like the weights.
    **options
        :class:`mpiattn.Options` fields used by every call (``causal``,
        ``window``, ``layout``, ``strategy``, ``engine``, ...); a call's own
        keywords replace them.

    Examples
    --------
    >>> import torch, mpiattn.torch as mt
    >>> layer = mt.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> x = torch.randn(1, 5, 8, dtype=torch.float64)
    >>> y, weights = layer(x, x, x, is_causal=True)
    >>> y.shape, weights
    (torch.Size([1, 5, 8]), None)
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None, *, num_kv_heads: int | None = None, seed: int = 0,
                 comm: Any = None, sinks: bool = False, **options: Any):
        super().__init__()
        if dropout != 0.0:
            raise ValueError("dropout must be 0.0: mpiattn never forms the attention weights")
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        init = NumpyMultiheadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, kdim=kdim,
                                       vdim=vdim, bias=bias, dtype=np.float64, seed=seed)
        self.embed_dim, self.num_heads = init.embed_dim, init.num_heads
        self.num_kv_heads, self.head_dim = init.num_kv_heads, init.head_dim
        self.kdim, self.vdim, self.batch_first = init.kdim, init.vdim, bool(batch_first)
        self.comm, self.options = comm, Options.of(**options)
        self._plan = None  # the attention of the last forward, planned (reused while it fits)
        kw = dict(device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())

        def weight(name: str) -> nn.Parameter:
            return nn.Parameter(torch.tensor(init.params[name].T.copy(), **kw))

        self.q_proj_weight = weight("wq")
        self.k_proj_weight = weight("wk")
        self.v_proj_weight = weight("wv")
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(
                self.embed_dim + 2 * self.num_kv_heads * self.head_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias, **kw)
        with torch.no_grad():
            self.out_proj.weight.copy_(torch.from_numpy(init.params["wo"].T.copy()))
            if bias:
                self.out_proj.bias.zero_()
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, **kw))
        else:
            self.register_parameter("sinks", None)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}")

    def _biases(self) -> tuple[Any, Any, Any]:
        if self.in_proj_bias is None:
            return None, None, None
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        return b[:E], b[E:E + kv], b[E + kv:]

    def _heads(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        B, n = y.shape[:2]
        return y.reshape(B, n, heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, key_padding_mask: Any = None,
                need_weights: bool = False, attn_mask: Any = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, segment_ids: Any = None, kv_segment_ids: Any = None,
                comm: Any = None, **options: Any) -> tuple[torch.Tensor, None]:
        """Attention output for this rank's query rows.

        Parameters
        ----------
        query : torch.Tensor, shape (B, n_r, embed_dim) or (n_r, B, embed_dim)
            This rank's query rows (batch first or not, as constructed).
        key : torch.Tensor, shape (B, m_r, kdim), optional
            This rank's key rows; ``key`` and ``value`` None means
            self-attention on ``query``.
        value : torch.Tensor, shape (B, m_r, vdim), optional
        key_padding_mask : bool tensor, shape (B, m_r), optional
            True marks keys to ignore.
        need_weights : bool
            Must be False.
        attn_mask : None
            Must be None (see the module notes for the rules mpiattn offers).
        average_attn_weights : bool
            Unused (no weights are returned).
        is_causal : bool
            Causal rule ``j <= i`` on global positions (the same as ``causal=True``).
        segment_ids, kv_segment_ids
            Document ids, as in :func:`mpiattn.attention`.
        comm : mpi4py.MPI.Intracomm, optional
            Default: the module's.
        **options
            :class:`mpiattn.Options` fields for this call.

        Returns
        -------
        output : torch.Tensor
            Shaped like ``query``.
        weights : None
        """
        compiling = torch.compiler.is_compiling()  # (no Comm while traced: the operator gets it)
        c = (self.comm if comm is None else comm) if compiling else get_comm(
            self.comm if comm is None else comm)
        if compiling:  # (arguments of the traced call: the same on every rank)
            self._check_call(query, key, value, need_weights, attn_mask)
        else:
            with c.collective_errors():  # local checks, the same error on every rank
                self._check_call(query, key, value, need_weights, attn_mask)
        if key is None:
            key = value = query
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        bq, bk, bv = self._biases()
        Q = self._heads(F.linear(query, self.q_proj_weight, bq), self.num_heads)
        K = self._heads(F.linear(key, self.k_proj_weight, bk), self.num_kv_heads)
        V = self._heads(F.linear(value, self.v_proj_weight, bv), self.num_kv_heads)
        opts = _options(self.options, options, is_causal, compiling)
        planned = None
        if segment_ids is None and kv_segment_ids is None and not compiling:  # (a plan keeps its documents)
            planned = self._plan = plan_for(self._plan, Q, K, V, c, key_padding_mask, **opts)
        O = attention(Q, K, V, comm=c,
                      key_padding_mask=key_padding_mask, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, sinks=self.sinks, planned=planned, **opts)
        B, n = query.shape[:2]
        y = self.out_proj(O.transpose(1, 2).reshape(B, n, self.embed_dim))
        return (y if self.batch_first else y.transpose(0, 1)), None

    def _check_call(self, query: Any, key: Any, value: Any, need_weights: bool,
                    attn_mask: Any) -> None:
        if need_weights:
            raise ValueError("need_weights=True would form the (N, M) attention weights, which "
                             "mpiattn never does; pass need_weights=False")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported; use is_causal, window=, segment_ids= "
                             "or key_padding_mask")
        if (key is None) != (value is None):
            raise ValueError("pass both key and value (cross-attention) or neither (self-attention)")
        p = self.q_proj_weight
        named = {"query": (query, self.embed_dim)}
        if key is not None:
            named.update(key=(key, self.kdim), value=(value, self.vdim))
        elif self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise ValueError("self-attention (key and value None) needs kdim == vdim == embed_dim")
        for name, (x, width) in named.items():
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != width:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a 3-D tensor with {width} features, got {shape}")
            if x.dtype != p.dtype or x.device != p.device:
                raise TypeError(f"{name} is {x.dtype} on {x.device}; the layer's parameters are "
                                f"{p.dtype} on {p.device}")
        b = 0 if self.batch_first else 1
        if key is not None and (key.shape[b] != query.shape[b] or key.shape[:2] != value.shape[:2]):
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must agree in batch size (and key, value in rows)")

    @torch.no_grad()
    def load_torch(self, other: nn.MultiheadAttention) -> "MultiheadAttention":
        """Copy the weights of a ``torch.nn.MultiheadAttention`` (same sizes); returns ``self``.

        Works with either of torch's layouts (``in_proj_weight``, or the three
        ``*_proj_weight`` when ``kdim``/``vdim`` differ). Needs
        ``num_kv_heads == num_heads`` (torch has no grouped-query attention).
        """
        E = self.embed_dim
        if (other.embed_dim, other.num_heads, other.kdim, other.vdim) != (
                E, self.num_heads, self.kdim, self.vdim) or self.num_kv_heads != self.num_heads:
            raise ValueError("load_torch needs the same embed_dim, num_heads, kdim, vdim, and "
                             "num_kv_heads == num_heads")
        if (other.in_proj_bias is None) != (self.in_proj_bias is None):
            raise ValueError("one layer has biases and the other has none")
        if other.in_proj_weight is not None:
            wq, wk, wv = other.in_proj_weight.split(E)
        else:
            wq, wk, wv = other.q_proj_weight, other.k_proj_weight, other.v_proj_weight
        for mine, theirs in ((self.q_proj_weight, wq), (self.k_proj_weight, wk),
                             (self.v_proj_weight, wv), (self.out_proj.weight, other.out_proj.weight)):
            mine.copy_(theirs)
        if self.in_proj_bias is not None:
            self.in_proj_bias.copy_(other.in_proj_bias)
            self.out_proj.bias.copy_(other.out_proj.bias)
        return self


#: The fields of :class:`Options`.
OPTION_FIELDS = tuple(f.name for f in fields(Options))


def _options(mine: Options, given: dict, is_causal: bool, compiling: bool) -> dict:
    """A call's options: the module's, ``given`` replacing them, causal when ``is_causal``; as
    :class:`Options` (``options=``), or while compiled its fields as plain keywords (the
    operator's handle holds them; :mod:`mpiattn.torch.ops`)."""
    if compiling:  # (its fields, read one by one: the traced graph holds no Options object)
        return {**{f: getattr(mine, f) for f in OPTION_FIELDS}, **given,
                **({"causal": True} if is_causal else {})}
    opts = Options.of(mine, **given)
    return {"options": Options.of(opts, causal=True) if is_causal else opts}
