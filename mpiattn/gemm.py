"""Mixed-precision GEMMs into a given output: ``out = alpha a @ b + beta out``.

One function, :func:`matmul`, for the kernels and the products, so that the
benchmark's GEMM ceiling can be measured through the same call.

On CuPy it calls cuBLAS's ``cublasGemmStridedBatchedEx`` through CuPy's own
bindings (``cupy_backends.cuda.libs.cublas``), on CuPy's current stream:

* float16 (and bfloat16, where the array library has it) operands stay in
  their dtype and accumulate in float32 (``CUBLAS_COMPUTE_32F``): tensor
  cores, no upcast copies. CuPy's own ``matmul`` cannot do this: for 3-D and
  larger float16 operands it writes a float16 result (or, in older
  versions, upcasts the operands to float32), and the scores of attention
  must not be rounded to float16;
* float32 operands: ``CUBLAS_COMPUTE_32F`` (TF32 only when asked for,
  ``tf32=True``); float64: ``CUBLAS_COMPUTE_64F``;
* operands are used through their strides: a row-major or column-major
  matrix (unit stride on one of its two last axes) is passed with its
  leading dimension and a transpose flag, no copy; leading axes collapse to
  one batch stride where they can (a stride-0 broadcast included), else the
  call loops over the first leading axis; ``beta = 1`` accumulates into
  ``out`` in the same launch.

Leading dimensions that are multiples of 16 bytes (8 float16 elements) and
16-byte-aligned pointers keep cuBLAS on its aligned tensor-core kernels;
:func:`aligned` tells whether a call has them.

On NumPy, operands are cast to ``out``'s dtype (BLAS has no float16) and
multiplied with :func:`numpy.matmul`, straight into ``out`` where the dtypes
allow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend

__all__ = ["matmul", "operand_dtype", "aligned", "COMPUTE_32F", "COMPUTE_64F"]

#: cuBLAS compute types (``cublasComputeType_t``) and data types (``cudaDataType``).
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
_CUDA_R = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
_GEMM_DEFAULT = -1


def operand_dtype(xp: Any, dtype: Any) -> np.dtype:
    """The dtype GEMM operands are kept in: the input dtype on CuPy, the accumulation dtype on NumPy."""
    dt = np.dtype(dtype)
    return dt if xp is not np else backend.accum_dtype(dt)


def _matrix(x: Any) -> tuple[int, int] | None:
    """``(transpose, ld)`` of the last two axes of ``x`` as cuBLAS sees them, or None (needs a copy).

    ``transpose`` is 0 for a row-major matrix (unit stride along the last axis), 1 for a
    column-major one; ``ld`` the leading dimension in elements.
    """
    rows, cols = x.shape[-2], x.shape[-1]
    s0, s1 = (s // x.itemsize for s in x.strides[-2:])
    if cols == 1 or s1 == 1:
        if rows == 1 or s0 >= max(cols, 1):
            return 0, max(s0 if rows > 1 else cols, 1)
    if rows == 1 or s0 == 1:
        if cols == 1 or s1 >= max(rows, 1):
            return 1, max(s1 if cols > 1 else rows, 1)
    return None


def _batch_stride(x: Any, lead: tuple[int, ...]) -> int | None:
    """One element stride for the leading axes ``lead`` of ``x`` (broadcast right-aligned), or None."""
    k = len(lead)
    xl = x.shape[:-2]
    strides = [0] * (k - len(xl)) + [s // x.itemsize for s in x.strides[:-2]]
    dims = [1] * (k - len(xl)) + list(xl)
    stride = None
    expect = None
    for i in range(k - 1, -1, -1):
        n = lead[i]
        if n == 1:
            continue
        st = 0 if dims[i] == 1 else strides[i]
        if stride is None:
            stride, expect = st, st * n
            continue
        if st != expect:
            return None
        expect = st * n
    return 0 if stride is None else stride


def aligned(a: Any, b: Any, out: Any) -> bool:
    """Whether a GEMM of these operands has 16-byte aligned pointers and leading dimensions."""
    for x in (a, b, out):
        m = _matrix(x)
        if m is None or (m[1] * x.itemsize) % 16 or x.data.ptr % 16:
            return False
    return True


def matmul(a: Any, b: Any, out: Any, *, alpha: float = 1.0, beta: float = 0.0,
           tf32: bool = False) -> Any:
    """``out = alpha * (a @ b) + beta * out`` in place; returns ``out``.

    Parameters
    ----------
    a : (..., M, K) array
    b : (..., K, N) array, same dtype as ``a``
    out : (..., M, N) array
        Leading axes of ``a`` and ``b`` broadcast to those of ``out``.
        float32 (or float64 with float64 operands) accumulation; a float16
        ``out`` is computed in float32 and rounded once.
    alpha, beta : float
    tf32 : bool
        CuPy float32 operands: allow TF32 tensor cores.

    Notes
    -----
    CuPy: one cuBLAS launch when the leading axes collapse to one batch
    stride (the usual case), no copies of ``a``, ``b`` unless one of their
    two last axes has no unit stride. FLOPs ``2 M N K`` per batch entry.
    """
    xp = backend.array_module(a, b, out)
    if xp is np:
        return _host(a, b, out, alpha, beta)
    if a.dtype != b.dtype:
        raise TypeError(f"gemm operands must share a dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2] or out.shape[-2:] != (a.shape[-2], b.shape[-1]):
        raise ValueError(f"gemm shapes {a.shape} @ {b.shape} -> {out.shape}")
    return _device(xp, a, b, out, alpha, beta, tf32)


def _host(a: Any, b: Any, out: Any, alpha: float, beta: float) -> Any:
    dt = backend.accum_dtype(out.dtype) if out.dtype == np.float16 else np.dtype(out.dtype)
    a, b = a.astype(dt, copy=False), b.astype(dt, copy=False)
    if beta == 0 and alpha == 1 and out.dtype == dt:
        np.matmul(a, b, out=out)
        return out
    prod = np.matmul(a, b)
    if alpha != 1:
        prod *= dt.type(alpha)
    if beta == 0:
        out[...] = prod
    else:
        if beta != 1:
            out *= out.dtype.type(beta)
        out += prod.astype(out.dtype, copy=False)
    return out


def _device(cp: Any, a: Any, b: Any, out: Any, alpha: float, beta: float, tf32: bool) -> Any:
    lead = out.shape[:-2]
    if 0 in out.shape:
        return out
    if a.shape[-1] == 0:
        if beta == 0:
            out.fill(0)
        elif beta != 1:
            out *= beta
        return out
    ma, mb, mc = _matrix(a), _matrix(b), _matrix(out)
    if ma is None:
        a, ma = cp.ascontiguousarray(a), (0, max(a.shape[-1], 1))
    if mb is None:
        b, mb = cp.ascontiguousarray(b), (0, max(b.shape[-1], 1))
    if mc is None or mc[0] == 1:  # cuBLAS writes its C column-major: go through a row-major temporary
        tmp = cp.empty(out.shape, dtype=out.dtype)
        if beta != 0:
            tmp[...] = out
        _device(cp, a, b, tmp, alpha, beta, tf32)
        out[...] = tmp
        return out
    strides = [_batch_stride(x, lead) for x in (a, b, out)]
    if None in strides:  # loop over the first leading axis
        for i in range(lead[0]):
            pick = [x[i] if x.ndim - 2 == len(lead) and x.shape[0] != 1 else
                    (x[0] if x.ndim - 2 == len(lead) else x) for x in (a, b)]
            _device(cp, pick[0], pick[1], out[i], alpha, beta, tf32)
        return out
    from cupy_backends.cuda.libs import cublas

    names = (np.dtype(a.dtype).name, np.dtype(out.dtype).name)
    if names[0] not in _CUDA_R or names[1] not in _CUDA_R:
        raise TypeError(f"no cuBLAS GEMM for {names[0]} operands into {names[1]}")
    if "float64" in names:
        if names != ("float64", "float64"):
            raise TypeError("float64 GEMMs need float64 operands and output")
        compute, scal = COMPUTE_64F, np.float64
    else:
        compute = COMPUTE_32F_FAST_TF32 if tf32 and names[0] == "float32" else COMPUTE_32F
        scal = np.float32
    al, be = np.array(alpha, dtype=scal), np.array(beta, dtype=scal)
    batch = int(np.prod(lead, dtype=np.int64)) if lead else 1
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    # column-major: C^T (N x M) = op(B)^T (N x K) . op(A)^T (K x M)
    cublas.gemmStridedBatchedEx(
        cp.cuda.device.get_cublas_handle(), mb[0], ma[0], N, M, K, al.ctypes.data,
        b.data.ptr, _CUDA_R[names[0]], mb[1], strides[1],
        a.data.ptr, _CUDA_R[names[0]], ma[1], strides[0],
        be.ctypes.data, out.data.ptr, _CUDA_R[names[1]], mc[1], strides[2],
        batch, compute, _GEMM_DEFAULT)
    return out
