"""bfloat16 in HDF5: one documented 16-bit float type, written and read bit for bit.

NumPy has no bfloat16 of its own (``ml_dtypes.bfloat16`` is an extension dtype
that h5py stores as opaque bytes), so mpiattn stores bfloat16 datasets as an
HDF5 *floating-point* type with bfloat16's layout, which any HDF5 reader
understands as a float:

=============  =====================================================
size           2 bytes, little-endian
sign           bit 15
exponent       bits 7-14 (8 bits), bias 127
mantissa       bits 0-6 (7 bits), normalisation implied
=============  =====================================================

(the layout of HDF5 2.0's predefined ``H5T_FLOAT_BFLOAT16LE``; it is built
here from ``H5T_IEEE_F32LE`` so it works with any HDF5 that h5py links).
h5py reads such a dataset as float32, exactly (every bfloat16 value is a
float32 value): ``f["out"][...]``. mpiattn writes and reads the bits
unconverted (:func:`bfloat16_type` as the memory type) and hands out
``ml_dtypes.bfloat16`` arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BFLOAT16", "bfloat16_type", "is_bfloat16_type", "bfloat16_dtype"]

#: The name a dataset's dtype has in mpiattn's metadata when it is bfloat16.
BFLOAT16 = "bfloat16"

_FIELDS = (15, 7, 8, 0, 7)  # sign position, exponent position and size, mantissa position and size


def bfloat16_type() -> Any:
    """A new h5py ``TypeFloatID`` with bfloat16's layout (see the module docstring)."""
    from h5py import h5t

    t = h5t.IEEE_F32LE.copy()
    t.set_fields(*_FIELDS)
    t.set_offset(0)
    t.set_precision(16)
    t.set_size(2)
    t.set_ebias(127)
    return t


def is_bfloat16_type(tid: Any) -> bool:
    """True when the HDF5 type ``tid`` (e.g. ``dataset.id.get_type()``) has bfloat16's layout."""
    from h5py import h5t

    return (tid.get_class() == h5t.FLOAT and tid.get_size() == 2
            and tuple(tid.get_fields()) == _FIELDS and tid.get_ebias() == 127)


def bfloat16_dtype() -> np.dtype:
    """``ml_dtypes.bfloat16`` as a NumPy dtype (imports ml_dtypes, with a clear error if absent)."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("the file holds bfloat16 data, which needs the ml_dtypes package "
                        "(pip install \"mpiattn[bf16]\")") from None
    return np.dtype(ml_dtypes.bfloat16)
