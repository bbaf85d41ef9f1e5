"""bfloat16 datasets in HDF5: the documented 16-bit float type, written and read bit for bit."""

import os

import h5py
import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import mpiattn  # noqa: E402
from mpiattn import io  # noqa: E402
from mpiattn.io.hdf5types import bfloat16_type, is_bfloat16_type  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _problem():
    rng = np.random.default_rng(0)
    # values far beyond float16's range (65504): a float16 round trip would lose them
    q = (rng.standard_normal((1, 2, 11, 4)) * 1e6).astype(BF16)
    k = rng.standard_normal((1, 1, 11, 4)).astype(BF16)
    v = rng.standard_normal((1, 1, 11, 3)).astype(BF16)
    return q, k, v


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_write_then_read_bit_for_bit(comm, shared_dir, layout):
    q, k, v = _problem()
    path = os.path.join(shared_dir, f"bf16-{layout}.h5")
    rows = {name: io.Rows(mpiattn.shard(x, layout=layout), 11, 2) for name, x in
            (("q", q), ("k", k), ("v", v))}
    io.write_rows(path, rows, comm, layout=layout)
    inp = io.read_input(path, comm, layout=layout, check_finite=False)
    assert inp.q.dtype == BF16 and inp.v.dtype == BF16
    np.testing.assert_array_equal(inp.q.view(np.uint16), mpiattn.shard(q, layout=layout).view(np.uint16))
    np.testing.assert_array_equal(inp.k.view(np.uint16), mpiattn.shard(k, layout=layout).view(np.uint16))
    comm.barrier()
    with h5py.File(path, "r") as f:  # what any h5py user sees: exact float32 values
        assert is_bfloat16_type(f["q"].id.get_type())
        assert f["q"].id.get_type().get_size() == 2
        np.testing.assert_array_equal(f["q"][...], q.astype(np.float32))
    comm.barrier()


def test_a_file_written_by_hand_with_the_documented_type(comm, shared_dir):
    """The type of docs/file-format.md, made with plain h5py, is read as bfloat16."""
    q, k, v = _problem()
    path = os.path.join(shared_dir, "by-hand.h5")
    if comm.rank == 0:
        t = h5py.h5t.IEEE_F32LE.copy()  # sign 15, exponent 7-14 (bias 127), mantissa 0-6
        t.set_fields(15, 7, 8, 0, 7)
        t.set_offset(0)
        t.set_precision(16)
        t.set_size(2)
        t.set_ebias(127)
        with h5py.File(path, "w") as f:
            for name, x in (("q", q), ("k", k), ("v", v)):
                ds = f.create_dataset(name, shape=x.shape, dtype=h5py.Datatype(t))
                ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, x.view(np.uint16), mtype=t)
    comm.barrier()
    inp = io.read_input(path, comm, check_finite=False)
    np.testing.assert_array_equal(inp.v.view(np.uint16), mpiattn.shard(v).view(np.uint16))
    out, _ = mpiattn.attention(inp.q.astype(np.float32), inp.k.astype(np.float32),
                               inp.v.astype(np.float32))
    assert np.isfinite(out).all()


def test_the_type_is_bfloat16s_layout():
    t = bfloat16_type()
    assert t.get_size() == 2 and t.get_ebias() == 127 and tuple(t.get_fields()) == (15, 7, 8, 0, 7)
    assert not is_bfloat16_type(h5py.h5t.IEEE_F16LE)


def test_run_checks_a_bfloat16_file(comm, shared_dir, capsys):
    """``run --check`` on a bfloat16 input: computed in bfloat16, checked at bfloat16's tolerance."""
    from mpiattn import cli

    rng = np.random.default_rng(1)
    N = 8 * comm.size
    data = {name: rng.standard_normal(shape).astype(BF16) for name, shape in
            (("q", (1, 2, N, 8)), ("k", (1, 2, N, 8)), ("v", (1, 2, N, 8)), ("dout", (1, 2, N, 8)))}
    path, out = os.path.join(shared_dir, "bf16-in.h5"), os.path.join(shared_dir, "bf16-out.h5")
    io.write_rows(path, {k: io.Rows(mpiattn.shard(x), N, 2) for k, x in data.items()}, comm)
    code = cli.main(["run", path, "-o", out, "--check", "--causal", "-q"])
    err = capsys.readouterr().err
    assert comm.allgather_obj(code) == [0] * comm.size, err
    comm.barrier()
    with h5py.File(out, "r") as f:
        assert is_bfloat16_type(f["out"].id.get_type()) and "dq" in f
