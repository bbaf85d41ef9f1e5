"""torch tensors as mpiattn's arrays and back, on the same memory.

* CPU tensors are NumPy views (``Tensor.numpy()``, ``torch.from_numpy``): no
  copy either way. bfloat16 crosses as its bits (``int16`` views) and becomes
  ``ml_dtypes.bfloat16`` on the NumPy side, which the native engine computes
  in float32.
* CUDA tensors are CuPy arrays through DLPack (``cupy.from_dlpack``,
  ``torch.from_dlpack``), and the CuPy work of a call runs on torch's current
  stream of the tensors' device (:func:`on_device`): what torch queued before
  the call (the kernels that made ``q``) runs first, and what torch queues
  after it (the kernels that read ``out``) runs after, with no
  synchronisation. CuPy has no bfloat16, so bfloat16 CUDA tensors are refused
  with a clear error. (Written to the DLPack and CuPy stream APIs; not yet run
  on a GPU.)

The checks here are local (:func:`check_operands`, :func:`check_extra`); the
public calls run them inside one agreement, so every rank raises the same
error (:mod:`mpiattn.torch.functions`).

This module imports torch: it belongs to :mod:`mpiattn.torch`, which needs the
``torch`` extra. (``import torch`` below is absolute: it is the top-level
torch, never this package.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from .. import backend

__all__ = ["DTYPES", "to_array", "to_tensor", "on_device", "check_operands", "check_extra",
           "facts"]

#: The tensor dtypes mpiattn computes in.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _bfloat16_numpy() -> Any:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes comes with the torch extra
        raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install "
                        "\"mpiattn[torch]\" or pip install ml_dtypes)") from None
    return ml_dtypes.bfloat16


def to_array(t: torch.Tensor) -> Any:
    """The NumPy (CPU) or CuPy (CUDA) array on ``t``'s memory (no copy; ``t`` contiguous).

    Parameters
    ----------
    t : torch.Tensor
        Contiguous; float16, bfloat16 (CPU only), float32, float64, bool or
        integer.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        The same memory, the same shape; bfloat16 as ``ml_dtypes.bfloat16``.

    Examples
    --------
    >>> import torch
    >>> from mpiattn.torch.tensors import to_array
    >>> t = torch.arange(3.0)
    >>> a = to_array(t)
    >>> a[0] = 7.0
    >>> t
    tensor([7., 1., 2.])
    """
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_bfloat16_numpy())
        return t.numpy()
    if t.device.type == "cuda":
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 CUDA tensors: CuPy has no bfloat16 dtype, so mpiattn's "
                            "GPU path takes float16, float32 or float64")
        import cupy

        return cupy.from_dlpack(t)
    raise TypeError(f"tensors on {t.device} are not supported (CPU or CUDA)")


def to_tensor(a: Any) -> torch.Tensor:
    """The tensor on the memory of a NumPy or CuPy array (no copy when its strides allow).

    ``ml_dtypes.bfloat16`` arrays become ``torch.bfloat16`` tensors.

    Examples
    --------
    >>> import numpy as np
    >>> from mpiattn.torch.tensors import to_tensor
    >>> to_tensor(np.ones(2, dtype=np.float32))
    tensor([1., 1.])
    """
    if isinstance(a, np.ndarray):
        if min(a.strides, default=0) < 0:
            a = np.ascontiguousarray(a)
        if backend.is_bfloat16(a.dtype):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if backend.is_cupy_array(a):
        return torch.from_dlpack(a)
    raise TypeError(f"expected a NumPy or CuPy array, got {type(a).__name__}")


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """For CUDA tensors: CuPy's current device and stream are torch's, for the block.

    A no-op on the CPU. CuPy is imported only for CUDA tensors.
    """
    if device.type != "cuda":
        yield
        return
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield


def _kind(t: torch.Tensor) -> str:
    return f"{t.device.type}" if t.device.type == "cpu" else str(t.device)


def check_operands(named: dict[str, Any]) -> None:
    """The local checks of the differentiable operands (``{"q": q, ...}``); raises on the first fault.

    Each must be a contiguous tensor of a dtype in :data:`DTYPES`, and all must
    share one device and one dtype.

    Raises
    ------
    TypeError
        A non-tensor, an unsupported dtype, mixed dtypes or devices.
    ValueError
        A non-contiguous tensor.
    """
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; mpiattn computes in float16, bfloat16, "
                            "float32 or float64")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}); mpiattn works on the tensor's own memory, so pass "
                             f"{name}.contiguous()")
    first, *rest = named.items()
    for name, t in rest:
        if t.device != first[1].device:
            raise TypeError(f"{first[0]} and {name} are on different devices ({_kind(first[1])}, "
                            f"{_kind(t)}); move them to one device first")
        if t.dtype != first[1].dtype:
            raise TypeError(f"{first[0]} and {name} have different dtypes ({first[1].dtype}, "
                            f"{t.dtype}); convert them to one dtype first")


def check_extra(named: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Masks and document ids: None, NumPy/CuPy arrays, or tensors that need no gradient.

    Returns ``{name: array or None}`` (tensors on ``device`` as zero-copy arrays).

    Raises
    ------
    TypeError
        A tensor that requires grad (mpiattn computes no gradient for it), one
        on another device than the operands, or a non-contiguous one.
    """
    out = {}
    for name, x in named.items():
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                raise TypeError(f"{name} requires grad, but attention has no gradient with respect "
                                f"to it; pass {name}.detach()")
            if x.device != device:
                raise TypeError(f"{name} is on {_kind(x)} but the operands are on "
                                f"{_kind(torch.empty(0, device=device))}")
            if not x.is_contiguous():
                raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
            x = to_array(x)
        out[name] = x
    return out


def facts(named: dict[str, torch.Tensor]) -> dict:
    """What every rank must agree on about the operands: dtype, device kind, who needs grad.

    A rank whose operands need grad builds a backward node that runs a
    collective; if another rank builds none, its backward would wait forever,
    so the pattern is agreed before any work.
    """
    grad = torch.is_grad_enabled()
    return {"dtype": str(next(iter(named.values())).dtype),
            "device": next(iter(named.values())).device.type,
            "requires_grad (" + ", ".join(named) + ")": tuple(
                bool(grad and t.requires_grad) for t in named.values())}
