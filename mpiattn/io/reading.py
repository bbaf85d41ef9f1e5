"""Reading an attention problem from HDF5, each rank only its own rows.

Rank 0 reads the file's metadata (dataset shapes, dtypes, attributes) and
validates it; every rank learns the verdict (the same error on every rank)
and the metadata. Each rank then reads only its rows of every dataset, one
hyperslab per layout segment (zigzag: two), straight into its buffer. No
array passes through another rank. The file format is described in
``docs/file-format.md``.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import get_comm
from ..layouts import all_segments, check_layout, layout_key
from ..masks.spec import ALIGNMENTS, check_causal
from .atomic import on_rank0
from .hdf5types import BFLOAT16, bfloat16_dtype, is_bfloat16_type
from .paths import missing

__all__ = ["NonFiniteError", "Inputs", "SEQ_AXIS_FROM_END", "KEY_DATASETS", "window_from_attribute",
           "read_whole", "parallel_hdf5", "file_info", "identity", "read_attributes", "read_meta",
           "read_input"]

#: Input datasets and the axis (from the end) of their sequence dimension.
SEQ_AXIS_FROM_END = {"q": 2, "k": 2, "v": 2, "dout": 2, "key_padding_mask": 1, "segment_ids": 1,
                     "kv_segment_ids": 1}

#: Datasets along the keys (M rows, read by the keys' layout); the others run along the queries.
KEY_DATASETS = ("k", "v", "key_padding_mask", "kv_segment_ids")

#: Datasets stored (B, L) or (L,): the padding mask and the document ids.
_ROWS_2D = ("key_padding_mask", "segment_ids", "kv_segment_ids")


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
        :func:`file_info` of the input file.
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


def parallel_hdf5() -> bool:
    """True when h5py was built against a parallel (MPI) HDF5."""
    import h5py

    return bool(h5py.get_config().mpi)


def file_info(path: str, identity: tuple | None = None) -> dict:
    """``{"path", "size", "mtime", "identity"}`` of a file.

    The absolute path, bytes, ISO-8601 UTC modification time, and the
    identity ``(device, inode, size, mtime_ns)`` (:func:`identity`; by
    default that of ``path`` now).
    """
    if identity is None:
        st = os.stat(path)
        identity = (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))
    mtime = datetime.datetime.fromtimestamp(identity[3] / 1e9, tz=datetime.timezone.utc)
    return {"path": os.path.abspath(path), "size": identity[2],
            "mtime": mtime.isoformat(timespec="seconds"), "identity": identity}


def identity(f: Any) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of the file an open h5py ``File`` reads.

    From its file descriptor, so it names the file actually opened even if
    the path now leads elsewhere.
    """
    try:
        st = os.fstat(f.id.get_vfd_handle())
    except Exception:  # noqa: BLE001 - a driver without a descriptor: the path, at once
        st = os.stat(f.filename)
    return (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))


def _same_input(path: str, want: tuple, got: list) -> None:
    """Raise unless every rank's identities in ``got`` equal ``want`` (every rank decides alike)."""
    for r, ids in enumerate(got):
        for seen in ids:
            if tuple(seen) != tuple(want):
                what = ("another file (device, inode " f"{seen[0]}, {seen[1]})"
                        if tuple(seen[:2]) != tuple(want[:2]) else
                        f"the same file changed (size {seen[2]} bytes, modified "
                        f"{seen[3] / 1e9:.3f}; first seen: {want[2]} bytes, {want[3] / 1e9:.3f})")
                raise ValueError(f"input file {path} changed while this run was reading it: rank "
                                 f"{r} found {what}; nothing was computed. Run again once nothing "
                                 "replaces or writes the input")


def _open_read(path: str) -> Any:
    import h5py

    problem = missing(path, "input file")
    if problem is not None:
        raise problem
    if os.path.isdir(path):
        raise IsADirectoryError(f"input {path} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise OSError(f"cannot open {path} as an HDF5 file: {exc}") from None


def _plain(value: Any) -> Any:
    """HDF5 attribute value -> plain Python scalar/str."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def read_attributes(path: str, comm: Any = None) -> dict | None:
    """The root attributes of an HDF5 file (plain Python values), or None when it is not one.

    Rank 0 reads; every rank receives the result (or the same error).
    """
    c = get_comm(comm)

    def attrs() -> dict | None:
        try:
            f = _open_read(path)
        except OSError:
            return None
        with f:
            return {k: _plain(v) for k, v in f.attrs.items()}

    return on_rank0(c, attrs)


# --------------------------------------------------------------------- reading
def _promoted(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Stored shape -> 4-D (2-D for the mask and the ids) by leading axes of length 1."""
    want = 2 if name in _ROWS_2D else 4
    lo = 1 if name in _ROWS_2D else 2
    if not lo <= len(shape) <= want:
        forms = "(B, L) or (L,)" if name in _ROWS_2D else "(B, H, L, F), (H, L, F) or (L, F)"
        raise ValueError(f"dataset {name!r} has {len(shape)} dimensions {shape}; expected {forms}")
    return (1,) * (want - len(shape)) + tuple(shape)


def _check_dtype(name: str, dt: np.dtype) -> None:
    if name in ("segment_ids", "kv_segment_ids"):
        if dt.kind not in "iu":
            raise TypeError(f"dataset {name!r} has dtype {dt}; document ids must be integers")
        return
    if name == "key_padding_mask":
        if dt != np.bool_:
            raise TypeError(f"dataset 'key_padding_mask' has dtype {dt}; it must be boolean "
                            "(True = padding key to ignore)")
        return
    if dt.kind != "f" or dt.newbyteorder("=") not in backend.SUPPORTED_DTYPES:
        raise TypeError(f"dataset {name!r} has dtype {dt}; mpiattn needs real floating-point "
                        "data (float16, bfloat16, float32 or float64, any byte order)")


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
        stored, dtypes = {}, {}
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
            _check_dtype(name, ds.dtype)
            stored[name] = tuple(int(s) for s in ds.shape)
            dtypes[name] = (BFLOAT16 if is_bfloat16_type(ds.id.get_type())  # docs/file-format.md
                            else ds.dtype.newbyteorder("=").str)  # read in native byte order
        shapes = {name: _promoted(name, s) for name, s in stored.items()}
        _validate(shapes)
        causal = _causal_attribute(path, f.attrs.get("causal"))
        scale = _scale_attribute(path, f.attrs.get("scale"))
        try:
            window = window_from_attribute(f.attrs.get("window"))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        info = file_info(path, identity(f))
    return {"stored": stored, "shapes": shapes, "dtypes": dtypes, "info": info,
            "causal": causal, "scale": scale, "window": window}


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


def _scale_attribute(path: str, value: Any) -> float | None:
    """The ``scale`` attribute: a finite real number (not a string, not a boolean), else ValueError."""
    if value is None:
        return None
    plain = _plain(value)
    if isinstance(plain, bool) or not isinstance(plain, (int, float)):
        raise ValueError(f"{path}: attribute 'scale' must be a number, got {value!r} "
                         f"({type(plain).__name__})")
    if not math.isfinite(plain):
        raise ValueError(f"{path}: attribute 'scale' must be finite, got {plain!r}")
    return float(plain)


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


def read_meta(path: str, comm: Any = None) -> dict:
    """The validated metadata of an input file, on every rank (rank 0 reads it).

    Returns
    -------
    dict
        ``stored`` and ``shapes`` (promoted) per dataset, ``dtypes``,
        ``causal``, ``scale``, ``window`` (the attributes, checked), and
        ``info`` (:func:`file_info`, with the identity of the file read).
        Pass it to :func:`read_input` and :func:`read_whole`, which check
        that every later open finds the same file.

    Raises
    ------
    FileNotFoundError, OSError, ValueError, TypeError
        The same error on every rank.
    """
    c = get_comm(comm)
    return on_rank0(c, lambda: _read_meta(os.path.abspath(path)))


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
        The rows of the key datasets (:data:`KEY_DATASETS`); default ``layout``.
    dtype : dtype, optional
        Compute dtype for ``q``, ``k``, ``v``, ``dout``; default the common
        type of the stored ``q``, ``k``, ``v``.
    check_finite : bool
        Raise :class:`NonFiniteError` when a dataset holds NaN or Inf.
    meta : dict, optional
        :func:`read_meta` of the file, when the caller read it already.

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
            for name, stored in meta["stored"].items():
                axis = len(stored) - SEQ_AXIS_FROM_END[name]
                length = stored[axis]
                segs = all_segments(length, c.size, kv_layout if name in KEY_DATASETS else layout)[c.rank]
                x = _read_segments(f[name], segs, axis)
                if name in ("segment_ids", "kv_segment_ids"):
                    x = x.astype(np.int64, copy=False)
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
            return seen + [identity(f)]

    seen = c.allgather_checked(read)
    with errors.alike():  # the same gathered identities everywhere: the same verdict
        _same_input(path, meta["info"]["identity"], seen)
    return Inputs(path=path, q=arrays["q"], k=arrays["k"], v=arrays["v"], dout=arrays.get("dout"),
                  key_padding_mask=arrays.get("key_padding_mask"), n=n, m=m,
                  stored_ndim={k: len(s) for k, s in meta["stored"].items()},
                  causal=meta["causal"], scale=meta["scale"], layout=layout, info=meta["info"],
                  segment_ids=arrays.get("segment_ids"), kv_segment_ids=arrays.get("kv_segment_ids"),
                  window=meta["window"], kv_layout=kv_layout)


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
