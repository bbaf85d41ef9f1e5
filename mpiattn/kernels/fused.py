"""Fused CuPy kernels for the elementwise passes of blocked attention.

:mod:`mpiattn.kernels` writes each step of the online softmax as generic
array code: on a GPU every step is a kernel that reads (and often writes)
the whole score tile, so for head dimensions of 64-128 those passes, not
the GEMMs, bound the speed. The functions here do the same arithmetic in
fewer passes. Each takes NumPy or CuPy arrays: on NumPy it runs the generic
version in :data:`generic`, on CuPy the fused kernel, compiled on first use.
:mod:`mpiattn.kernels.native` calls them when a call asks for them
(``MPIATTN_FUSED_KERNELS=1``, read once per call and agreed by every rank).
They are opt-in until ``jobs/gpu_check.sh`` has compared them with the
generic code on a real GPU (no session so far had one).

Shapes: ``S``, ``P``, ``dP`` are score tiles ``(..., r, k)`` (``r`` query
rows, ``k`` keys), C-contiguous where noted; per-row arrays ``m``, ``l``,
``alpha``, ``rowsum``, ``lse``, ``D`` are ``(..., r)`` and may be strided
views (as ``st.m[..., r0:r1]`` in :func:`mpiattn.kernels.native.forward_block`);
``O``, ``PV`` are ``(..., r, Ev)``. float32 or float64, all of one dtype.

Masked scores are ``-inf``. A row whose running maximum is ``-inf`` (it has
seen no key) uses shift 0, so its probabilities are exactly 0 and its
rescale factor ``alpha = exp(m_old - shift)`` is 0, never NaN.

Forward, per tile (replaces the lines from ``m_new = ...`` to ``o += ...``)::

    alpha = softmax_step_(S, m, l)          # S <- P, m <- m', l <- alpha l + rowsum P
    rescale_add_(o, alpha, S @ v)           # o <- alpha o + P V

(Only the forward pass has fused kernels: the backward's elementwise work
per score is one exp and one multiply, already folded around its GEMMs.)
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from .. import backend

__all__ = ["softmax_step_", "rescale_add_", "generic"]


# ------------------------------------------------------------------- generic
def _shift(xp: Any, m: Any) -> Any:
    return xp.where(xp.isneginf(m), m.dtype.type(0), m)


def _ref_softmax_step_(S: Any, m: Any, l: Any) -> Any:
    xp = backend.array_module(S)
    m_new = xp.maximum(m, S.max(axis=-1))
    shift = _shift(xp, m_new)
    S -= shift[..., None]
    xp.exp(S, out=S)
    alpha = xp.exp(m - shift)
    l *= alpha
    l += S.sum(axis=-1)
    m[...] = m_new
    return alpha


def _ref_rescale_add_(O: Any, alpha: Any, PV: Any) -> None:
    O *= alpha[..., None]
    O += PV


#: The generic (any-backend) versions, same signatures, for checks and NumPy.
generic = types.SimpleNamespace(softmax_step_=_ref_softmax_step_, rescale_add_=_ref_rescale_add_)


# ------------------------------------------------------------------- kernels
_ROWS_SRC = r"""
typedef %(T)s T;
#define EXP %(EXP)s
#define NEG_INF %(NEG_INF)s

__device__ inline T vmax(T a, T b) { return (b > a || b != b) ? b : a; }  // NaN wins, as numpy.maximum

__device__ T block_reduce(T v, bool is_max, T* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? vmax(v, w) : v + w;
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? red[lane] : (is_max ? NEG_INF : (T)0);
        for (int o = 16; o > 0; o >>= 1) {
            T w = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? vmax(v, w) : v + w;
        }
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    v = red[0];
    __syncthreads();
    return v;
}

// One block per row of S (rows x k, C-contiguous). m_in is the running max;
// m' = max(m_in, rowmax S) goes to m_out, exp(m_in - shift) to alpha,
// S <- exp(S - shift), rowsum <- sum of it; shift = m' or 0 when m' = -inf.
extern "C" __global__ void softmax_rows(T* S, const T* m_in, T* m_out, T* alpha, T* rowsum,
                                        long long k) {
    __shared__ T red[32];
    T* s = S + (long long)blockIdx.x * k;
    T m_old = m_in[blockIdx.x];
    T mx = NEG_INF;
    for (long long j = threadIdx.x; j < k; j += blockDim.x) mx = vmax(mx, s[j]);
    T m_new = vmax(m_old, block_reduce(mx, true, red));
    T shift = (m_new == NEG_INF) ? (T)0 : m_new;
    T sum = 0;
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
        T e = EXP(s[j] - shift);
        s[j] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, red);
    if (threadIdx.x == 0) {
        rowsum[blockIdx.x] = sum;
        m_out[blockIdx.x] = m_new;
        alpha[blockIdx.x] = EXP(m_old - shift);
    }
}
"""

_TYPES = {
    "float32": {"T": "float", "EXP": "expf", "NEG_INF": "__int_as_float(0xff800000)"},
    "float64": {"T": "double", "EXP": "exp", "NEG_INF": "__longlong_as_double(0xfff0000000000000LL)"},
}
_CACHE: dict[Any, Any] = {}


def _rows_kernel(cp: Any, dtype: np.dtype) -> Any:
    key = ("rows", dtype.name)
    if key not in _CACHE:
        _CACHE[key] = cp.RawKernel(_ROWS_SRC % _TYPES[dtype.name], "softmax_rows")
    return _CACHE[key]


def _elementwise(cp: Any, name: str) -> Any:
    if name not in _CACHE:
        spec = {
            "scale_add": ("T a, T pv", "T o", "o = a * o + pv"),
            "axpy": ("T a, T r", "T l", "l = a * l + r"),
        }[name]
        _CACHE[name] = cp.ElementwiseKernel(*spec, name=f"mpiattn_{name}")
    return _CACHE[name]


def _check(S: Any, *rows: Any) -> np.dtype:
    dt = np.dtype(S.dtype)
    if dt.name not in _TYPES:
        raise TypeError(f"fused kernels take float32 or float64 scores, got {dt}")
    if not S.flags.c_contiguous:
        raise ValueError("the score tile must be C-contiguous")
    for x in rows:
        if x.shape != S.shape[:-1] or x.dtype != dt:
            raise ValueError(f"per-row array {x.shape} {x.dtype} does not match scores {S.shape} {dt}")
    return dt


def _launch_rows(S: Any, m_in: Any) -> tuple[Any, Any, Any]:
    cp = backend.array_module(S)
    dt = np.dtype(S.dtype)
    k = S.shape[-1] if S.ndim else 1
    m_in = cp.ascontiguousarray(m_in)
    rowsum = cp.empty(m_in.shape, dtype=dt)
    m_out = cp.empty(m_in.shape, dtype=dt)
    alpha = cp.empty(m_in.shape, dtype=dt)
    rows = int(m_in.size)
    if rows:
        threads = 128 if k <= 1024 else 256
        _rows_kernel(cp, dt)((rows,), (threads,), (S, m_in, m_out, alpha, rowsum, np.int64(k)))
    return m_out, alpha, rowsum


def softmax_step_(S: Any, m: Any, l: Any) -> Any:
    """One online-softmax step on a score tile, in place; returns the rescale factors.

    ``m' = max(m, rowmax S)``; ``S <- exp(S - m')``; ``alpha = exp(m - m')``;
    ``l <- alpha l + rowsum S``; ``m <- m'`` (shift 0 where ``m' = -inf``).

    Parameters
    ----------
    S : (..., r, k) float32/float64, C-contiguous
        Scores (masked entries -inf); overwritten by the probabilities.
    m, l : (..., r), same dtype
        Running maximum and sum, updated in place (may be strided views).

    Returns
    -------
    alpha : (..., r)
        Multiply the running output by it (:func:`rescale_add_`).

    Notes
    -----
    CuPy: one kernel reads the tile twice (the second read mostly from L2)
    and writes it once; the generic code makes about six passes.
    """
    if backend.array_module(S) is np:
        return _ref_softmax_step_(S, m, l)
    _check(S, m, l)
    cp = backend.array_module(S)
    m_new, alpha, rowsum = _launch_rows(S, m)
    _elementwise(cp, "axpy")(alpha, rowsum, l)
    m[...] = m_new
    return alpha


def rescale_add_(O: Any, alpha: Any, PV: Any) -> None:
    """``O <- alpha[..., None] O + PV`` in place, one pass over ``O``.

    Parameters
    ----------
    O, PV : (..., r, Ev)
    alpha : (..., r)
    """
    xp = backend.array_module(O)
    if xp is np:
        return _ref_rescale_add_(O, alpha, PV)
    _elementwise(xp, "scale_add")(alpha[..., None], PV, O)
    return None
