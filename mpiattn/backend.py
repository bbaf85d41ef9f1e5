"""Array backend: one code path for NumPy (CPU) and CuPy (GPU).

The namespace of the input arrays decides where work runs. CuPy is imported
only when an argument already is a CuPy array or when the caller asks for the
GPU explicitly, so ``import mpiattn`` never creates a CUDA context.

Dtype policy
------------
float16, bfloat16 and float32 inputs accumulate in float32; float64 inputs
accumulate in float64. Results are returned in the input dtype; log-sum-exp
values stay in the accumulation dtype.

bfloat16 is the NumPy dtype of the ``ml_dtypes`` package (``ml_dtypes.bfloat16``,
``pip install "mpiattn[bf16]"``; torch bf16 tensors reach it through
:mod:`mpiattn.torch`). It is recognised by the dtype itself, so this module never
imports ``ml_dtypes``: an array of that dtype means the caller already did.
CuPy has no bfloat16 dtype, so bfloat16 runs on NumPy arrays only.
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
    "is_bfloat16",
    "dtype_name",
]

#: Floating dtypes the numerical kernels accept (and bfloat16, see :func:`is_bfloat16`).
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_bfloat16(dtype: Any) -> bool:
    """True for ``ml_dtypes.bfloat16`` (decided from the dtype, without importing ml_dtypes).

    >>> import numpy as np
    >>> from mpiattn.backend import is_bfloat16
    >>> is_bfloat16(np.float16)
    False
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return dt.name == "bfloat16" and dt.type.__module__.split(".")[0] == "ml_dtypes"


def dtype_name(dtype: Any) -> str:
    """The dtype's name as the engines declare it (``"float32"``, ``"bfloat16"``, ...)."""
    return np.dtype(dtype).name


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
    """Accumulation dtype: float64 for float64, float32 for float16/bfloat16/float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def check_dtype(dtype: Any, what: str = "array") -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise TypeError when unsupported."""
    dt = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES and not is_bfloat16(dt):
        raise TypeError(
            f"{what} has dtype {dt}; mpiattn computes in float16, bfloat16 (ml_dtypes), "
            "float32 or float64"
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
