"""Array backend: one code path for NumPy (CPU) and CuPy (GPU).

The namespace of the input arrays decides where work runs. CuPy is imported
only when an argument already is a CuPy array or when the caller asks for the
GPU explicitly, so ``import mpiattn`` never creates a CUDA context.

Dtype policy
------------
float16 and float32 inputs accumulate in float32; float64 inputs accumulate in
float64. Results are returned in the input dtype; log-sum-exp values stay in
the accumulation dtype.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "array_module",
    "accum_dtype",
    "is_cupy_array",
    "to_host",
    "to_device",
    "synchronize",
    "check_dtype",
]

#: Floating dtypes the numerical kernels accept.
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_cupy_array(x: Any) -> bool:
    """True when ``x`` is a CuPy array (decided without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


def array_module(*arrays: Any) -> ModuleType:
    """Return ``numpy`` or ``cupy``: the namespace the arrays live in.

    Parameters
    ----------
    *arrays
        Arrays (``None`` entries are ignored).

    Raises
    ------
    TypeError
        When NumPy and CuPy arrays are mixed, or an argument is not an array.
    """
    kinds = set()
    for x in arrays:
        if x is None:
            continue
        if is_cupy_array(x):
            kinds.add("cupy")
        elif isinstance(x, np.ndarray):
            kinds.add("numpy")
        else:
            raise TypeError(
                f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__module__}.{type(x).__name__}"
            )
    if len(kinds) > 1:
        raise TypeError("NumPy and CuPy arrays are mixed in one call; move them to one device first")
    if kinds == {"cupy"}:
        return sys.modules["cupy"]
    return np


def accum_dtype(dtype: Any) -> np.dtype:
    """Accumulation dtype: float64 for float64, float32 for float16/float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def check_dtype(dtype: Any, what: str = "array") -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise TypeError when unsupported."""
    dt = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what} has dtype {dt}; mpiattn computes in float16, float32 or float64"
        )
    return dt


def to_host(x: Any) -> np.ndarray:
    """Return ``x`` as a NumPy array (a device-to-host copy for CuPy)."""
    if is_cupy_array(x):
        return x.get()
    return np.asarray(x)


def to_device(x: np.ndarray, xp: ModuleType) -> Any:
    """Move a host array into namespace ``xp`` (no copy when ``xp`` is NumPy)."""
    if xp is np:
        return x
    return xp.asarray(x)


def synchronize(xp: ModuleType) -> None:
    """Wait for queued device work (no-op for NumPy)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
