"""Fused CuPy kernels for the elementwise work of a score tile, forward and backward.

On a GPU each line of array code is a kernel that reads (and often writes)
the whole score tile. The native engine's device path
(:mod:`mpiattn.kernels.native_cuda`) runs a tile as GEMMs through
:func:`mpiattn.gemm.matmul` and, in the ``fused`` engine
(:class:`mpiattn.kernels.native_engine.FusedEngine`, chosen by name), one
kernel for everything in between:

forward, per tile: 3 launches::

    S = scale Q K^T                          (GEMM, float32 out)
    softmax_fwd_(S, P, m, l, O, ...)         (1 kernel, below)
    O += P V                                 (GEMM with beta = 1)

backward, per tile: 6 launches::

    S = scale Q K^T;  dP = dO V^T            (2 GEMMs, float32 out)
    softmax_bwd_(S, dP, P, dS, lse, D, ...)  (1 kernel, below)
    dV += P^T dO;  dQ += scale dS K;  dK += scale dS^T Q   (3 GEMMs, beta = 1)

Each kernel has an array-code twin in :data:`generic` with the same
arguments and arithmetic: the device path's generic branch (the ``native``
engine) runs them, and the tests compare the two.
Kernels are compiled with NVRTC on first use (CuPy caches them on disk:
``CUPY_CACHE_DIR``); they are opt-in until a GPU run of
``jobs/gpu_check.sh`` has compared them with the generic code.

Arguments (shared by both forms)
--------------------------------
``S`` (and ``dP``): the score tile ``(BH, R, K)`` in float32/float64 with a
row stride ``ld >= K`` (the tile buffer may be padded so that every row
starts 16-byte aligned): pass the ``(BH, R, K)`` view. ``P``, ``dS``: the
same shape in the GEMM operand dtype (float16 for float16 inputs; may be
``S``/``dP`` themselves when the dtypes match). Per-row arrays ``m``,
``l``, ``lse``, ``D``: ``(BH, R)`` views with unit stride along rows (e.g.
``st.m[..., r0:r1]`` reshaped); ``O``: ``(BH, R, Ev)`` with unit stride
along its last axis. ``bias``: the keys' padding as an additive ``(B, K)``
bias (0 or -inf; row ``bh`` uses batch entry ``bh // hkv``) or None.
``band``: ``(q0, k0, lo, hi, group)`` or None: key ``k0 + j`` is visible to
folded row ``r`` (query ``q0 + r // group``) only when ``lo <= (k0 + j) -
(q0 + r // group) <= hi`` (causal and window rules of a tile whose
positions are consecutive). Masked scores are ``-inf``; a row whose maximum
is still ``-inf`` uses shift 0, so its probabilities and its ``alpha`` are 0,
never NaN; rows with ``lse = -inf`` get ``P = 0`` in the backward.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from .. import backend

__all__ = ["softmax_fwd_", "softmax_bwd_", "generic", "BIG"]

#: Stands in for an unbounded side of a band (as a 64-bit integer).
BIG = 1 << 62


# ------------------------------------------------------------------- generic
def _band_mask(xp: Any, band: Any, R: int, K: int) -> Any:
    """``(R, K)`` bool: visible under the band ``(q0, k0, lo, hi, group)``."""
    q0, k0, lo, hi, group = band
    d = (k0 + xp.arange(K, dtype=np.int64))[None, :] - (q0 + xp.arange(R, dtype=np.int64) // group)[:, None]
    return (d >= lo) & (d <= hi)


def _masked(xp: Any, S: Any, bias: Any, band: Any, hkv: int) -> Any:
    """``S`` (BH, R, K) plus the padding bias and the band (a new array)."""
    x = S
    if bias is not None:
        B, K = bias.shape
        x = (x.reshape(B, -1, S.shape[1], K) + bias[:, None, None, :]).reshape(S.shape)
    if band is not None:
        x = xp.where(_band_mask(xp, band, S.shape[1], S.shape[2])[None], x, S.dtype.type(-np.inf))
    return x


def _generic_fwd(S: Any, P: Any, m: Any, l: Any, O: Any, bias: Any = None, band: Any = None,
                 hkv: int = 1) -> None:
    xp = backend.array_module(S)
    x = _masked(xp, S, bias, band, hkv)
    m_new = xp.maximum(m, x.max(axis=-1))
    shift = xp.where(xp.isneginf(m_new), m.dtype.type(0), m_new)
    e = xp.exp(x - shift[..., None])
    alpha = xp.exp(m - shift)
    l *= alpha
    l += e.sum(axis=-1)
    m[...] = m_new
    O *= alpha[..., None]
    P[...] = e


def _generic_bwd(S: Any, dP: Any, P: Any, dS: Any, lse: Any, D: Any, bias: Any = None,
                 band: Any = None, hkv: int = 1) -> None:
    xp = backend.array_module(S)
    x = _masked(xp, S, bias, band, hkv)
    dead = xp.isneginf(lse)
    p = xp.exp(x - xp.where(dead, lse.dtype.type(0), lse)[..., None])
    p = xp.where(dead[..., None], S.dtype.type(0), p)
    ds = p * (dP - D[..., None])
    P[...] = p
    dS[...] = ds


#: The array-code twins (any backend), same signatures as the fused entry points.
generic = types.SimpleNamespace(softmax_fwd_=_generic_fwd, softmax_bwd_=_generic_bwd)


# ------------------------------------------------------------------- kernels
_SRC = r"""
%(HEADER)s
typedef %(T)s T;
typedef %(TP)s TP;
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

// score j of folded row r (of batch row bh) with the padding bias and the band applied
__device__ inline T score(const T* s, long long j, const T* bias, long long b, long long ld_bias,
                          long long qpos, long long k0, long long lo, long long hi, int band) {
    T x = s[j];
    if (bias) x += bias[b * ld_bias + j];
    if (band) {
        long long d = k0 + j - qpos;
        if (d < lo || d > hi) x = NEG_INF;
    }
    return x;
}

// One block per folded row: idx = bh * R + r.
extern "C" __global__ void mpiattn_softmax_fwd(
        T* S, TP* P, T* m, T* l, T* O, const T* bias,
        long long R, long long K, long long ld, long long ld_m, long long Ev, long long ld_o,
        long long ld_obh, long long hkv, long long ld_bias,
        long long q0, long long k0, long long lo, long long hi, long long group, int band) {
    __shared__ T red[32];
    long long idx = blockIdx.x, bh = idx / R, r = idx %% R, b = bh / hkv;
    const T* s = S + idx * ld;
    TP* p = P + idx * ld;
    long long qpos = q0 + r / group;
    T m_old = m[bh * ld_m + r];
    T mx = NEG_INF;
    for (long long j = threadIdx.x; j < K; j += blockDim.x)
        mx = vmax(mx, score(s, j, bias, b, ld_bias, qpos, k0, lo, hi, band));
    T m_new = vmax(m_old, block_reduce(mx, true, red));
    T shift = (m_new == NEG_INF) ? (T)0 : m_new;
    T sum = 0;
    for (long long j = threadIdx.x; j < K; j += blockDim.x) {
        T e = EXP(score(s, j, bias, b, ld_bias, qpos, k0, lo, hi, band) - shift);
        p[j] = (TP)e;
        sum += e;
    }
    sum = block_reduce(sum, false, red);
    T alpha = EXP(m_old - shift);
    T* o = O + bh * ld_obh + r * ld_o;
    for (long long c = threadIdx.x; c < Ev; c += blockDim.x) o[c] *= alpha;
    if (threadIdx.x == 0) {
        l[bh * ld_m + r] = alpha * l[bh * ld_m + r] + sum;
        m[bh * ld_m + r] = m_new;
    }
}

extern "C" __global__ void mpiattn_softmax_bwd(
        const T* S, const T* dP, TP* P, TP* dS, const T* lse, const T* D, const T* bias,
        long long R, long long K, long long ld, long long ld_m, long long hkv, long long ld_bias,
        long long q0, long long k0, long long lo, long long hi, long long group, int band) {
    long long idx = blockIdx.x, bh = idx / R, r = idx %% R, b = bh / hkv;
    const T* s = S + idx * ld;
    const T* dp = dP + idx * ld;
    TP* p = P + idx * ld;
    TP* ds = dS + idx * ld;
    long long qpos = q0 + r / group;
    T L = lse[bh * ld_m + r], d = D[bh * ld_m + r];
    bool dead = (L == NEG_INF);
    for (long long j = threadIdx.x; j < K; j += blockDim.x) {
        T x = score(s, j, bias, b, ld_bias, qpos, k0, lo, hi, band);
        T e = dead ? (T)0 : EXP(x - L);
        T g = e * (dp[j] - d);
        p[j] = (TP)e;
        ds[j] = (TP)g;
    }
}
"""

_TYPES = {
    "float32": {"T": "float", "EXP": "expf", "NEG_INF": "__int_as_float(0xff800000)"},
    "float64": {"T": "double", "EXP": "exp", "NEG_INF": "__longlong_as_double(0xfff0000000000000LL)"},
}
_P_TYPES = {"float16": "__half", "float32": "float", "float64": "double"}


def source(acc: str, operand: str) -> str:
    """The CUDA source for accumulation dtype ``acc`` and GEMM operand dtype ``operand``."""
    header = "#include <cuda_fp16.h>" if operand == "float16" else ""
    return _SRC % dict(_TYPES[acc], TP=_P_TYPES[operand], HEADER=header)


def _kernel(cp: Any, name: str, acc: np.dtype, operand: np.dtype) -> Any:
    """The compiled kernel (CuPy keeps compiled modules per source in memory and on disk)."""
    return cp.RawKernel(source(acc.name, operand.name), name)


def _row_stride(x: Any) -> int:
    """Elements between consecutive rows of a ``(BH, R, K)`` tile laid out as a dense grid of rows."""
    BH, R, K = x.shape
    if K > 1 and x.strides[2] != x.itemsize:
        raise ValueError("the score tile must have unit stride along keys")
    ld = x.strides[1] // x.itemsize if R > 1 else (x.strides[0] // x.itemsize if BH > 1 else K)
    if BH > 1 and x.strides[0] // x.itemsize != ld * R:
        raise ValueError("the score tile's rows must form a dense (BH, R) grid")
    return ld


def _check(S: Any, P: Any, rows: tuple, O: Any = None) -> tuple[np.dtype, np.dtype, int]:
    acc = np.dtype(S.dtype)
    if acc.name not in _TYPES or np.dtype(P.dtype).name not in _P_TYPES:
        raise TypeError(f"fused kernels take float32/float64 scores, got {S.dtype} -> {P.dtype}")
    if S.ndim != 3 or P.shape != S.shape:
        raise ValueError(f"the score tile must be (BH, R, K), got {S.shape} and {P.shape}")
    ld = _row_stride(S)
    if _row_stride(P) != ld:
        raise ValueError("S and P must share one row stride")
    BH, R = S.shape[:2]
    for x in rows:
        if x.shape != (BH, R) or x.dtype != acc or (R > 1 and x.strides[1] != x.itemsize):
            raise ValueError(f"per-row array {x.shape} {x.dtype} does not match scores {S.shape} {acc}")
    if BH > 1 and len({x.strides[0] for x in rows}) > 1:
        raise ValueError("per-row arrays must share one stride between batch rows")
    if O is not None and (O.shape[:2] != (BH, R) or O.dtype != acc
                          or (O.shape[2] > 1 and O.strides[2] != O.itemsize)):
        raise ValueError(f"O {O.shape} does not match scores {S.shape}")
    return acc, np.dtype(P.dtype), ld


def _stride(x: Any, axis: int, default: int) -> int:
    """Elements along ``axis`` of ``x``, or ``default`` where the axis has one entry."""
    return x.strides[axis] // x.itemsize if x.shape[axis] > 1 else default


def _extras(bias: Any, band: Any) -> tuple:
    if bias is not None and bias.shape[1] > 1 and bias.strides[1] != bias.itemsize:
        raise ValueError("the padding bias must have unit stride along keys")
    ld_bias = 0 if bias is None else _stride(bias, 0, bias.shape[1])
    if band is None:
        return ld_bias, (0, 0, 0, 0, 1, np.int32(0))
    q0, k0, lo, hi, group = (int(x) for x in band)
    return ld_bias, (q0, k0, max(-BIG, lo), min(BIG, hi), max(1, group), np.int32(1))


def _threads(K: int) -> int:
    return 128 if K <= 1024 else 256


def softmax_fwd_(S: Any, P: Any, m: Any, l: Any, O: Any, bias: Any = None, band: Any = None,
                 hkv: int = 1) -> None:
    """One online-softmax step on a score tile (see the module docstring for the arguments).

    ``m' = max(m, rowmax S)``; ``P = exp(S - m')``; ``l <- exp(m - m') l + rowsum P``;
    ``O <- exp(m - m') O``; ``m <- m'`` (shift 0 where ``m' = -inf``). The caller then
    adds ``P V`` into ``O``. NumPy arrays run the generic twin.

    Notes
    -----
    CuPy: one kernel, one block per row; it reads the tile twice (the second time
    mostly from L2), writes ``P`` once and ``O`` once.
    """
    xp = backend.array_module(S)
    if xp is np:
        return _generic_fwd(S, P, m, l, O, bias, band, hkv)
    acc, op, ld = _check(S, P, (m, l), O)
    BH, R, K = S.shape
    if BH * R == 0:
        return None
    ld_bias, bnd = _extras(bias, band)
    args = (S, P, m, l, O, bias if bias is not None else np.uint64(0),
            np.int64(R), np.int64(K), np.int64(ld), np.int64(_stride(m, 0, R)),
            np.int64(O.shape[-1]), np.int64(_stride(O, 1, O.shape[-1])),
            np.int64(_stride(O, 0, R * O.shape[-1])), np.int64(hkv), np.int64(ld_bias),
            *(np.int64(x) for x in bnd[:5]), bnd[5])
    _kernel(xp, "mpiattn_softmax_fwd", acc, op)((BH * R,), (_threads(K),), args)
    return None


def softmax_bwd_(S: Any, dP: Any, P: Any, dS: Any, lse: Any, D: Any, bias: Any = None,
                 band: Any = None, hkv: int = 1) -> None:
    """``P = exp(S - lse)`` (0 where ``lse = -inf``) and ``dS = P (dP - D)`` of a score tile.

    See the module docstring for the arguments; ``dP`` like ``S``, ``dS`` like ``P``.
    NumPy arrays run the generic twin.
    """
    xp = backend.array_module(S)
    if xp is np:
        return _generic_bwd(S, dP, P, dS, lse, D, bias, band, hkv)
    acc, op, ld = _check(S, P, (lse, D))
    if _check(dP, dS, (lse, D))[2] != ld or dP.dtype != acc or dS.dtype != op:
        raise ValueError("S, dP, P and dS must share one row stride (and S, dP one dtype)")
    BH, R, K = S.shape
    if BH * R == 0:
        return None
    ld_bias, bnd = _extras(bias, band)
    args = (S, dP, P, dS, lse, D, bias if bias is not None else np.uint64(0),
            np.int64(R), np.int64(K), np.int64(ld), np.int64(_stride(lse, 0, R)),
            np.int64(hkv), np.int64(ld_bias), *(np.int64(x) for x in bnd[:5]), bnd[5])
    _kernel(xp, "mpiattn_softmax_bwd", acc, op)((BH * R,), (_threads(K),), args)
    return None
