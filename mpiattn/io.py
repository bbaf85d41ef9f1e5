"""HDF5 input and output, each rank touching only its own rows.

Reading
    Rank 0 reads the file's metadata (dataset shapes, dtypes, attributes)
    and validates it; every rank learns the verdict (the same error on every
    rank) and the metadata. Each rank then reads only its rows of every
    dataset, one hyperslab per layout segment (zigzag: two), straight into
    its buffer. No array passes through another rank.

Writing (:func:`write_rows`)
    Outputs go to a temporary file ``.NAME.mpiattn-XXXX.tmp`` in the target
    directory, which rank 0 renames to ``NAME`` only after every rank has
    reported success. A failure leaves no partial file under ``NAME`` and a
    previous ``NAME`` untouched (the temporary file is removed).

    * Parallel HDF5 (``h5py.get_config().mpi``): all ranks open the file with
      the ``mpio`` driver and write their slabs with collective transfers.
    * Serial HDF5 (pip's h5py): rank 0 creates the datasets and writes its
      slabs; then each rank in turn opens the file ``r+``, writes its slabs and
      passes a token to the next rank (a failure travels with the token, so
      later ranks skip writing and nobody waits forever).

Datasets are chunked along the sequence axis (chunks of about 1 MiB). The
file format is described in ``docs/file-format.md``.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from . import backend
from .comm import get_comm
from .layouts import all_segments, check_layout, local_length

__all__ = ["NonFiniteError", "Rows", "Inputs", "parallel_hdf5", "file_info", "read_attributes",
           "read_input", "check_output", "write_rows", "CHUNK_BYTES"]

#: Target size of one HDF5 chunk of an output dataset.
CHUNK_BYTES = 1 << 20

#: Input datasets and the axis (from the end) of their sequence dimension.
_SEQ_AXIS_FROM_END = {"q": 2, "k": 2, "v": 2, "dout": 2, "key_padding_mask": 1}

_TOKEN_TAG = 7301


class NonFiniteError(ValueError):
    """An input dataset holds NaN or Inf values."""


@dataclass
class Rows:
    """This rank's rows of one global array.

    Attributes
    ----------
    data : numpy.ndarray
        The local rows, in the layout's local order along ``axis``.
    length : int
        Global length of the sequence axis.
    axis : int
        The sequence axis of ``data`` (non-negative).
    """

    data: np.ndarray
    length: int
    axis: int

    def global_shape(self) -> tuple[int, ...]:
        """Shape of the global array."""
        s = list(self.data.shape)
        s[self.axis] = self.length
        return tuple(s)


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
    n, m : int
        Global query and key/value lengths ``N`` and ``M``.
    stored_ndim : dict
        Dataset name -> number of dimensions in the file (2-D and 3-D arrays
        are promoted to 4-D by adding leading axes of length 1).
    causal, scale
        The file's ``causal`` and ``scale`` attributes (None when absent).
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
    causal: bool | None = None
    scale: float | None = None
    layout: str = "contiguous"
    info: dict = field(default_factory=dict)


def parallel_hdf5() -> bool:
    """True when h5py was built against a parallel (MPI) HDF5."""
    import h5py

    return bool(h5py.get_config().mpi)


def file_info(path: str) -> dict:
    """``{"path", "size", "mtime"}`` of a file: absolute path, bytes, ISO-8601 UTC time."""
    st = os.stat(path)
    mtime = datetime.datetime.fromtimestamp(st.st_mtime, tz=datetime.timezone.utc)
    return {"path": os.path.abspath(path), "size": int(st.st_size),
            "mtime": mtime.isoformat(timespec="seconds")}


def _on_rank0(c: Any, fn: Callable[[], Any]) -> Any:
    """Run the local ``fn`` on rank 0; its error is raised on every rank, its result broadcast."""
    result = None
    with c.collective_errors():
        if c.rank == 0:
            result = fn()
    return c.bcast_obj(result) if c.size > 1 else result


def _open_read(path: str) -> Any:
    import h5py

    if not os.path.exists(path):
        raise FileNotFoundError(f"input file {path} does not exist")
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

    return _on_rank0(c, attrs)


# --------------------------------------------------------------------- reading
def _promoted(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Stored shape -> 4-D (2-D for the mask) by leading axes of length 1."""
    want = 2 if name == "key_padding_mask" else 4
    lo = 1 if name == "key_padding_mask" else 2
    if not lo <= len(shape) <= want:
        forms = "(B, M) or (M,)" if name == "key_padding_mask" else "(B, H, L, F), (H, L, F) or (L, F)"
        raise ValueError(f"dataset {name!r} has {len(shape)} dimensions {shape}; expected {forms}")
    return (1,) * (want - len(shape)) + tuple(shape)


def _check_dtype(name: str, dt: np.dtype) -> None:
    if name == "key_padding_mask":
        if dt != np.bool_:
            raise TypeError(f"dataset 'key_padding_mask' has dtype {dt}; it must be boolean "
                            "(True = padding key to ignore)")
        return
    if dt.kind != "f" or dt not in backend.SUPPORTED_DTYPES:
        raise TypeError(f"dataset {name!r} has dtype {dt}; mpiattn needs real floating-point "
                        "data (float16, float32 or float64)")


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
    if "dout" in shapes and shapes["dout"] != (B, H, N, Ev):
        raise ValueError(f"dout has shape {shapes['dout']}, expected (B, H, N, Ev) = {(B, H, N, Ev)}")
    if "key_padding_mask" in shapes and shapes["key_padding_mask"] != (B, M):
        raise ValueError(f"key_padding_mask has shape {shapes['key_padding_mask']}, "
                         f"expected (B, M) = {(B, M)}")


def _read_meta(path: str) -> dict:
    """Metadata of an input file, validated (run on one rank)."""
    with _open_read(path) as f:
        stored, dtypes = {}, {}
        for name in _SEQ_AXIS_FROM_END:
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
            dtypes[name] = ds.dtype.str
        shapes = {name: _promoted(name, s) for name, s in stored.items()}
        _validate(shapes)
        causal = f.attrs.get("causal")
        scale = f.attrs.get("scale")
        if causal is not None and _plain(causal) not in (0, 1, True, False):
            raise ValueError(f"{path}: attribute 'causal' must be a boolean, got {causal!r}")
        if scale is not None:
            try:
                scale = float(_plain(scale))
            except (TypeError, ValueError):
                raise ValueError(f"{path}: attribute 'scale' must be a number, got {scale!r}") from None
    return {"stored": stored, "shapes": shapes, "dtypes": dtypes, "info": file_info(path),
            "causal": None if causal is None else bool(_plain(causal)), "scale": scale}


def _read_segments(ds: Any, segs: list[tuple[int, int]], axis: int) -> np.ndarray:
    """Rows ``segs`` of dataset ``ds`` along ``axis``, one hyperslab per segment."""
    shape = list(ds.shape)
    shape[axis] = sum(ln for _, ln in segs)
    out = np.empty(shape, dtype=ds.dtype)
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


def read_input(path: str, comm: Any = None, *, layout: str = "contiguous", dtype: Any = None,
               check_finite: bool = True) -> Inputs:
    """Read this rank's rows of an attention problem from an HDF5 file.

    Parameters
    ----------
    path : str
        File with datasets ``q`` (B, H, N, E), ``k`` (B, Hkv, M, E), ``v``
        (B, Hkv, M, Ev), optionally ``dout`` (B, H, N, Ev) and
        ``key_padding_mask`` (B, M) bool. ``q``, ``k``, ``v``, ``dout`` may
        also be stored 3-D (H, L, F) or 2-D (L, F), the mask 1-D (M,).
    comm : mpi4py.MPI.Intracomm, optional
        Communicator (default ``MPI.COMM_WORLD``).
    layout : {"contiguous", "zigzag"}
        Which rows each rank reads (:mod:`mpiattn.layouts`).
    dtype : dtype, optional
        Compute dtype for ``q``, ``k``, ``v``, ``dout``; default the common
        type of the stored ``q``, ``k``, ``v``.
    check_finite : bool
        Raise :class:`NonFiniteError` when a dataset holds NaN or Inf.

    Returns
    -------
    Inputs
        Arrays promoted to 4-D (mask 2-D), this rank's rows only.

    Raises
    ------
    FileNotFoundError, OSError, ValueError, TypeError, NonFiniteError
        The same error on every rank.
    """
    c = get_comm(comm)
    path = os.path.abspath(path)
    with c.collective_errors():
        check_layout(layout)
        if dtype is not None:
            backend.check_dtype(dtype, "the compute dtype")
    meta = _on_rank0(c, lambda: _read_meta(path))
    shapes = meta["shapes"]
    compute = np.dtype(dtype) if dtype is not None else np.result_type(
        *(np.dtype(meta["dtypes"][x]) for x in ("q", "k", "v")))
    n, m = shapes["q"][2], shapes["k"][2]
    arrays: dict[str, np.ndarray] = {}
    with c.collective_errors():
        with _open_read(path) as f:
            for name, stored in meta["stored"].items():
                axis = len(stored) - _SEQ_AXIS_FROM_END[name]
                length = stored[axis]
                segs = all_segments(length, c.size, layout)[c.rank]
                x = _read_segments(f[name], segs, axis)
                if name != "key_padding_mask":
                    if check_finite:
                        row = _first_nonfinite_row(x, axis, segs)
                        if row is not None:
                            raise NonFiniteError(f"dataset {name!r} in {path} contains NaN or Inf "
                                                 f"(first at sequence position {row})")
                    x = x.astype(compute, copy=False)
                promoted = list(shapes[name])
                promoted[-_SEQ_AXIS_FROM_END[name]] = x.shape[axis]
                arrays[name] = x.reshape(promoted)
    return Inputs(path=path, q=arrays["q"], k=arrays["k"], v=arrays["v"], dout=arrays.get("dout"),
                  key_padding_mask=arrays.get("key_padding_mask"), n=n, m=m,
                  stored_ndim={k: len(s) for k, s in meta["stored"].items()},
                  causal=meta["causal"], scale=meta["scale"], layout=layout, info=meta["info"])


# --------------------------------------------------------------------- writing
def _output_problem(path: str, force: bool) -> None:
    """Raise when ``path`` cannot be (over)written: local checks plus a probe file."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"output directory {directory} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"output {path} is a directory")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"output {path} already exists (overwrite with force=True, "
                              "--force on the command line)")
    probe = os.path.join(directory, f".mpiattn-probe-{uuid.uuid4().hex[:12]}")
    try:
        with open(probe, "x"):
            pass
    except OSError as exc:
        raise PermissionError(f"cannot create files in output directory {directory}: "
                              f"{exc.strerror or exc}") from None
    os.remove(probe)


def check_output(path: str, comm: Any = None, *, force: bool = False) -> None:
    """Check, before computing, that ``path`` can be written (rank 0 checks; same error everywhere).

    Raises
    ------
    FileNotFoundError
        The directory does not exist.
    PermissionError
        No file can be created in the directory.
    FileExistsError
        ``path`` exists and ``force`` is False.
    IsADirectoryError
        ``path`` is a directory.
    """
    c = get_comm(comm)
    _on_rank0(c, lambda: _output_problem(os.path.abspath(path), force))


def _chunks(shape: tuple[int, ...], axis: int, itemsize: int) -> tuple[int, ...] | None:
    """Chunk shape: whole along every axis but ``axis``, about CHUNK_BYTES per chunk."""
    if 0 in shape:
        return None
    row = itemsize * int(np.prod([s for i, s in enumerate(shape) if i != axis], dtype=np.int64))
    rows = max(1, min(shape[axis], CHUNK_BYTES // max(row, 1)))
    return tuple(rows if i == axis else s for i, s in enumerate(shape))


def _local_meta(datasets: Mapping[str, Rows], nranks: int, rank: int, layout: str) -> dict:
    meta = {}
    for name, rows in datasets.items():
        x = rows.data
        if not isinstance(x, np.ndarray):
            raise TypeError(f"dataset {name!r}: write_rows takes NumPy arrays (use backend.to_host)")
        if not 0 <= rows.axis < x.ndim:
            raise ValueError(f"dataset {name!r}: axis {rows.axis} out of range for ndim {x.ndim}")
        want = local_length(rows.length, rank, nranks, layout)
        if x.shape[rows.axis] != want:
            raise ValueError(f"dataset {name!r}: rank {rank} holds {x.shape[rows.axis]} rows, the "
                             f"{layout} layout of {rows.length} rows gives it {want}")
        meta[name] = (rows.global_shape(), x.dtype.str, rows.axis)
    return meta


def _select(space: Any, shape: tuple[int, ...], segs: list[tuple[int, int]], axis: int) -> None:
    """Select the union of the segments' hyperslabs in a file dataspace (or nothing)."""
    from h5py import h5s

    space.select_none()
    first = True
    for g, ln in segs:
        start = tuple(g if i == axis else 0 for i in range(len(shape)))
        count = tuple(ln if i == axis else s for i, s in enumerate(shape))
        space.select_hyperslab(start, count, op=h5s.SELECT_SET if first else h5s.SELECT_OR)
        first = False


def _write_slabs(f: Any, datasets: Mapping[str, Rows], segs_of: Callable[[Rows], list],
                 collective: bool) -> None:
    """Write this rank's rows of every dataset, one H5Dwrite per dataset.

    The file selection is the union of the segments' hyperslabs; HDF5 maps
    it to the memory buffer in row-major order, which is the local order
    because a rank's segments are increasing in global position.
    With ``collective`` every rank makes exactly one (possibly empty) call per
    dataset, as collective MPI-IO requires.
    """
    from h5py import h5fd, h5p, h5s

    for name, rows in datasets.items():
        ds = f[name]
        x = np.ascontiguousarray(rows.data)
        segs = segs_of(rows)
        dxpl = h5p.create(h5p.DATASET_XFER)
        if collective:
            dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
        elif x.size == 0:
            continue
        fspace = ds.id.get_space()
        _select(fspace, ds.shape, segs if x.size else [], rows.axis)
        if x.size:
            mspace = h5s.create_simple(x.shape)
        else:
            mspace = h5s.create(h5s.SCALAR)
            mspace.select_none()
            x = np.zeros(1, dtype=x.dtype)
        ds.id.write(mspace, fspace, x, dxpl=dxpl)


def _create(f: Any, meta: dict, attrs: Mapping[str, Any]) -> None:
    for name, (shape, dtype, axis) in meta.items():
        dt = np.dtype(dtype)
        f.create_dataset(name, shape=shape, dtype=dt, chunks=_chunks(shape, axis, dt.itemsize))
    for key, value in attrs.items():
        if value is not None:
            f.attrs[key] = value


def _remove(path: str | None) -> None:
    if path is not None and os.path.lexists(path):
        os.remove(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_serial(c: Any, tmp: str, meta: dict, datasets: Mapping[str, Rows],
                  segs_of: Callable[[Rows], list], attrs: Mapping[str, Any]) -> None:
    """Rank 0 creates; then ranks write in turn, a token carrying success from rank to rank."""
    import h5py

    err: BaseException | None = None
    upstream_ok = True if c.rank == 0 else c.mpi.recv(source=c.rank - 1, tag=_TOKEN_TAG)
    has_rows = c.rank == 0 or any(rows.data.size for rows in datasets.values())
    if upstream_ok and has_rows:  # if not upstream_ok, an earlier rank failed and reports it
        try:
            with h5py.File(tmp, "w-" if c.rank == 0 else "r+") as f:
                if c.rank == 0:
                    _create(f, meta, attrs)
                _write_slabs(f, datasets, segs_of, collective=False)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            err = exc
    if c.rank + 1 < c.size:
        c.mpi.send(upstream_ok and err is None, dest=c.rank + 1, tag=_TOKEN_TAG)
    with c.collective_errors():
        if err is not None:
            raise err


def _write_parallel(c: Any, tmp: str, meta: dict, datasets: Mapping[str, Rows],
                    segs_of: Callable[[Rows], list], attrs: Mapping[str, Any]) -> None:
    """All ranks open the file with the mpio driver; collective creates and writes.

    A rank failing inside these collective calls would leave the others
    waiting in HDF5 forever, and closing the file is itself collective, so a
    failing rank removes the temporary file and aborts the job without
    closing it (with one rank the error is raised normally).
    """
    import h5py

    with c.abort_on_error():
        f = h5py.File(tmp, "w-", driver="mpio", comm=c.mpi)
        try:
            _create(f, meta, attrs)
            _write_slabs(f, datasets, segs_of, collective=True)
        except BaseException:
            _remove(tmp)  # leave no partial file behind; no close (collective)
            if c.size == 1:
                f.close()
            raise
        f.close()


def write_rows(path: str, datasets: Mapping[str, Rows], comm: Any = None, *,
               layout: str = "contiguous", attrs: Mapping[str, Any] | None = None,
               force: bool = False) -> None:
    """Write global datasets, each rank its own rows, atomically.

    Parameters
    ----------
    path : str
        The output file. Written under a temporary name in the same
        directory, renamed to ``path`` once every rank succeeded.
    datasets : mapping of str to Rows
        Name -> this rank's rows (NumPy, in the layout's local order). Every
        rank passes the same names with compatible shapes.
    comm : mpi4py.MPI.Intracomm, optional
    layout : {"contiguous", "zigzag"}
        The layout of every dataset's rows.
    attrs : mapping, optional
        Root attributes (rank 0's values are used); None values are skipped.
    force : bool
        Replace an existing ``path``.

    Raises
    ------
    ValueError, TypeError, OSError
        The same error on every rank; ``path`` is then unchanged and no
        temporary file remains.
    """
    c = get_comm(comm)
    path = os.path.abspath(path)
    metas = c.allgather_checked(lambda: (check_layout(layout),
                                         _local_meta(datasets, c.size, c.rank, layout))[1])
    with c.collective_errors():
        for r, other in enumerate(metas):
            if other != metas[0]:
                raise ValueError(f"write_rows: rank {r} passed datasets {other}, rank 0 {metas[0]}")
    attrs = c.bcast_obj(dict(attrs or {})) if c.size > 1 else dict(attrs or {})
    check_output(path, c, force=force)
    tmp = c.bcast_obj(os.path.join(os.path.dirname(path),
                                   f".{os.path.basename(path)}.mpiattn-{uuid.uuid4().hex[:10]}.tmp"))

    def segs_of(rows: Rows) -> list:
        return all_segments(rows.length, c.size, layout)[c.rank]

    try:
        if parallel_hdf5():
            _write_parallel(c, tmp, metas[0], datasets, segs_of, attrs)
        else:
            _write_serial(c, tmp, metas[0], datasets, segs_of, attrs)

        def publish() -> None:
            if not force and os.path.lexists(path):
                raise FileExistsError(f"output {path} appeared while writing; not replaced")
            _fsync(tmp)
            os.replace(tmp, path)

        _on_rank0(c, publish)
    except Exception:  # raised identically on every rank: clean up, then let everyone raise
        if c.rank == 0:
            _remove(tmp)
        c.barrier()  # nobody returns before the temporary file is gone
        raise
    except BaseException:
        if c.rank == 0:
            _remove(tmp)
        raise
