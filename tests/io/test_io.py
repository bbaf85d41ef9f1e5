"""HDF5 I/O: slab reads per layout, atomic writes, bad input, deterministic make-data.

Runs at any rank count. Files live in a directory every rank shares; expected
values come from h5py reading whole datasets (independent of mpiattn.io).
"""

import os

import h5py
import numpy as np
import pytest

from helpers import bad_input, whole
from mpiattn import io
from mpiattn.io import datagen, writing
from mpiattn.layouts import all_segments

SPEC = datagen.Spec(batch=2, heads=4, kv_heads=2, seq=37, kv_seq=29, dim=8, value_dim=5,
                    with_dout=True, padding=0.3, seed=3)


def _rows_of(x, segs, axis):
    if not segs:
        return np.take(x, np.zeros(0, dtype=int), axis=axis)
    return np.concatenate([np.take(x, np.arange(g, g + ln), axis=axis) for g, ln in segs], axis=axis)


def _write_spec(comm, path, spec, layout="contiguous", **kw):
    rows = {}
    for name, (shape, axis) in spec.datasets().items():
        segs = all_segments(shape[axis], comm.size, layout)[comm.rank]
        rows[name] = io.Rows(datagen.local_rows(spec, name, segs), shape[axis], axis)
    io.write_rows(path, rows, comm, layout=layout, **kw)


def _on_rank0(comm, fn):
    """Run a test-side file operation on rank 0 only, then synchronise."""
    if comm.rank == 0:
        fn()
    comm.barrier()


@pytest.mark.parametrize("write_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("read_layout", ["contiguous", "zigzag"])
def test_roundtrip(comm, shared_dir, write_layout, read_layout):
    path = os.path.join(shared_dir, "in.h5")
    _write_spec(comm, path, SPEC, write_layout, attrs={"causal": True, "scale": 0.5, "note": "x"})
    data, attrs = whole(path)
    for name, (shape, axis) in SPEC.datasets().items():
        want = datagen.rows(SPEC, name, 0, shape[axis])
        assert data[name].shape == shape and data[name].dtype == want.dtype
        np.testing.assert_array_equal(data[name], want)
    assert attrs["note"] == "x"
    inp = io.read_input(path, comm, layout=read_layout)
    assert (inp.n, inp.m, inp.causal, inp.scale, inp.layout) == (37, 29, True, 0.5, read_layout)
    qs = all_segments(37, comm.size, read_layout)[comm.rank]
    ks = all_segments(29, comm.size, read_layout)[comm.rank]
    np.testing.assert_array_equal(inp.q, _rows_of(data["q"], qs, 2))
    np.testing.assert_array_equal(inp.dout, _rows_of(data["dout"], qs, 2))
    np.testing.assert_array_equal(inp.k, _rows_of(data["k"], ks, 2))
    np.testing.assert_array_equal(inp.v, _rows_of(data["v"], ks, 2))
    np.testing.assert_array_equal(inp.key_padding_mask, _rows_of(data["key_padding_mask"], ks, 1))
    assert inp.key_padding_mask.dtype == np.bool_ and inp.q.dtype == np.float32
    assert inp.info["size"] == os.path.getsize(path)
    assert sorted(os.listdir(shared_dir)) == ["in.h5"]  # no temporary or probe file left


def test_compute_dtype_and_promotion(comm, shared_dir):
    path = os.path.join(shared_dir, "small.h5")
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((3, 7, 4)), rng.standard_normal((3, 7, 2))

    def make():
        with h5py.File(path, "w") as f:
            f["q"], f["k"], f["v"] = q.astype(np.float16), k.astype(np.float32), v
            f["key_padding_mask"] = np.arange(7) % 3 == 0
            f["dout"] = np.ones((5, 2))
    _on_rank0(comm, make)
    with pytest.raises(ValueError, match="multiple of Hkv"):  # q has 1 head, k has 3
        io.read_input(path, comm)

    def fix():
        with h5py.File(path, "a") as f:
            del f["k"], f["v"]
            f["k"], f["v"] = k[:1].astype(np.float32), v[:1]
    _on_rank0(comm, fix)
    inp = io.read_input(path, comm, layout="zigzag")
    assert inp.stored_ndim == {"q": 2, "k": 3, "v": 3, "dout": 2, "key_padding_mask": 1}
    assert inp.q.dtype == np.float64  # result type of float16, float32, float64
    qs = all_segments(5, comm.size, "zigzag")[comm.rank]
    ks = all_segments(7, comm.size, "zigzag")[comm.rank]
    np.testing.assert_array_equal(inp.q, _rows_of(q.astype(np.float16), qs, 0)[None, None])
    np.testing.assert_array_equal(inp.v, _rows_of(v[:1], ks, 1)[None])
    np.testing.assert_array_equal(inp.key_padding_mask[0], _rows_of(np.arange(7) % 3 == 0, ks, 0))
    one = io.read_input(path, comm, dtype="float32")
    assert one.q.dtype == one.k.dtype == one.dout.dtype == np.float32
    with pytest.raises(TypeError, match="compute dtype"):
        io.read_input(path, comm, dtype="int32")


def test_more_ranks_than_rows(comm, shared_dir):
    spec = datagen.Spec(batch=1, heads=2, kv_heads=1, seq=1, kv_seq=2, dim=3, value_dim=3, seed=9)
    path = os.path.join(shared_dir, "tiny.h5")
    _write_spec(comm, path, spec, "zigzag")
    data, _ = whole(path)
    np.testing.assert_array_equal(data["k"], datagen.rows(spec, "k", 0, 2))
    inp = io.read_input(path, comm)
    assert inp.q.shape == (1, 2, 1 if comm.rank == 0 else 0, 3)


BAD = [
    ("missing", FileNotFoundError, "does not exist"),
    ("not-hdf5", OSError, "cannot open"),
    ("no-k", ValueError, "no dataset 'k'"),
    ("q-5d", ValueError, "'q' has 5 dimensions"),
    ("k-1d", ValueError, "'k' has 1 dimensions"),
    ("E", ValueError, "feature size E"),
    ("M", ValueError, "length M"),
    ("heads", ValueError, "multiple of Hkv"),
    ("int", TypeError, "'q' has dtype int32"),
    ("complex", TypeError, "'v' has dtype complex64"),
    ("mask-shape", ValueError, "key_padding_mask has shape"),
    ("mask-dtype", TypeError, "must be boolean"),
    ("dout-shape", ValueError, "dout has shape"),
    ("nan", io.NonFiniteError, "'q' .* NaN or Inf \\(first at sequence position 5\\)"),
    ("inf", io.NonFiniteError, "'v' .* NaN or Inf \\(first at sequence position 1\\)"),
]


@pytest.mark.parametrize("kind,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(comm, shared_dir, kind, exc, match):
    path = os.path.join(shared_dir, f"bad-{kind}.h5")
    if kind != "missing":
        _on_rank0(comm, lambda: bad_input(kind, path))
    with pytest.raises(exc, match=match):  # raised on every rank
        io.read_input(path, comm, layout="zigzag")
    if kind in ("nan", "inf"):  # asked to, the reader keeps the non-finite value, where it was
        data, _ = whole(path)
        inp = io.read_input(path, comm, layout="zigzag", check_finite=False)
        for name in ("q", "k", "v"):
            segs = all_segments(data[name].shape[2], comm.size, "zigzag")[comm.rank]
            want = _rows_of(data[name], segs, 2)
            assert getattr(inp, name).dtype == want.dtype
            np.testing.assert_array_equal(getattr(inp, name), want)  # NaN/Inf at the same places
        bad = getattr(inp, "q" if kind == "nan" else "v")
        assert sum(comm.allgather_obj(int((~np.isfinite(bad)).sum()))) == 1


def test_check_output(comm, shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "out.h5")
    io.check_output(path, comm)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        io.check_output(os.path.join(shared_dir, "nodir", "out.h5"), comm)
    with pytest.raises(IsADirectoryError):
        io.check_output(shared_dir, comm, force=True)
    _on_rank0(comm, lambda: open(path, "w").close())
    with pytest.raises(FileExistsError, match="already exists"):
        io.check_output(path, comm)
    io.check_output(path, comm, force=True)
    if os.geteuid() == 0:  # root writes anywhere chmod allows nothing: use sysfs
        locked = "/sys" if os.path.isdir("/sys") else None
    else:
        locked = os.path.join(shared_dir, "locked")
        _on_rank0(comm, lambda: os.mkdir(locked, 0o555))
    if locked is None:
        pytest.skip("no unwritable directory available")
    with pytest.raises(PermissionError, match="cannot create files"):
        io.check_output(os.path.join(locked, "out.h5"), comm)
    rows = {"x": io.Rows(np.zeros((0, 2)), 0, 0)}
    with pytest.raises(PermissionError):
        io.write_rows(os.path.join(locked, "out.h5"), rows, comm)


def test_chunks_along_sequence(comm, shared_dir, monkeypatch):
    monkeypatch.setattr(writing, "CHUNK_BYTES", 4 * (2 * 3 * 4 * 4))  # 4 rows of a (2, 3, n, 4) float32 array
    n = 11
    segs = all_segments(n, comm.size)[comm.rank]
    full = np.arange(2 * 3 * n * 4, dtype=np.float32).reshape(2, 3, n, 4)
    lse = np.arange(2 * n, dtype=np.float64).reshape(2, n)
    path = os.path.join(shared_dir, "chunked.h5")
    io.write_rows(path, {"x": io.Rows(_rows_of(full, segs, 2), n, 2),
                         "lse": io.Rows(_rows_of(lse, segs, 1), n, 1)}, comm)
    with h5py.File(path, "r") as f:
        assert f["x"].chunks == (2, 3, 4, 4)
        assert f["lse"].chunks == (2, 11)
        np.testing.assert_array_equal(f["x"][...], full)
        np.testing.assert_array_equal(f["lse"][...], lse)


def test_write_rejects_inconsistent_rows(comm, shared_dir):
    path = os.path.join(shared_dir, "out.h5")
    rows = {"x": io.Rows(np.zeros((1, 3)), 4 * comm.size + 1, 0)}  # wrong local length
    with pytest.raises(ValueError, match="layout of"):
        io.write_rows(path, rows, comm)
    assert not os.listdir(shared_dir)


@pytest.mark.parametrize("where", ["last-rank-mid-write", "rank0-create"])
def test_failed_write_keeps_previous_output(comm, shared_dir, monkeypatch, where):
    if io.parallel_hdf5() and comm.size > 1:
        pytest.skip("with parallel HDF5 a failed write aborts the job (test_cli_e2e checks that)")
    path = os.path.join(shared_dir, "out.h5")
    _write_spec(comm, path, SPEC)
    before, _ = whole(path)
    comm.barrier()
    spec2 = datagen.Spec(**{**SPEC.__dict__, "seed": 4})
    real_write = writing._write_slabs
    if where == "last-rank-mid-write":
        def failing(f, datasets, segs_of, collective):
            if comm.rank == comm.size - 1:
                first = dict(list(datasets.items())[:1])
                real_write(f, first, segs_of, collective)  # part of the data reaches the file
                raise OSError("simulated: disk full")
            real_write(f, datasets, segs_of, collective)
        monkeypatch.setattr(writing, "_write_slabs", failing)
    else:
        def failing_create(f, meta, attrs):
            raise OSError("simulated: quota exceeded")
        monkeypatch.setattr(writing, "_create", failing_create)
    with pytest.raises(OSError, match="simulated"):  # every rank
        _write_spec(comm, path, spec2, force=True)
    after, _ = whole(path)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    assert sorted(os.listdir(shared_dir)) == ["out.h5"]


def test_read_attributes(comm, shared_dir):
    path = os.path.join(shared_dir, "a.h5")
    assert io.read_attributes(path, comm) is None
    _on_rank0(comm, lambda: bad_input("not-hdf5", path))
    assert io.read_attributes(path, comm) is None
    _write_spec(comm, os.path.join(shared_dir, "b.h5"), SPEC, attrs={"mpiattn_example": 1, "s": 0.5})
    assert io.read_attributes(os.path.join(shared_dir, "b.h5"), comm) == {"mpiattn_example": 1, "s": 0.5}


@pytest.mark.parametrize("name", ["q", "v", "key_padding_mask"])
def test_datagen_is_chunk_deterministic(name):
    spec = datagen.Spec(batch=2, heads=2, kv_heads=1, seq=600, kv_seq=530, dim=3, value_dim=2,
                        with_dout=True, padding=0.25, seed=11)
    shape, axis = spec.datasets()[name]
    whole = datagen.rows(spec, name, 0, shape[axis])
    assert whole.shape == shape
    for P in (1, 3, 7):  # any rank count produces the same global array
        for layout in ("contiguous", "zigzag"):
            parts = [datagen.local_rows(spec, name, s) for s in all_segments(shape[axis], P, layout)]
            idx = [i for s in all_segments(shape[axis], P, layout) for g, ln in s for i in range(g, g + ln)]
            np.testing.assert_array_equal(np.take(whole, idx, axis=axis), np.concatenate(parts, axis=axis))
    other = datagen.rows(datagen.Spec(**{**spec.__dict__, "seed": 12}), name, 0, shape[axis])
    assert not np.array_equal(whole, other)
    if name == "key_padding_mask":
        assert 0.15 < whole.mean() < 0.35
    else:
        assert abs(float(whole.std()) - 1) < 0.1
