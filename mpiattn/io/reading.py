"""Reading an attention problem from HDF5, each rank only its own rows.

Rank 0 reads the file's metadata (dataset shapes, dtypes, attributes) and
validates it (:mod:`mpiattn.io.schema`); every rank learns the verdict (the
same error on every rank) and the metadata. Each rank then reads only its
rows of every dataset, one hyperslab per layout segment (zigzag: two),
straight into its buffer, and checks that it read the file whose metadata
was read (:mod:`mpiattn.io.opening`). No array passes through another rank.
The file format is described in ``docs/file-format.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import get_comm
from ..layouts import all_segments, check_layout, layout_key
from ..masks import stored
from ..masks.score import Score
from .atomic import on_rank0
from .hdf5types import BFLOAT16, bfloat16_dtype, is_bfloat16_type
from .opening import _open_read, _same_input, identity
from .schema import KEY_DATASETS, SEQ_AXIS_FROM_END, _read_meta, read_meta, read_whole_datasets

__all__ = ["NonFiniteError", "Inputs", "read_input", "read_whole"]


class NonFiniteError(ValueError):
    """An input dataset holds NaN or Inf values."""


@dataclass
class Inputs:
    """This rank's part of an attention problem read from HDF5.

    Attributes
    ----------
    path : str
        Absolute path of the input file.
    q : ndarray, shape (B, H, n_r, E)
    k : ndarray, shape (B, Hkv, m_r, E)
    v : ndarray, shape (B, Hkv, m_r, Ev)
    dout : ndarray, shape (B, H, n_r, Ev), or None
    key_padding_mask : bool ndarray, shape (B, m_r), or None
    segment_ids, kv_segment_ids : int64 ndarray, shapes (B, n_r), (B, m_r), or None
        Document ids of the queries and of the keys.
    score : Score
        The score modifiers the file holds (:mod:`mpiattn.masks.stored`): this rank's query
        rows of an ``attn_mask`` ``(B or 1, H or 1, n_r, M)``, bool or float64; the per-head
        datasets (``sinks``, ``alibi_slopes``), float64, read whole by every rank.
    n, m : int
        Global query and key/value lengths ``N`` and ``M``.
    stored_ndim : dict
        Dataset name -> number of dimensions in the file (2-D and 3-D arrays
        are promoted to 4-D by adding leading axes of length 1).
    causal, scale
        The file's ``causal`` (False, True or ``"bottom-right"``) and ``scale``
        attributes (None when absent).
    layout : str
    info : dict
        :func:`~mpiattn.io.opening.file_info` of the input file.
    """

    path: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray | None
    key_padding_mask: np.ndarray | None
    n: int
    m: int
    stored_ndim: dict = field(default_factory=dict)
    causal: bool | str | None = None
    scale: float | None = None
    layout: Any = "contiguous"
    info: dict = field(default_factory=dict)
    segment_ids: np.ndarray | None = None
    kv_segment_ids: np.ndarray | None = None
    window: tuple | None = None  # the file's 'window' attribute, (left, right), None = unbounded side
    kv_layout: Any = None
    score: Score = field(default_factory=Score)


def _read_segments(ds: Any, segs: list[tuple[int, int]], axis: int) -> np.ndarray:
    """Rows ``segs`` of dataset ``ds`` along ``axis``, one hyperslab per segment.

    Read in native byte order (HDF5 converts a big-endian dataset on read);
    bfloat16 (:mod:`mpiattn.io.hdf5types`) bit for bit, as ``ml_dtypes.bfloat16``.
    """
    shape = list(ds.shape)
    shape[axis] = sum(ln for _, ln in segs)
    ftype = ds.id.get_type()
    if is_bfloat16_type(ftype):
        return _read_bits(ds, ftype, segs, axis, shape).view(bfloat16_dtype())
    out = np.empty(shape, dtype=ds.dtype.newbyteorder("="))
    pos = 0
    for g, ln in segs:
        src = [slice(None)] * len(shape)
        dst = [slice(None)] * len(shape)
        src[axis] = slice(g, g + ln)
        dst[axis] = slice(pos, pos + ln)
        if out.size:
            ds.read_direct(out, tuple(src), tuple(dst))
        pos += ln
    return out


def _read_bits(ds: Any, ftype: Any, segs: list[tuple[int, int]], axis: int,
               shape: list[int]) -> np.ndarray:
    """The segments of a 16-bit dataset as uint16 bits (memory type = file type: no conversion)."""
    from h5py import h5s

    out = np.empty(shape, dtype=np.uint16)
    pos = 0
    for g, ln in segs:
        if ln and out.size:
            part = np.empty(shape[:axis] + [ln] + shape[axis + 1:], dtype=np.uint16)
            fspace = ds.id.get_space()
            fspace.select_hyperslab(tuple(g if i == axis else 0 for i in range(len(shape))),
                                    tuple(part.shape))
            ds.id.read(h5s.create_simple(part.shape), fspace, part, mtype=ftype)
            idx = [slice(None)] * len(shape)
            idx[axis] = slice(pos, pos + ln)
            out[tuple(idx)] = part
        pos += ln
    return out


def _first_nonfinite_row(x: np.ndarray, axis: int, segs: list[tuple[int, int]]) -> int | None:
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    local = int(np.nonzero(np.moveaxis(bad, axis, 0).reshape(bad.shape[axis], -1).any(axis=1))[0][0])
    for g, ln in segs:
        if local < ln:
            return g + local
        local -= ln
    return None


def read_input(path: str, comm: Any = None, *, layout: Any = "contiguous", dtype: Any = None,
               check_finite: bool = True, kv_layout: Any = None, meta: dict | None = None) -> Inputs:
    """Read this rank's rows of an attention problem from an HDF5 file.

    Parameters
    ----------
    path : str
        File with datasets ``q`` (B, H, N, E), ``k`` (B, Hkv, M, E), ``v``
        (B, Hkv, M, Ev), optionally ``dout`` (B, H, N, Ev) and
        ``key_padding_mask`` (B, M) bool, ``segment_ids`` (B, N) and
        ``kv_segment_ids`` (B, M) integers. ``q``, ``k``, ``v``, ``dout`` may
        also be stored 3-D (H, L, F) or 2-D (L, F), the mask and ids 1-D.
    comm : mpi4py.MPI.Intracomm, optional
        Communicator (default ``MPI.COMM_WORLD``).
    layout : {"contiguous", "zigzag"} or Layout
        Which rows each rank reads (:mod:`mpiattn.layouts`).
    kv_layout : layout, optional
        The rows of the key datasets (:data:`~mpiattn.io.schema.KEY_DATASETS`); default ``layout``.
    dtype : dtype, optional
        Compute dtype for ``q``, ``k``, ``v``, ``dout``; default the common
        type of the stored ``q``, ``k``, ``v``.
    check_finite : bool
        Raise :class:`NonFiniteError` when a dataset holds NaN or Inf.
    meta : dict, optional
        :func:`~mpiattn.io.schema.read_meta` of the file, when the caller read it already.

    Returns
    -------
    Inputs
        Arrays promoted to 4-D (mask 2-D), this rank's rows only.

    Raises
    ------
    FileNotFoundError, OSError, ValueError, TypeError, NonFiniteError
        The same error on every rank; ValueError when the ranks did not all
        read the file whose metadata was read (it was replaced or changed
        meanwhile: its device, inode, size and modification time are
        compared before and after each rank reads).
    """
    c = get_comm(comm)
    path = os.path.abspath(path)
    kv_layout = layout if kv_layout is None else kv_layout

    def local() -> tuple:
        check_layout(layout)
        check_layout(kv_layout)
        if dtype is not None:
            backend.check_dtype(dtype, "the compute dtype")
        return layout_key(layout), layout_key(kv_layout)

    keys = c.allgather_checked(local)
    errors.same_everywhere(keys, "read_input's layouts (of the queries, of the keys)")
    meta = read_meta(path, c) if meta is None else meta
    shapes = meta["shapes"]
    compute = np.dtype(dtype) if dtype is not None else np.result_type(
        *(bfloat16_dtype() if meta["dtypes"][x] == BFLOAT16 else np.dtype(meta["dtypes"][x])
          for x in ("q", "k", "v")))
    n, m = shapes["q"][2], shapes["k"][2]
    arrays: dict[str, np.ndarray] = {}

    def read() -> list:
        with _open_read(path) as f:
            seen = [identity(f)]
            for name, shape in meta["stored"].items():
                axis = len(shape) - SEQ_AXIS_FROM_END[name]
                length = shape[axis]
                segs = all_segments(length, c.size, kv_layout if name in KEY_DATASETS else layout)[c.rank]
                x = _read_segments(f[name], segs, axis)
                if name in ("segment_ids", "kv_segment_ids"):
                    x = x.astype(np.int64, copy=False)
                elif name in stored.ROWS:  # bool, or float64 with -inf for hidden (checked later)
                    x = stored.as_read(name, x)
                elif name != "key_padding_mask":
                    if check_finite:
                        row = _first_nonfinite_row(x, axis, segs)
                        if row is not None:
                            raise NonFiniteError(f"dataset {name!r} in {path} contains NaN or Inf "
                                                 f"(first at sequence position {row})")
                    x = x.astype(compute, copy=False)
                promoted = list(shapes[name])
                promoted[-SEQ_AXIS_FROM_END[name]] = x.shape[axis]
                arrays[name] = x.reshape(promoted)
            arrays.update(read_whole_datasets(f, path, meta.get("whole", {})))
            return seen + [identity(f)]

    seen = c.allgather_checked(read)
    with errors.alike():  # the same gathered identities everywhere: the same verdict
        _same_input(path, meta["info"]["identity"], seen)
    return Inputs(path=path, q=arrays["q"], k=arrays["k"], v=arrays["v"], dout=arrays.get("dout"),
                  key_padding_mask=arrays.get("key_padding_mask"), n=n, m=m,
                  stored_ndim={k: len(s) for k, s in meta["stored"].items()},
                  causal=meta["causal"], scale=meta["scale"], layout=layout, info=meta["info"],
                  segment_ids=arrays.get("segment_ids"), kv_segment_ids=arrays.get("kv_segment_ids"),
                  window=meta["window"], kv_layout=kv_layout, score=stored.from_file(arrays))


def read_whole(path: str, name: str, comm: Any = None,
               meta: dict | None = None) -> tuple[dict, np.ndarray | None]:
    """The promoted global shapes of the datasets, and one (small) dataset whole, on every rank.

    Rank 0 validates the file (as :func:`read_input`; with ``meta``, the
    file must still be the one ``meta`` was read from) and reads the dataset
    (promoted like there: ``(B, L)`` for the mask and the ids); every rank
    receives both (the array is None when the file has no such dataset). For
    e.g. the document ids that ``--layout balanced`` needs.
    """
    c = get_comm(comm)
    path = os.path.abspath(path)

    def read() -> tuple:
        m = _read_meta(path) if meta is None else meta
        if name not in m["stored"]:
            return m["shapes"], None
        with _open_read(path) as f:
            _same_input(path, m["info"]["identity"], [[identity(f)]])
            x = f[name][...]
        return m["shapes"], x.reshape(m["shapes"][name])

    return on_rank0(c, read)
