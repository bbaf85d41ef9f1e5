"""Multi-head attention layer on sequence-sharded rows, with hand-derived gradients.

:class:`MultiheadAttention` wraps :func:`mpiattn.attention` with the four
projections of a transformer attention block::

    Q = x_q W_q + b_q        (B, n_r, E)      -> heads (B, H,   n_r, D)
    K = x_k W_k + b_k        (B, m_r, Hkv*D)  -> heads (B, Hkv, m_r, D)
    V = x_v W_v + b_v        (B, m_r, Hkv*D)  -> heads (B, Hkv, m_r, D)
    O = attention(Q, K, V)   (B, H, n_r, D)   -> concat (B, n_r, E)
    y = O W_o + b_o          (B, n_r, E)

with ``D = E // H``; the last axis of a projection splits as ``(heads, D)``
in that order; query head ``h`` reads key/value head ``h // (H // Hkv)``
(grouped-query attention when ``Hkv < H``). The scale is ``1 / sqrt(D)``.

Every rank holds its own rows of the inputs and the same (replicated)
parameters. The projections are row-local, so the only communication is
inside the attention call (forward and backward) and one allreduce of the
packed parameter gradients in :meth:`MultiheadAttention.backward`.

Gradients (derived by hand from ``C = A B`` : ``dA = dC B^T``,
``dB = A^T dC``; rows summed over ``B`` and ``n_r``, then over ranks)::

    dW_o = O^T dy            db_o = sum_rows dy          dO = dy W_o^T
    dQ, dK, dV = attention_backward(dO, ...)
    dW_q = x_q^T dQ          db_q = sum_rows dQ          dx_q = dQ W_q^T
    dW_k = x_k^T dK          db_k = sum_rows dK          dx_k = dK W_k^T
    dW_v = x_v^T dV          db_v = sum_rows dV          dx_v = dV W_v^T

For self-attention (``x_q = x_k = x_v``) the three input gradients add up.
``db_k`` is zero up to rounding: ``b_k`` shifts every score of a query row
by the same amount, which the softmax ignores (kept for the usual API).

Precision: parameters and activations are in the layer dtype; projections
and parameter gradients accumulate in float32 for float16/float32 layers
and in float64 for float64 layers (float16 layers keep float32 gradients).
"""

from __future__ import annotations

import math
import os
from types import ModuleType
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import get_comm
from ..strategies import AttentionPlan, attention, attention_backward
from ..strategies.plan import reuse_or_plan
from . import saving
from .projections import linear, merge_heads, split_heads

__all__ = ["MultiheadAttention"]


def _resolve_module(device: Any) -> ModuleType:
    """``numpy``/``cupy`` from a module or one of the names numpy, cpu, cupy, gpu."""
    if isinstance(device, ModuleType) and device.__name__ in ("numpy", "cupy"):
        return device
    if device in ("numpy", "cpu"):
        return np
    if device in ("cupy", "gpu", "cuda"):
        import cupy  # the GPU was asked for

        return cupy
    raise ValueError(f"unknown device {device!r}; expected 'numpy'/'cpu', 'cupy'/'gpu', or the module")


class MultiheadAttention:
    """Multi-head (grouped-query) attention over rows sharded across MPI ranks.

    Parameters
    ----------
    embed_dim : int
        Model width ``E`` (query input, output, and the query projection).
    num_heads : int
        Query heads ``H``; must divide ``embed_dim``. ``D = E // H``.
    num_kv_heads : int, optional
        Key/value heads ``Hkv`` (default ``H``); must divide ``H``.
    kdim, vdim : int, optional
        Widths of the key and value inputs (default ``embed_dim``).
    bias : bool
        Whether the four projections have biases.
    dtype : {numpy.float16, numpy.float32, numpy.float64}
        Dtype of the parameters and of the inputs the layer accepts.
    seed : int
        Seed of the initial parameters. The same seed gives the same
        parameters on every rank whatever the number of ranks.

    Attributes
    ----------
    params : dict of str -> array
        ``wq`` (E, E), ``wk`` (kdim, Hkv*D), ``wv`` (vdim, Hkv*D),
        ``wo`` (E, E) and, with ``bias``, ``bq`` (E,), ``bk`` (Hkv*D,),
        ``bv`` (Hkv*D,), ``bo`` (E,); in the layer dtype, replicated on every
        rank, NumPy arrays until :meth:`to` moves them. Optimisers update them
        in place (or assign arrays of the same shape, dtype and device).
    grads : dict of str -> array
        The gradients of the loss with respect to ``params`` (same keys and
        shapes; float32 for float16/float32 layers, float64 for float64),
        summed over ranks and identical on every rank. Zeros until the first
        :meth:`backward`, which overwrites them (no accumulation); they are
        views into one flat buffer.

    Notes
    -----
    Initial values: ``numpy.random.default_rng(seed)`` draws, in float64 and
    in the order ``wq, wk, wv, wo``, Xavier-uniform weights
    ``U(-a, a)``, ``a = sqrt(6 / (fan_in + fan_out))``; biases start at zero.

    Memory kept by :meth:`forward` for :meth:`backward` (per rank, layer
    dtype): references to the inputs (not copies: do not modify them in
    place before ``backward``), ``Q`` and the attention output
    (``B * n_r * E`` each), ``K`` and ``V`` (``B * m_r * Hkv * D`` each) and
    the log-sum-exp ``B * H * n_r`` (float32/float64). :meth:`backward`
    releases it.

    Cost per rank on top of the attention (see :func:`mpiattn.attention`):
    forward ``2 * B * (n_r * E * 2E + m_r * Hkv*D * (kdim + vdim))`` FLOPs,
    backward twice that; communication in backward: one allreduce of
    ``2E^2 + Hkv*D*(kdim + vdim)`` (+ biases) words.

    Examples
    --------
    >>> import numpy as np, mpiattn
    >>> layer = mpiattn.MultiheadAttention(8, 2, seed=0)
    >>> x_r = mpiattn.shard(np.ones((1, 5, 8), np.float32), axis=1)   # this rank's rows
    >>> y = layer.forward(x_r, causal=True)
    >>> dx, _, _ = layer.backward(np.ones_like(y))
    >>> y.shape, layer.grads["wq"].shape
    ((1, 5, 8), (8, 8))
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 kdim: int | None = None, vdim: int | None = None, bias: bool = True,
                 dtype: Any = np.float32, seed: int = 0):
        E, H = _positive_int(embed_dim, "embed_dim"), _positive_int(num_heads, "num_heads")
        Hkv = H if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads")
        if E % H:
            raise ValueError(f"embed_dim {E} is not divisible by num_heads {H}")
        if H % Hkv:
            raise ValueError(f"num_heads {H} is not divisible by num_kv_heads {Hkv}")
        self.embed_dim, self.num_heads, self.num_kv_heads = E, H, Hkv
        self.head_dim = E // H
        self.kdim = E if kdim is None else _positive_int(kdim, "kdim")
        self.vdim = E if vdim is None else _positive_int(vdim, "vdim")
        self.bias = bool(bias)
        self.dtype = backend.check_dtype(dtype, "MultiheadAttention")
        self.grad_dtype = backend.accum_dtype(self.dtype)
        self.seed = int(seed)
        self._xp: ModuleType = np
        self.params = self._init_params()
        self._cache: dict | None = None
        self._comm = None  # the communicator of the last forward
        self._plan: AttentionPlan | None = None  # the attention call of the last forward, planned
        self.grads = self._unpack(np.zeros(self._grad_size(), dtype=self.grad_dtype))

    # ---------------------------------------------------------------- layout
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the parameters, in packing order."""
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        shapes = {"wq": (E, E), "wk": (self.kdim, kv), "wv": (self.vdim, kv), "wo": (E, E)}
        if self.bias:
            shapes.update(bq=(E,), bk=(kv,), bv=(kv,), bo=(E,))
        return shapes

    def _grad_size(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    def _unpack(self, buf: Any) -> dict[str, Any]:
        out, off = {}, 0
        for name, shape in self.param_shapes().items():
            size = math.prod(shape)
            out[name] = buf[off:off + size].reshape(shape)
            off += size
        return out

    def _init_params(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        params = {}
        for name, (fan_in, fan_out) in list(self.param_shapes().items())[:4]:
            a = math.sqrt(6.0 / (fan_in + fan_out))
            params[name] = rng.uniform(-a, a, size=(fan_in, fan_out)).astype(self.dtype)
        for name, shape in list(self.param_shapes().items())[4:]:
            params[name] = np.zeros(shape, dtype=self.dtype)
        return params

    @property
    def xp(self) -> ModuleType:
        """The array module (numpy or cupy) the parameters live in."""
        return self._xp

    def to(self, device: Any) -> "MultiheadAttention":
        """Move parameters and gradients to ``device``; returns ``self``.

        Parameters
        ----------
        device : {"numpy", "cpu", "cupy", "gpu"} or the numpy/cupy module
            Where the inputs of later calls live. CuPy is imported only here,
            when asked for.
        """
        xp = _resolve_module(device)
        if xp is self._xp:
            return self
        move = (lambda a: backend.to_host(a)) if xp is np else (lambda a: xp.asarray(a))
        self.params = {k: move(v) for k, v in self.params.items()}
        flat = xp.zeros(self._grad_size(), dtype=self.grad_dtype)
        for k, g in self._unpack(flat).items():
            g[...] = move(self.grads[k])
        self.grads = self._unpack(flat)
        self._xp, self._cache = xp, None
        return self

    def __repr__(self) -> str:
        return (f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"bias={self.bias}, dtype={self.dtype.name}, seed={self.seed}, device={self._xp.__name__})")

    # --------------------------------------------------------------- forward
    def forward(self, query: Any, key: Any = None, value: Any = None, comm: Any = None, *,
                key_padding_mask: Any = None, segment_ids: Any = None, kv_segment_ids: Any = None,
                **options: Any) -> Any:
        """Attention output for this rank's query rows.

        Parameters
        ----------
        query : array, shape (B, n_r, embed_dim)
            This rank's query rows (global length N, rows laid out by ``layout``).
        key : array, shape (B, m_r, kdim), optional
            This rank's key rows (global length M). ``key`` and ``value``
            both None means self-attention on ``query`` (then ``kdim`` and
            ``vdim`` must equal ``embed_dim``).
        value : array, shape (B, m_r, vdim), optional
            This rank's value rows.
        comm : mpi4py.MPI.Intracomm, optional
            Communicator (default ``MPI.COMM_WORLD``).
        key_padding_mask : bool array, shape (B, m_r), optional
            True marks padding keys (never attended).
        segment_ids, kv_segment_ids
            Document ids ``(B, n_r)``, ``(B, m_r)``, as in :func:`mpiattn.attention`.
        **options
            :class:`mpiattn.Options` fields (``causal``, ``window``, ``layout``,
            ``kv_layout``, ``strategy``, ``engine``, ``block_size``, ...) or
            ``options=``, passed to :func:`mpiattn.attention` and its
            backward; ``scale`` defaults to ``1/sqrt(head_dim)``.

        Returns
        -------
        array, shape (B, n_r, embed_dim)
            In the layer dtype, on the layer's device. Query rows that see no
            key (all masked) get ``b_o``.
        """
        c = self._comm = get_comm(comm)
        self_attn = key is None and value is None
        with c.collective_errors():
            self._check_inputs(query, key, value, self_attn)
        xk = query if self_attn else key
        xv = query if self_attn else value
        self._cache = None  # a failed call must not leave a stale cache behind
        opts = dict(options, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
                    kv_segment_ids=kv_segment_ids)
        with c.abort_on_error():  # a rank failing here would leave the others in attention()
            p, acc, dt = self.params, self.grad_dtype, self.dtype
            B, n, m = query.shape[0], query.shape[1], xk.shape[1]
            q2 = query.reshape(B * n, self.embed_dim)
            k2, v2 = xk.reshape(B * m, self.kdim), xv.reshape(B * m, self.vdim)
            Q = split_heads(linear(q2, p["wq"], p.get("bq"), acc), B, n, self.num_heads, dt)
            K = split_heads(linear(k2, p["wk"], p.get("bk"), acc), B, m, self.num_kv_heads, dt)
            V = split_heads(linear(v2, p["wv"], p.get("bv"), acc), B, m, self.num_kv_heads, dt)
        out, lse = self._attend(c, Q, K, V, key_padding_mask, segment_ids, kv_segment_ids, options)
        with c.abort_on_error():
            y2 = linear(merge_heads(out), p["wo"], p.get("bo"), acc)
            y = y2.astype(dt, copy=False).reshape(B, n, self.embed_dim)
        plan = self._plan if segment_ids is None and kv_segment_ids is None else None
        self._cache = dict(q2=q2, k2=k2, v2=v2, Q=Q, K=K, V=V, out=out, lse=lse, opts=opts,
                           plan=plan, self_attn=self_attn, shape=(B, n, self.embed_dim), m=m)
        return y

    def _attend(self, c: Any, Q: Any, K: Any, V: Any, mask: Any, segment_ids: Any,
                kv_segment_ids: Any, options: dict) -> tuple[Any, Any]:
        """The attention of a forward: through the plan of the previous call when every rank's
        arrays and options fit it (one small agreement), else through a new plan; calls with
        document ids are one-shot (a plan keeps its documents)."""
        if segment_ids is not None or kv_segment_ids is not None:
            return attention(Q, K, V, c, key_padding_mask=mask, segment_ids=segment_ids,
                             kv_segment_ids=kv_segment_ids, **options)
        plan = self._plan = reuse_or_plan(self._plan, Q, K, V, c, key_padding_mask=mask, **options)
        return plan.run_forward(Q, K, V, mask, None)

    __call__ = forward

    def _check_inputs(self, query: Any, key: Any, value: Any, self_attn: bool) -> None:
        if query is None:
            raise TypeError("query must be an array of shape (B, n_r, embed_dim), got None")
        xp = backend.array_module(query, key, value)
        if xp is not self._xp:
            raise TypeError(f"the layer's parameters live in {self._xp.__name__} but the inputs are "
                            f"{xp.__name__} arrays; call layer.to({xp.__name__!r}) first")
        if (key is None) != (value is None):
            raise ValueError("pass both key and value (cross-attention) or neither (self-attention)")
        _check_array(query, "query", self.embed_dim, "embed_dim", self.dtype)
        self._check_params()
        if self_attn:
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(f"self-attention (key and value None) needs kdim == vdim == embed_dim, "
                                 f"but this layer has kdim={self.kdim}, vdim={self.vdim}, "
                                 f"embed_dim={self.embed_dim}")
            return
        _check_array(key, "key", self.kdim, "kdim", self.dtype)
        _check_array(value, "value", self.vdim, "vdim", self.dtype)
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same "
                             "batch size and number of rows")
        if key.shape[0] != query.shape[0]:
            raise ValueError(f"query has batch size {query.shape[0]} but key has {key.shape[0]}")

    def _check_params(self) -> None:
        """Parameters an optimiser replaced must keep their names, shapes, dtype and device."""
        want = self.param_shapes()
        if set(self.params) != set(want):
            raise ValueError(f"layer.params has keys {sorted(self.params)}; expected {sorted(want)}")
        for name, shape in want.items():
            w = self.params[name]
            if backend.array_module(w) is not self._xp or tuple(w.shape) != shape or w.dtype != self.dtype:
                raise TypeError(f"layer.params[{name!r}] must be a {self._xp.__name__} array of shape "
                                f"{shape} and dtype {self.dtype}; got {type(w).__module__} "
                                f"{tuple(w.shape)} {w.dtype}")

    # -------------------------------------------------------------- backward
    def backward(self, dy: Any) -> tuple[Any, Any, Any]:
        """Input gradients for this rank's rows; fills :attr:`grads`.

        Collective: every rank that called :meth:`forward` must call it.

        Parameters
        ----------
        dy : array, shape (B, n_r, embed_dim)
            Gradient of the loss with respect to this rank's output rows.

        Returns
        -------
        d_query : array, shape (B, n_r, embed_dim)
            For self-attention, the sum of the query, key and value paths.
        d_key : array, shape (B, m_r, kdim), or None for self-attention
        d_value : array, shape (B, m_r, vdim), or None for self-attention
            In the layer dtype. :attr:`grads` receives the parameter
            gradients summed over all ranks (one allreduce of a packed buffer),
            the same on every rank.
        """
        cache = self._cache
        c = self._comm if self._comm is not None else get_comm(None)
        with c.collective_errors():
            if cache is None:
                raise RuntimeError("backward() needs a forward() first (each forward allows one backward)")
            if backend.array_module(dy) is not self._xp:
                raise TypeError(f"dy must be a {self._xp.__name__} array like the layer's parameters")
            if tuple(dy.shape) != cache["shape"]:
                raise ValueError(f"dy has shape {tuple(dy.shape)}; the forward output had {cache['shape']}")
            if np.dtype(dy.dtype) != self.dtype:
                raise TypeError(f"dy has dtype {np.dtype(dy.dtype)}; the layer computes in {self.dtype}")
        self._cache = None
        xp, p, acc, dt = self._xp, self.params, self.grad_dtype, self.dtype
        B, n, E = cache["shape"]
        m = cache["m"]
        with c.abort_on_error():  # local work between collectives: no rank may stop alone
            flat = xp.empty(self._grad_size(), dtype=acc)
            g = self._unpack(flat)
            dy2 = dy.reshape(B * n, E).astype(acc, copy=False)
            xp.matmul(merge_heads(cache["out"]).astype(acc, copy=False).T, dy2, out=g["wo"])
            dO = split_heads(dy2 @ p["wo"].astype(acc, copy=False).T, B, n, self.num_heads, dt)
        if cache["plan"] is not None:
            dQ, dK, dV = cache["plan"].run_backward(dO, cache["Q"], cache["K"], cache["V"],
                                                    cache["out"], cache["lse"],
                                                    cache["opts"]["key_padding_mask"], None)
        else:
            dQ, dK, dV = attention_backward(dO, cache["Q"], cache["K"], cache["V"], cache["out"],
                                            cache["lse"], c, **cache["opts"])
        with c.abort_on_error():
            dQ2 = merge_heads(dQ).astype(acc, copy=False)
            dK2 = merge_heads(dK).astype(acc, copy=False)
            dV2 = merge_heads(dV).astype(acc, copy=False)
            for name, x2, d2 in (("q", cache["q2"], dQ2), ("k", cache["k2"], dK2), ("v", cache["v2"], dV2)):
                xp.matmul(x2.astype(acc, copy=False).T, d2, out=g["w" + name])
            if self.bias:
                for name, d2 in (("q", dQ2), ("k", dK2), ("v", dV2), ("o", dy2)):
                    d2.sum(axis=0, out=g["b" + name])
            c.allreduce_(flat)
            self.grads = g
            d_query = dQ2 @ p["wq"].astype(acc, copy=False).T
            d_key = dK2 @ p["wk"].astype(acc, copy=False).T
            d_value = dV2 @ p["wv"].astype(acc, copy=False).T
            if cache["self_attn"]:
                d_query += d_key
                d_query += d_value
                return d_query.astype(dt, copy=False).reshape(B, n, E), None, None
            return (d_query.astype(dt, copy=False).reshape(B, n, E),
                    d_key.astype(dt, copy=False).reshape(B, m, self.kdim),
                    d_value.astype(dt, copy=False).reshape(B, m, self.vdim))

    # ----------------------------------------------------------------- HDF5
    def save(self, path: str | os.PathLike, comm: Any = None) -> None:
        """Write the configuration and parameters to an HDF5 file (collective).

        Rank 0 writes through a temporary file that is renamed into place
        (:func:`mpiattn.io.save_params`), so a crash never leaves a
        half-written file under ``path``. Every rank returns once the file is
        complete, so any rank may :meth:`load` it right after. Parameters are
        taken from rank 0 (they are replicated).

        Layout: root attributes ``format`` (``"mpiattn.MultiheadAttention"``),
        ``format_version``, ``embed_dim``, ``num_heads``, ``num_kv_heads``,
        ``kdim``, ``vdim``, ``bias``, ``dtype``, ``seed``; one dataset per
        parameter under group ``params``.
        """
        saving.save(self, path, comm)

    @classmethod
    def load(cls, path: str | os.PathLike, comm: Any = None) -> "MultiheadAttention":
        """Read a layer written by :meth:`save` (collective; every rank reads the file).

        Returns a layer with NumPy parameters (call :meth:`to` to move them).

        Raises
        ------
        FileNotFoundError, ValueError
            On every rank, when the file is missing, is not a saved layer, or a
            parameter has the wrong shape or dtype.
        """
        return saving.load(cls, path, comm)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _check_array(x: Any, what: str, width: int, width_name: str, dtype: np.dtype) -> None:
    if x.ndim != 3 or x.shape[2] != width:
        raise ValueError(f"{what} must have shape (B, rows, {width_name}={width}), got {tuple(x.shape)}")
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{what} has dtype {np.dtype(x.dtype)}, but the layer computes in {dtype}; "
                        f"cast the input or build the layer with dtype={dtype.name}")
