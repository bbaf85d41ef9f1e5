"""What an input file of an attention problem holds, checked on rank 0 before any data is read.

The datasets (``q``, ``k``, ``v``, optionally ``dout``, the padding mask,
the document ids, and the score modifiers a file may hold: the vocabulary of
:mod:`mpiattn.masks.stored`), the axis of each that runs along the sequence, their
stored shapes promoted to 4-D (2-D for the mask and the ids) and checked
against each other, their dtypes, and the root attributes ``causal``,
``scale`` and ``window``, each checked for its type. :func:`read_meta` reads
all of it on rank 0 and gives every rank the result or the same error. The
file format is described in ``docs/file-format.md``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import get_comm
from ..masks import stored
from ..masks.spec import ALIGNMENTS, check_causal
from .atomic import on_rank0
from .hdf5types import BFLOAT16, is_bfloat16_type
from .opening import _open_read, _plain, file_info, identity

__all__ = ["SEQ_AXIS_FROM_END", "KEY_DATASETS", "WHOLE_DATASETS", "window_from_attribute",
           "read_whole_datasets", "read_meta", "promoted_shape", "check_dtype"]

#: Input datasets and the axis (from the end) of their sequence dimension (the score's datasets
#: held by query rows, :data:`mpiattn.masks.stored.ROWS`, read like ``q``'s).
SEQ_AXIS_FROM_END = {"q": 2, "k": 2, "v": 2, "dout": 2, "key_padding_mask": 1, "segment_ids": 1,
                     "kv_segment_ids": 1, **stored.ROWS}

#: Small datasets every rank reads whole: the score modifiers' per-head numbers.
WHOLE_DATASETS = stored.WHOLE

#: Datasets along the keys (M rows, read by the keys' layout); the others run along the queries.
KEY_DATASETS = ("k", "v", "key_padding_mask", "kv_segment_ids")

#: Datasets stored (B, L) or (L,): the padding mask and the document ids.
_ROWS_2D = ("key_padding_mask", "segment_ids", "kv_segment_ids")


def promoted_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Stored shape of dataset ``name`` -> 4-D (2-D for the key padding mask and the ids) by
    leading axes of length 1: ``(L, F)`` and ``(H, L, F)`` stand for ``(1, 1, L, F)`` and
    ``(1, H, L, F)``; ValueError naming the forms for another number of axes."""
    want = 2 if name in _ROWS_2D else 4
    lo = 1 if name in _ROWS_2D else 2
    if not lo <= len(shape) <= want:
        forms = "(B, L) or (L,)" if name in _ROWS_2D else "(B, H, L, F), (H, L, F) or (L, F)"
        raise ValueError(f"dataset {name!r} has {len(shape)} dimensions {shape}; expected {forms}")
    return (1,) * (want - len(shape)) + tuple(shape)


#: The real floating-point dtypes a dataset may hold, for messages.
_FLOATS = "float16, bfloat16, float32 or float64, any byte order"


def _real_float(dt: np.dtype) -> bool:
    """Whether ``dt`` is one of :data:`_FLOATS`."""
    return dt.kind == "f" and dt.newbyteorder("=") in backend.SUPPORTED_DTYPES


def check_dtype(name: str, dt: np.dtype) -> None:
    """TypeError unless dataset ``name`` may hold dtype ``dt`` (the score's datasets by query rows:
    :func:`mpiattn.masks.stored.check_dtype`; document ids: integers; the padding mask: boolean;
    the rest: real floating point)."""
    if name in ("segment_ids", "kv_segment_ids"):
        if dt.kind not in "iu":
            raise TypeError(f"dataset {name!r} has dtype {dt}; document ids must be integers")
        return
    if name in stored.ROWS:
        stored.check_dtype(name, dt, _real_float(dt), _FLOATS)
        return
    if name == "key_padding_mask":
        if dt != np.bool_:
            raise TypeError(f"dataset 'key_padding_mask' has dtype {dt}; it must be boolean "
                            "(True = padding key to ignore)")
        return
    if not _real_float(dt):
        raise TypeError(f"dataset {name!r} has dtype {dt}; mpiattn needs real floating-point "
                        f"data ({_FLOATS})")


def _validate(shapes: dict[str, tuple[int, ...]]) -> None:
    """Check the promoted global shapes of the input datasets against each other."""
    B, H, N, E = shapes["q"]
    Bk, Hkv, M, Ek = shapes["k"]
    Bv, Hv, Mv, Ev = shapes["v"]
    if (Bk, Ek) != (B, E):
        raise ValueError(f"q {shapes['q']} and k {shapes['k']} must have the same batch size B "
                         "and feature size E")
    if (Bv, Hv, Mv) != (Bk, Hkv, M):
        raise ValueError(f"k {shapes['k']} and v {shapes['v']} must have the same batch size B, "
                         "heads Hkv and length M")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q has H = {H} heads, k and v have Hkv = {Hkv}: H must be a "
                         "positive multiple of Hkv")
    if E < 1:
        raise ValueError(f"q {shapes['q']} and k {shapes['k']} have feature size E = {E}; it "
                         "must be at least 1")
    if "dout" in shapes and shapes["dout"] != (B, H, N, Ev):
        raise ValueError(f"dout has shape {shapes['dout']}, expected (B, H, N, Ev) = {(B, H, N, Ev)}")
    if "key_padding_mask" in shapes and shapes["key_padding_mask"] != (B, M):
        raise ValueError(f"key_padding_mask has shape {shapes['key_padding_mask']}, "
                         f"expected (B, M) = {(B, M)}")
    for name, want in (("segment_ids", (B, N)), ("kv_segment_ids", (B, M))):
        if name in shapes and shapes[name] != want:
            raise ValueError(f"{name} has shape {shapes[name]}, expected {want}")
    if "kv_segment_ids" in shapes and "segment_ids" not in shapes:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' document ids)")
    if "segment_ids" in shapes and "kv_segment_ids" not in shapes and N != M:
        raise ValueError(f"segment_ids without kv_segment_ids: the keys take the query ids, "
                         f"which needs N == M (here N = {N}, M = {M})")
    stored.check_rows(shapes, B, H, N, M)


def read_whole_datasets(f: Any, path: str, names: Any = WHOLE_DATASETS) -> dict[str, np.ndarray]:
    """The datasets of :data:`WHOLE_DATASETS` among ``names`` that the open file ``f`` holds,
    whole, as float64 arrays (``path`` names the file in the errors).

    Raises
    ------
    TypeError
        One of them is a group, or holds no real numbers (booleans, strings, compounds).
    """
    import h5py

    out = {}
    for name in WHOLE_DATASETS:
        if name in names and name in f:
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "fiu":
                raise TypeError(f"{path}: {name!r} must be a dataset of real numbers")
            out[name] = np.asarray(ds[()], dtype=np.float64)
    return out


def window_from_attribute(value: Any) -> tuple | None:
    """The ``window`` attribute (two ints, -1 = no bound on that side) -> ``(left, right)`` or None.

    Raises ValueError unless it is two integers >= -1.
    """
    if value is None:
        return None
    w = np.asarray(value)
    if w.shape != (2,) or w.dtype.kind not in "iu" or (w < -1).any():
        raise ValueError(f"attribute 'window' must be two integers (left, right), -1 for no bound, "
                         f"got {value!r}")
    out = tuple(None if x < 0 else int(x) for x in w.tolist())
    return None if out == (None, None) else out


def _read_meta(path: str) -> dict:
    """Metadata of an input file, validated (run on one rank)."""
    with _open_read(path) as f:
        on_disk, dtypes = {}, {}
        for name in SEQ_AXIS_FROM_END:
            if name not in f:
                if name in ("q", "k", "v"):
                    raise ValueError(f"{path} has no dataset {name!r} (found: "
                                     f"{', '.join(sorted(f.keys())) or 'nothing'})")
                continue
            ds = f[name]
            import h5py

            if not isinstance(ds, h5py.Dataset):
                raise ValueError(f"{path}: {name!r} is a group, not a dataset")
            check_dtype(name, ds.dtype)
            on_disk[name] = tuple(int(s) for s in ds.shape)
            dtypes[name] = (BFLOAT16 if is_bfloat16_type(ds.id.get_type())  # docs/file-format.md
                            else ds.dtype.newbyteorder("=").str)  # read in native byte order
        shapes = {name: promoted_shape(name, s) for name, s in on_disk.items()}
        _validate(shapes)
        whole = {name: x.shape for name, x in read_whole_datasets(f, path).items()}
        stored.check_whole(whole, *shapes["q"][:2])
        causal = _causal_attribute(path, f.attrs.get("causal"))
        scale = _scale_attribute(path, f.attrs.get("scale"))
        try:
            window = window_from_attribute(f.attrs.get("window"))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        info = file_info(path, identity(f))
    return {"stored": on_disk, "shapes": shapes, "dtypes": dtypes, "info": info,
            "causal": causal, "scale": scale, "window": window, "whole": whole}


def _causal_attribute(path: str, value: Any) -> bool | str | None:
    """The ``causal`` attribute: a boolean (or the integer 0 or 1), or an alignment
    (``"top-left"``, i.e. True, or ``"bottom-right"``), else ValueError."""
    if value is None:
        return None
    plain = _plain(value)
    if isinstance(plain, bool) or (isinstance(plain, int) and plain in (0, 1)):
        return bool(plain)
    if isinstance(plain, str) and plain in ALIGNMENTS:
        return check_causal(plain)
    raise ValueError(f"{path}: attribute 'causal' must be a boolean, 'top-left' or 'bottom-right', "
                     f"got {value!r}")


def _scale_attribute(path: str, value: Any, name: str = "scale") -> float | None:
    """The ``scale`` attribute (or another one, ``name``): a finite real number (not a string,
    not a boolean), else ValueError."""
    if value is None:
        return None
    plain = _plain(value)
    if isinstance(plain, bool) or not isinstance(plain, (int, float)):
        raise ValueError(f"{path}: attribute {name!r} must be a number, got {value!r} "
                         f"({type(plain).__name__})")
    if not math.isfinite(plain):
        raise ValueError(f"{path}: attribute {name!r} must be finite, got {plain!r}")
    return float(plain)


def read_meta(path: str, comm: Any = None) -> dict:
    """The validated metadata of an input file, on every rank (rank 0 reads it).

    Returns
    -------
    dict
        ``stored`` and ``shapes`` (promoted) per dataset, ``dtypes``,
        ``causal``, ``scale``, ``window`` (the attributes, checked), and
        ``info`` (:func:`~mpiattn.io.opening.file_info`, with the identity
        of the file read). Pass it to :func:`~mpiattn.io.reading.read_input`
        and :func:`~mpiattn.io.reading.read_whole`, which check that every
        later open finds the same file.

    Raises
    ------
    FileNotFoundError, OSError, ValueError, TypeError
        The same error on every rank.
    """
    c = get_comm(comm)
    return on_rank0(c, lambda: _read_meta(os.path.abspath(path)))

