"""Writing global datasets to HDF5, each rank its own rows, atomically.

* Parallel HDF5 (``h5py.get_config().mpi``): all ranks open the file with
  the ``mpio`` driver and write their slabs with collective transfers.
* Serial HDF5 (pip's h5py): rank 0 creates the datasets and writes its
  slabs; then each rank in turn opens the file ``r+``, writes its slabs and
  passes a token to the next rank (a failure travels with the token, so
  later ranks skip writing and nobody waits forever).

The file is published by :func:`mpiattn.io.atomic.write_atomically`.
Datasets are chunked along the sequence axis (chunks of about 1 MiB).

After a failed write (a full disk) h5py may report, through
``sys.unraisablehook``, each object of the broken file it cannot release;
the library leaves those reports alone (it replaces no process-wide hook),
and the command line hushes them for its run (:mod:`mpiattn.cli.quiet`).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm, get_comm
from ..layouts import all_segments, check_layout, describe, local_length
from .atomic import NoSpaceError, Target, publish
from .naming import NEW, REPLACE, Rule
from .hdf5types import BFLOAT16, bfloat16_type
from .publishing import Outputs

__all__ = ["Rows", "write_rows", "rows_target", "CHUNK_BYTES", "parallel_hdf5"]

#: Target size of one HDF5 chunk of an output dataset.
CHUNK_BYTES = 1 << 20

_TOKEN_TAG = 7301


def parallel_hdf5() -> bool:
    """True when h5py was built against a parallel (MPI) HDF5."""
    import h5py

    return bool(h5py.get_config().mpi)


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
    layout : str or Layout, optional
        The layout of these rows, when it is not the one passed to
        :func:`write_rows` (e.g. key rows of cross attention).
    """

    data: np.ndarray
    length: int
    axis: int
    layout: Any = None

    def global_shape(self) -> tuple[int, ...]:
        """Shape of the global array."""
        s = list(self.data.shape)
        s[self.axis] = self.length
        return tuple(s)


def _chunks(shape: tuple[int, ...], axis: int, itemsize: int) -> tuple[int, ...] | None:
    """Chunk shape: whole along every axis but ``axis``, about CHUNK_BYTES per chunk."""
    if 0 in shape:
        return None
    row = itemsize * int(np.prod([s for i, s in enumerate(shape) if i != axis], dtype=np.int64))
    rows = max(1, min(shape[axis], CHUNK_BYTES // max(row, 1)))
    return tuple(rows if i == axis else s for i, s in enumerate(shape))


def _local_meta(datasets: Mapping[str, Rows], nranks: int, rank: int, layout: Any) -> dict:
    meta = {}
    for name, rows in datasets.items():
        x = rows.data
        if not isinstance(x, np.ndarray):
            raise TypeError(f"dataset {name!r}: write_rows takes NumPy arrays (use backend.to_host)")
        if not 0 <= rows.axis < x.ndim:
            raise ValueError(f"dataset {name!r}: axis {rows.axis} out of range for ndim {x.ndim}")
        lay = layout if rows.layout is None else check_layout(rows.layout)
        want = local_length(rows.length, rank, nranks, lay)
        if x.shape[rows.axis] != want:
            raise ValueError(f"dataset {name!r}: rank {rank} holds {x.shape[rows.axis]} rows, the "
                             f"{describe(lay)} layout of {rows.length} rows gives it {want}")
        meta[name] = (rows.global_shape(), _dtype_key(x.dtype), rows.axis)
    return meta


def _dtype_key(dt: np.dtype) -> str:
    """A dataset's dtype in the metadata: its ``str``, or ``"bfloat16"`` (:mod:`mpiattn.io.hdf5types`)."""
    return BFLOAT16 if backend.is_bfloat16(dt) else dt.str


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
        if backend.is_bfloat16(x.dtype):  # the bits, unconverted, as the file's bfloat16 type
            ds.id.write(mspace, fspace, x.view(np.uint16), mtype=bfloat16_type(), dxpl=dxpl)
        else:
            ds.id.write(mspace, fspace, x, dxpl=dxpl)


def _create(f: Any, meta: dict, attrs: Mapping[str, Any]) -> None:
    import h5py

    for name, (shape, dtype, axis) in meta.items():
        if dtype == BFLOAT16:
            f.create_dataset(name, shape=shape, dtype=h5py.Datatype(bfloat16_type()),
                             chunks=_chunks(shape, axis, 2))
            continue
        dt = np.dtype(dtype)
        f.create_dataset(name, shape=shape, dtype=dt, chunks=_chunks(shape, axis, dt.itemsize))
    for key, value in attrs.items():
        if value is not None:
            f.attrs[key] = value


def _write_serial(c: Comm, tmp: str, meta: dict, datasets: Mapping[str, Rows],
                  segs_of: Callable[[Rows], list], attrs: Mapping[str, Any]) -> None:
    """Rank 0 creates; then ranks write in turn, a token carrying success from rank to rank."""
    import h5py

    err: BaseException | None = None
    c.point("the writers' token")
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


def _write_parallel(c: Comm, tmp: str, meta: dict, datasets: Mapping[str, Rows],
                    segs_of: Callable[[Rows], list], attrs: Mapping[str, Any],
                    path: str = "") -> None:
    """All ranks open the file with the mpio driver; collective creates and writes.

    A rank failing inside these collective calls would leave the others
    waiting in HDF5 forever, and closing the file is itself collective, so a
    failing rank removes the temporary file and aborts the job without
    closing it (with one rank the error is raised normally). An HDF5 error
    is told as what it is (:func:`_write_error`), so the abort prints one
    plain line, not an h5py traceback.
    """
    import h5py

    # Every rank meets here first, in an MPI call that releases Python's GIL. h5py holds the
    # GIL inside HDF5's collective calls (the mpio driver's MPI_Comm_dup, the create, the
    # close): a rank waiting there for a rank that a signal has stopped would keep its own
    # signal thread from ever aborting the job (seen with Debian's MPICH 4.0.2).
    c.barrier()
    with c.abort_on_error():
        f = h5py.File(tmp, "w-", driver="mpio", comm=c.mpi)
        try:
            _create(f, meta, attrs)
            _write_slabs(f, datasets, segs_of, collective=True)
        except BaseException as exc:
            try:  # leave no partial file behind; no close (collective)
                os.remove(tmp)
            except FileNotFoundError:  # another failing rank was quicker
                pass
            if c.size == 1:
                f.close()
            told = _write_error(exc, path or tmp)
            if told is None:
                raise
            raise told from exc
        f.close()


def _write_error(exc: BaseException, path: str) -> OSError | None:
    """The failure of an HDF5 call while writing ``path`` as an OSError (None: not HDF5's).

    h5py reports a failed collective write as a ValueError or RuntimeError
    whose text carries the MPI-IO error ("No space left on device" for a
    full disk). Only exceptions raised inside h5py are translated; anything
    else (a bug) keeps its type and traceback.
    """
    tb, inside = exc.__traceback__, False
    while tb is not None:
        inside = inside or "h5py" in tb.tb_frame.f_code.co_filename.split(os.sep)[:-1]
        tb = tb.tb_next
    if not inside or not isinstance(exc, Exception):
        return None
    if "No space left on device" in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC:
        return NoSpaceError(f"the disk filled up while writing {path} (No space left on "
                            f"device); nothing was written under that name")
    return OSError(errno.EIO, f"writing {path} with parallel HDF5 failed: {exc}")


def rows_target(path: str, datasets: Mapping[str, Rows], comm: Any = None, *,
                layout: str = "contiguous", attrs: Mapping[str, Any] | None = None,
                rule: Rule = NEW) -> Target:
    """The file of :func:`write_rows` as a :class:`~mpiattn.io.atomic.Target` (collective: the
    datasets are checked and agreed now), to publish with others (:func:`mpiattn.io.atomic.publish`).
    """
    c = get_comm(comm)
    path = os.path.abspath(path)
    metas = c.allgather_checked(lambda: (check_layout(layout),
                                         _local_meta(datasets, c.size, c.rank, layout))[1])
    errors.same_everywhere(metas, "write_rows' datasets (global shape, dtype, axis)")
    attrs = c.bcast_obj(dict(attrs or {})) if c.size > 1 else dict(attrs or {})

    def segs_of(rows: Rows) -> list:
        return all_segments(rows.length, c.size, layout if rows.layout is None else rows.layout)[c.rank]

    def write(tmp: str) -> None:
        if parallel_hdf5():
            _write_parallel(c, tmp, metas[0], datasets, segs_of, attrs, path)
        else:
            _write_serial(c, tmp, metas[0], datasets, segs_of, attrs)

    return Target(path, write, rule, data_bytes(metas[0]))


def write_rows(path: str, datasets: Mapping[str, Rows], comm: Any = None, *,
               layout: str = "contiguous", attrs: Mapping[str, Any] | None = None,
               force: bool = False, outputs: Outputs | None = None) -> None:
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
        Replace an existing ``path`` (its permission bits are kept).
    outputs : Outputs, optional
        The program's outputs, which a signal handler can stop
        (:func:`mpiattn.io.atomic.publish`).

    Raises
    ------
    ValueError, TypeError, OSError
        The same error on every rank; ``path`` is then unchanged and no
        temporary file remains. ``OSError`` with ``errno.ENOSPC`` before
        anything is written when the directory has too little free space.
    """
    c = get_comm(comm)
    target = rows_target(path, datasets, c, layout=layout, attrs=attrs,
                         rule=REPLACE if force else NEW)
    publish(c, [target], outputs=outputs)


def data_bytes(meta: Mapping[str, tuple]) -> int:
    """Bytes of array data in datasets ``{name: (global shape, dtype, axis)}``."""
    return sum(int(np.prod(shape, dtype=np.int64)) * (2 if dt == BFLOAT16 else np.dtype(dt).itemsize)
               for shape, dt, _ in meta.values())
