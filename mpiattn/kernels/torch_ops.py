"""torch's fused attention kernels on one block: the calls, checked, on the same memory.

NumPy arrays in and out on CPU (``torch.from_numpy``: no copy), CuPy arrays on CUDA
(DLPack, on CuPy's current stream). torch is imported lazily (:func:`_torch`), only
when the torch engine is chosen; :mod:`mpiattn.kernels.torch_engine` splits a block
into the calls made here. Private torch ops are not a stable API: each op's schema is
compared with the one recorded here (:data:`_SCHEMAS`) whenever it is fetched, and
:func:`available` says why not. Support is decided by those schemas, not by the
version number: a torch whose ops have the recorded signatures is used.

Findings, torch 2.13.0+cpu (see :data:`TESTED_TORCH` for the versions tested)
------------------------------------------------------------------------------
* CPU ops (schemas in :data:`_SCHEMAS`): ``_scaled_dot_product_flash_attention_for_cpu``
  -> ``(output, logsumexp)`` and ``..._for_cpu_backward`` -> ``(dq, dk, dv)``.
* dtypes: float32, float64, float16, bfloat16 (NumPy's bfloat16 is ``ml_dtypes.bfloat16``,
  handed over as an ``int16`` view and viewed back: :func:`_tensors`, :func:`_host`; CuPy
  has none). Half inputs: the kernel accumulates in float32 within a 512-key
  split, but keeps dq/dk/dv in the half dtype between splits (aten source); so the
  backward here runs in float32 for float16 and bfloat16 inputs (copies of the block's
  operands).
  lse is float32 (float64 for float64 input), natural log, one value per row,
  shape (B, H, n) as a transposed view of a (B, n, H) buffer. out is (B, H, n, E) as a view
  of a (B, n, H, E) buffer; the gradients likewise.
* ``attn_mask``: additive float only (bool is rejected: "Attention mask is the same data
  type as query"); 2-D (n|1, m|1) or 4-D (B|1, H|1, n|1, m|1), size-1 dims broadcast
  (1-D/3-D rejected). The check admits a float32 mask for float64 queries, but the result
  is silently WRONG (lse errors ~7); so the mask is float64 for float64. For float16 and
  bfloat16 a float32 mask is exact (added in float32: errors as without a mask), a half one
  rounds an ALiBi bias (out errors 0.03-0.15): the mask is float32 there (:func:`_setup`).
* ``is_causal``: top-left aligned (key j visible to query i iff j <= i), also for n != m.
* GQA: H != Hkv is accepted natively, query head h uses kv head h // (H // Hkv)
  (repeat_interleave order), forward and backward (dk/dv come summed per kv head); K/V are
  not repeated (profiled: no copy op).
* E != Ev is rejected ("Q/K/V should have the same head size"): the engine zero-pads the
  narrower side to max(E, Ev) (a copy, only in that case).
* Fully masked rows: torch returns out = 0 and lse = 0 (max -inf is replaced by 0 and
  sum 0 by 1), never NaN. We set lse = -inf from the mask. In the backward, lse = -inf with
  a -inf mask gives NaN (exp(-inf + inf)); we pass +inf instead, which makes P = 0.
* Global out/lse in the backward: the kernel computes D = rowsum(dout*out) and
  P = exp(s q k^T + mask - lse) from what it is given, so block backward with the merged
  out/lse is exact (tested: blocks summed == full-sequence gradient).
* Copies (profiled with torch.profiler): the forward copies nothing when q/k/v have a unit
  last stride (other strides, e.g. slices along n, are used as they are); a non-unit last
  stride makes torch clone. The backward copies dout into (B, n, H, Ev) layout (unless dout
  already has that layout or H == 1) and allocates zeroed gradients; out/lse are read
  strided. Our own copies: the float mask (in the mask's compact shape), the backward's lse
  (with -inf -> +inf), padding for E != Ev. Outputs are returned as NumPy views (strided).

CUDA (written, not tested here): float16/bfloat16 without mask (and causal only when
n == m: flash's causal is bottom-right aligned) use ``_scaled_dot_product_flash_attention``;
otherwise ``_scaled_dot_product_efficient_attention`` (float16/bfloat16/float32, causal
top-left, lse padded to 32 rows). Key padding goes in as a compact ``(B, m)`` additive bias
(padded to 16 columns) expanded over heads and queries with stride 0: never a dense
``(B, H, n, m)`` bias (but the score modifiers' bias of one bounded tile, in q's dtype),
and no boolean-mask indexing (CuPy counts its True entries in a C
``int``). float64: not supported. :func:`one_pool` makes CuPy allocate from torch's caching
allocator while the engine runs, so freed blocks are held by one pool, not two.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import backend

#: The torch versions the engine was tested with (informative: the schemas decide). 2.13.0+cpu:
#: the whole suite; 2.11.0+cu130 (the GPU machine's version) and 2.15.0+cu132, on a CPU (the CI's
#: torch_versions lane): the six schemas match and the torch cases of the contract suite pass.
TESTED_TORCH = ("2.13", "2.11", "2.15")
_CPU_F = "_scaled_dot_product_flash_attention_for_cpu"
_SCHEMAS = {
    _CPU_F: "(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False,"
    " *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)",
    _CPU_F + "_backward": "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,"
    " Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None,"
    " float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
    "_scaled_dot_product_flash_attention": "(Tensor query, Tensor key, Tensor value, float"
    " dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, float? scale=None)"
    " -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q,"
    " SymInt max_k, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)",
    "_scaled_dot_product_flash_attention_backward": "(Tensor grad_out, Tensor query, Tensor key,"
    " Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt"
    " max_q, SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, Tensor"
    " philox_offset, *, float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor"
    " grad_value)",
    "_scaled_dot_product_efficient_attention": "(Tensor query, Tensor key, Tensor value, Tensor?"
    " attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *, float?"
    " scale=None) -> (Tensor output, Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)",
    "_scaled_dot_product_efficient_attention_backward": "(Tensor grad_out_, Tensor query, Tensor"
    " key, Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed,"
    " Tensor philox_offset, float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *,"
    " float? scale=None) -> (Tensor, Tensor, Tensor, Tensor)",
}
def _torch() -> Any:
    """Import torch (lazily); ImportError when it is not installed."""
    import torch

    return torch


def _op(name: str) -> Any:
    """``torch.ops.aten.<name>.default``, its schema checked against :data:`_SCHEMAS`."""
    torch = _torch()
    op = getattr(torch.ops.aten, name).default
    got = str(op._schema)
    if got != f"aten::{name}{_SCHEMAS[name]}":
        raise RuntimeError(f"torch {torch.__version__}: op aten::{name} has another signature "
                           f"than the one the torch engine was written for: {got}")
    return op


def available() -> str | None:
    """None when the torch engine can be used on CPU, else a one-line reason."""
    try:
        _op(_CPU_F), _op(_CPU_F + "_backward")
    except ImportError as e:
        return f"torch not importable: {e}"
    except (RuntimeError, AttributeError) as e:
        return str(e).splitlines()[0]
    return None


def _mask(mask: Any, causal: bool, shape: tuple[int, int, int, int], xp: Any = np) -> Any:
    """Compact 4-D bool mask (stride-0 axes cut to size 1), AND causal; None for None."""
    if mask is None:
        return None
    mask = xp.asarray(mask, dtype=bool)
    if mask.ndim > 4 or np.broadcast_shapes(mask.shape, shape) != shape:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to {shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mask = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.strides)]
    if causal:
        mask = mask & (xp.arange(shape[3])[None, :] <= xp.arange(shape[2])[:, None])
    return mask


def _additive(mask: Any, dtype: Any, xp: Any = np, pad_to: int = 1) -> Any:
    """0 / -inf mask in ``dtype``; last axis allocated padded to a multiple of ``pad_to``.

    An elementwise select, never boolean indexing (whose count CuPy keeps in a C int).
    """
    m = mask.shape[-1]
    dt = np.dtype(dtype)
    out = xp.full(mask.shape[:-1] + (-(-m // pad_to) * pad_to,), -np.inf, dtype=dt)[..., :m]
    out[...] = xp.where(mask, dt.type(0), dt.type(-np.inf))
    return out


def _pad(a: Any, d: int, xp: Any = np) -> Any:
    """Zero-pad the last axis of ``a`` to ``d`` (no-op when already ``d``)."""
    if a.shape[-1] == d:
        return a
    out = xp.zeros(a.shape[:-1] + (d,), dtype=a.dtype)
    out[..., : a.shape[-1]] = a
    return out


def _check_shapes(q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int, int, int]:
    B, H, n, E = q.shape
    Bk, Hkv, m, Ek = k.shape
    if (Bk, Hkv, m) != v.shape[:3] or Bk != B or Ek != E or Hkv < 1 or H % Hkv:
        raise ValueError(f"incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError("q, k, v must share one dtype")
    return B, H, Hkv, n, m, E, v.shape[3]


def _is_cupy(a: Any) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def _lse_dtype(q: Any) -> Any:
    return np.float64 if q.dtype == np.float64 else np.float32


def _tensors(*arrays: np.ndarray) -> list[Any]:
    """torch.from_numpy on each array (shares memory; copies only a negative-stride array).

    ``ml_dtypes.bfloat16`` arrays cross as their bits (an ``int16`` view) and become
    ``torch.bfloat16`` tensors on the same memory.
    """
    torch = _torch()

    def one(a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a) if min(a.strides, default=0) < 0 else a
        if backend.is_bfloat16(a.dtype):
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    with warnings.catch_warnings():  # read-only inputs: the kernels never write them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [one(a) for a in arrays]


def _host(t: Any, like: Any) -> np.ndarray:
    """A CPU tensor's NumPy view; bfloat16 viewed back as ``like``'s ``ml_dtypes.bfloat16``."""
    torch = _torch()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(like.dtype)
    return t.numpy()


def _setup(q: Any, k: Any, v: Any, mask: Any, causal: bool, bias: Any = None) -> tuple:
    """Shapes, the additive mask (``mask``, causal and ``bias`` in :func:`_lse_dtype`; None when
    nothing is hidden or added), 'nothing visible', the padded head dim."""
    B, H, Hkv, n, m, E, Ev = _check_shapes(q, k, v)
    dt, shape = _lse_dtype(q), (B, H, n, m)
    if bias is not None and causal and mask is None:
        mask = np.ones((1, 1, 1, 1), dtype=bool)  # with a bias, causal is one more -inf
    bm = _mask(mask, causal, shape)
    add = None if bm is None else _additive(bm, dt)
    if bias is not None:
        bias = np.asarray(bias, dtype=dt)
        if bias.ndim != 4 or np.broadcast_shapes(bias.shape, shape) != shape:
            raise ValueError(f"bias of shape {bias.shape} does not broadcast to {shape}")
        add = bias if add is None else add + bias
    empty = n == 0 or m == 0 or (add is not None and bool(np.isneginf(add).all()))
    return (B, H, n, E, Ev), add, empty, max(E, Ev)


def block_forward(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None,
                  causal_aligned: bool = False, bias: Any = None) -> tuple[Any, Any]:
    """One block of attention, rows normalised, with its log-sum-exp.

    Parameters
    ----------
    q, k, v : arrays (NumPy on CPU, CuPy on CUDA)
        (B, H, n, E), (B, Hkv, m, E), (B, Hkv, m, Ev); H % Hkv == 0, query head h uses
        kv head h // (H // Hkv). float32/float64/float16/bfloat16 on CPU.
    scale : float
        Multiplies q k^T.
    mask : bool array broadcastable to (B, H, n, m), optional
        True = visible. Combined by AND with ``causal_aligned``.
    causal_aligned : bool
        Key j visible to query i iff j <= i (local indices).
    bias : 4-D float array broadcastable to (B, H, n, m), optional
        Added to the scores (``-inf`` hides a pair), on q's device; taken in float32 (float64
        for float64 q: a float32 bias is wrong there, a half one too coarse for ALiBi).

    Returns
    -------
    out : (B, H, n, Ev) array in q's dtype (a strided view of torch's (B, n, H, Ev) buffer)
    lse : (B, H, n) float32 (float64 for float64 input); -inf for rows with no visible key,
        where ``out`` is 0.
    """
    if _is_cupy(q):
        return _cuda_forward(q, k, v, scale, mask, causal_aligned, bias)
    (B, H, n, E, Ev), add, empty, d = _setup(q, k, v, mask, causal_aligned, bias)
    if empty:
        return np.zeros((B, H, n, Ev), q.dtype), np.full((B, H, n), -np.inf, _lse_dtype(q))
    tq, tk, tv = _tensors(_pad(q, d), _pad(k, d), _pad(v, d))
    causal = causal_aligned and add is None  # top-left in the kernel
    tm = None if add is None else _tensors(add)[0]
    o, lse = _op(_CPU_F)(tq, tk, tv, 0.0, causal, attn_mask=tm, scale=float(scale))
    out, lse = _host(o, q)[..., :Ev], lse.numpy()  # views of torch's buffers
    if add is not None:
        hidden = np.isneginf(add).all(axis=-1)  # torch gives these rows out = 0, lse = 0
        if hidden.any():
            np.copyto(lse, -np.inf, where=hidden)
            np.copyto(out, 0, where=hidden[..., None])
    return out, lse


def block_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, scale: float,
                   mask: Any = None, causal_aligned: bool = False,
                   bias: Any = None) -> tuple[Any, Any, Any]:
    """Gradients of one block given the GLOBAL ``out`` and ``lse`` (FlashAttention-2).

    Parameters
    ----------
    dout, out : (B, H, n, Ev) arrays; ``out``/``lse`` of the whole attention, not the block
        (cast to q's dtype if they differ, e.g. a float32 accumulator for float16).
    q, k, v, scale, mask, causal_aligned, bias : as in :func:`block_forward`.
    lse : (B, H, n) array, -inf for rows with no visible key (they get zero gradients).

    Returns
    -------
    dq : (B, H, n, E); dk : (B, Hkv, m, E); dv : (B, Hkv, m, Ev), strided views: in q's
        dtype, float32 for float16 and bfloat16 input. With GQA/MQA the kernel runs one key/value head
        per query head and dk/dv are summed over each head group here, in float64 (the
        kernel's own group sums, in float32, miss the accuracy rule of the contract suite).
    """
    if _is_cupy(q):
        return _cuda_backward(dout, q, k, v, out, lse, scale, mask, causal_aligned, bias)
    (B, H, n, E, Ev), add, empty, d = _setup(q, k, v, mask, causal_aligned, bias)
    Hkv, m = k.shape[1], k.shape[2]
    if empty:
        return tuple(np.zeros(x.shape, q.dtype) for x in (q, k, v))
    half = q.dtype == np.float16 or backend.is_bfloat16(q.dtype)
    work = np.dtype(np.float32) if half else q.dtype  # half gradients: see the module notes
    lse = np.where(np.isneginf(lse), np.inf, lse).astype(_lse_dtype(q))  # +inf: P = 0
    dout, out, q_w, k_w, v_w = (_pad(x.astype(work, copy=False), d) for x in (dout, out, q, k, v))
    G = H // Hkv
    if G > 1:  # one key/value head per query head: the kernel's group sums are done below
        k_w, v_w = np.repeat(k_w, G, axis=1), np.repeat(v_w, G, axis=1)
    tm = None if add is None else _tensors(add)[0]  # in ``work``, as the forward's
    ts = _tensors(dout, q_w, k_w, v_w, out, lse)
    causal = causal_aligned and add is None
    dq, dk, dv = (t.numpy() for t in _op(_CPU_F + "_backward")(*ts, 0.0, causal, attn_mask=tm,
                                                               scale=float(scale)))
    if G > 1:
        dk = dk.reshape(B, Hkv, G, m, d).sum(axis=2, dtype=np.float64)
        dv = dv.reshape(B, Hkv, G, m, d).sum(axis=2, dtype=np.float64)
    return dq[..., :E], dk[..., :E], dv[..., :Ev]


def merge(out: Any, lse: Any, out_c: Any, lse_c: Any) -> None:
    """Merge a block result into (out, lse) in place, overflow- and NaN-safe (NumPy or CuPy).

    lse' = max + log(exp(lse - max) + exp(lse_c - max)); out' = exp(lse - lse') out +
    exp(lse_c - lse') out_c. A side with lse = -inf contributes 0; both -inf: out' = 0,
    lse' = -inf. ``out`` is the accumulator (float32 or float64), ``lse`` float32/64.
    """
    xp = backend.array_module(out)
    mx = xp.maximum(lse, lse_c)
    mx = xp.where(xp.isfinite(mx), mx, 0)
    a, b = xp.exp(lse - mx), xp.exp(lse_c - mx)
    tot = a + b
    with np.errstate(divide="ignore", invalid="ignore"):
        lse[...] = mx + xp.log(tot)
        safe = xp.where(tot > 0, tot, 1)
        a, b = ((x / safe).astype(out.dtype) for x in (a, b))
    out *= a[..., None]
    out += b[..., None] * out_c


# ---------------------------------------------------------------- CUDA (CuPy, DLPack)
def one_pool(xp: Any) -> Any:
    """A context in which CuPy allocates from torch's caching allocator (CUDA), so one pool
    holds the memory of a torch-engine call instead of two (a no-op on NumPy).

    ``cupy.cuda.using_allocator`` is scoped to the block and to this thread: no process-wide
    hook is replaced.
    """
    import contextlib

    if xp is np:
        return contextlib.nullcontext()
    import cupy

    torch = _torch()

    def alloc(size: int) -> Any:
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device=f"cuda:{cupy.cuda.Device().id}")
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel(), t)  # keeps the tensor alive
        return cupy.cuda.MemoryPointer(mem, 0)

    return cupy.cuda.using_allocator(alloc)


def _cuda_call(fn: Any, *arrays: Any) -> list[Any]:
    """Run ``fn(torch, *tensors)`` on CuPy's current stream; results back as CuPy arrays."""
    import cupy

    torch = _torch()
    ptr = cupy.cuda.get_current_stream().ptr
    dev = arrays[0].device.id
    stream = torch.cuda.default_stream(dev) if ptr == 0 else torch.cuda.ExternalStream(ptr, dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        res = fn(torch, *[None if a is None else torch.from_dlpack(a) for a in arrays])
        return [cupy.from_dlpack(t.detach()) for t in res]


def _cuda_plan(q: Any, k: Any, v: Any, mask: Any, causal: bool, bias: Any = None) -> tuple:
    """Shapes, use-flash flag, causal flag for the op, and the padding as a compact additive bias
    ``(B, m)`` in q's dtype (rows padded to 16 columns, the mem-efficient kernel's alignment),
    or None. ``mask`` is the key padding as ``(B, 1, 1, m)`` bool (True = visible): the bias is
    expanded over heads and queries with stride 0, never made dense. A float ``bias`` (one
    call's tile, with neither ``mask`` nor causal) is made dense ``(B, H, n, m)``, padded so."""
    import cupy

    B, H, Hkv, n, m, E, Ev = dims = _check_shapes(q, k, v)
    if q.dtype == np.float64 or E % 8 or Ev % 8:
        raise NotImplementedError("torch engine on CUDA: float16/bfloat16/float32 and head "
                                  "dims multiple of 8 only (use the native engine)")
    flash = q.dtype != np.float32 and mask is None and (not causal or n == m) and E == Ev <= 256
    if bias is not None:
        if mask is not None or causal:
            raise ValueError("the CUDA torch path takes a bias without padding or causal")
        full = cupy.empty((B, H, n, -(-m // 16) * 16), dtype=q.dtype)[..., :m]
        full[...] = bias
        return dims, False, False, full
    if mask is None:
        return dims, flash, causal, None  # flash causal is bottom-right: only n == m above
    if mask.ndim != 4 or mask.shape[1:3] != (1, 1):
        raise ValueError(f"the CUDA torch path takes key padding (B, 1, 1, m), got {mask.shape}")
    keys = cupy.broadcast_to(mask[:, 0, 0, :], (B, m))
    return dims, False, causal, _additive(keys, q.dtype, cupy, pad_to=16)


def _fold(t: Any, g: int) -> Any:
    """(B, Hkv, m, E) -> (B*Hkv, G, m, E) with a stride-0 G axis (no copy)."""
    return t.reshape(-1, 1, *t.shape[2:]).expand(-1, g, *t.shape[2:])


def _cuda_forward(q: Any, k: Any, v: Any, scale: float, mask: Any, causal: bool,
                  bias: Any = None) -> tuple:
    (B, H, Hkv, n, m, E, Ev), flash, causal, bias = _cuda_plan(q, k, v, mask, causal, bias)
    g = H // Hkv

    def run(torch: Any, q: Any, k: Any, v: Any, bias: Any) -> tuple:
        if m == 0 or n == 0:
            return q.new_zeros(B, H, n, Ev), torch.full((B, H, n), -np.inf, device=q.device)
        if flash:  # GQA native (FA2 mha_fwd); lse (B, H, n) float32
            r = _op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)
            return r[0], r[1]
        outs, lses = [], []
        for b0, b1 in _batches(B, Hkv, bias):
            bb = b1 - b0
            r = _op("_scaled_dot_product_efficient_attention")(
                q[b0:b1].reshape(bb * Hkv, g, n, E), _fold(k[b0:b1], g), _fold(v[b0:b1], g),
                _bias_view(bias, b0, b1, Hkv, g, n), True, 0.0, causal, scale=scale)
            outs.append(r[0].reshape(bb, H, n, Ev))
            lses.append(r[1][..., :n].reshape(bb, H, n))  # lse padded to 32
        o, lse = ((x[0] if len(x) == 1 else torch.cat(x)) for x in (outs, lses))
        vis = torch.isfinite(lse) if bias is None else _visible_rows(torch, bias, n, causal)
        return torch.where(vis[..., None], o, 0), torch.where(vis, lse, -np.inf)

    return tuple(_cuda_call(run, q, k, v, bias))


def _batches(B: int, Hkv: int, bias: Any) -> list[tuple[int, int]]:
    """Batch ranges per kernel call: all at once, or one entry at a time when a padding bias
    must be expanded over (Hkv, G) heads folded into one axis (no single stride does that)."""
    if bias is None or bias.ndim == 4 or Hkv == 1 or B == 1:
        return [(0, B)]
    return [(b, b + 1) for b in range(B)]


def _bias_view(bias: Any, b0: int, b1: int, hkv: int, g: int, n: int) -> Any:
    """The compact ``(B, m)`` bias of entries ``b0:b1`` as ``((b1-b0)*hkv, g, n, m)``, stride 0
    over heads and queries (a view: nothing dense is made)."""
    if bias is None or bias.ndim == 4:  # a dense (B, H, n, m) bias: H splits as (hkv, g)
        return None if bias is None else bias[b0:b1].reshape((b1 - b0) * hkv, g, n, -1)
    part = bias[b0:b1]
    bb, m = part.shape
    if bb == 1:
        return part.reshape(1, 1, 1, m).expand(hkv, g, n, m)
    return part.reshape(bb, 1, 1, m).expand(bb, g, n, m)  # hkv == 1 here


def _visible_rows(torch: Any, bias: Any, n: int, causal: bool) -> Any:
    """``(B, 1, n)`` bool: the query rows that see some key under the padding (and causal);
    ``(B, H, n)`` for a dense bias."""
    if bias.ndim == 4:
        return (bias > -np.inf).any(-1)
    keys = bias > -np.inf                                           # (B, m)
    if not causal:
        return keys.any(-1)[:, None, None].expand(-1, 1, n)
    first = torch.where(keys.any(-1), keys.int().argmax(-1), keys.shape[-1])  # first visible key
    return (torch.arange(n, device=bias.device)[None, :] >= first[:, None])[:, None, :]


def _cuda_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                   mask: Any, causal: bool, bias: Any = None) -> tuple:
    (B, H, Hkv, n, m, E, Ev), flash, causal, bias = _cuda_plan(q, k, v, mask, causal, bias)
    g = H // Hkv

    def run(torch: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, bias: Any) -> tuple:
        if m == 0 or n == 0:
            return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        do, o = do.to(q.dtype), o.to(q.dtype)
        lse = torch.where(torch.isneginf(lse), np.inf, lse.float())  # +inf: P = 0, no NaN
        if flash:
            u64 = dict(dtype=torch.uint64, device=q.device)  # philox: unused without dropout
            return _op("_scaled_dot_product_flash_attention_backward")(
                do, q, k, v, o, lse.contiguous(), None, None, n, m, 0.0, causal,
                torch.zeros(2, **u64), torch.zeros((), **u64), scale=scale)
        lp = torch.full((B * H, -(-n // 32) * 32), np.inf, device=q.device)
        lp[:, :n] = lse.reshape(B * H, n)
        i64 = dict(dtype=torch.int64, device=q.device)
        lp = lp.view(B, Hkv, g, -1)
        grads = []
        for b0, b1 in _batches(B, Hkv, bias):
            bb = b1 - b0
            dq, dk, dv, _ = _op("_scaled_dot_product_efficient_attention_backward")(
                do[b0:b1].reshape(bb * Hkv, g, n, Ev), q[b0:b1].reshape(bb * Hkv, g, n, E),
                _fold(k[b0:b1], g), _fold(v[b0:b1], g), _bias_view(bias, b0, b1, Hkv, g, n),
                o[b0:b1].reshape(bb * Hkv, g, n, Ev), lp[b0:b1].reshape(bb * Hkv, g, -1),
                torch.zeros((), **i64), torch.zeros((), **i64), 0.0, [True, True, True, False],
                causal, scale=scale)
            grads.append((dq.reshape(bb, H, n, E), dk.reshape(bb, Hkv, g, m, E).sum(2),
                          dv.reshape(bb, Hkv, g, m, Ev).sum(2)))
        return tuple(x[0] if len(x) == 1 else torch.cat(x) for x in zip(*grads))

    return tuple(_cuda_call(run, dout, q, k, v, out, lse, bias))
