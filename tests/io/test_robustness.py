"""I/O robustness: any byte order, free space, locked temporaries and their clean-up.

Runs at any rank count (the full-disk tests through mpiexec are in
tests/cli/test_full_disk.py). Expected values come from h5py and NumPy.
"""

import errno
import os
import time

import h5py
import numpy as np
import pytest

from mpiattn import io
from mpiattn.io import atomic, temporaries
from mpiattn.io.temporaries import Temporary
from mpiattn.layouts import all_segments


def _on_rank0(comm, fn):
    result = fn() if comm.rank == 0 else None
    comm.barrier()
    return result


@pytest.mark.parametrize("order", [">", "<"])
@pytest.mark.parametrize("dtype", ["f2", "f4", "f8"])
def test_any_byte_order_is_read_in_native_order(comm, shared_dir, order, dtype):
    path = os.path.join(shared_dir, "in.h5")
    rng = np.random.default_rng(4)
    data = {"q": rng.standard_normal((1, 2, 11, 4)), "k": rng.standard_normal((1, 1, 7, 4)),
            "v": rng.standard_normal((1, 1, 7, 3)), "dout": rng.standard_normal((1, 2, 11, 3))}

    def make():
        with h5py.File(path, "w") as f:
            for name, x in data.items():
                f.create_dataset(name, data=x.astype(order + dtype))
            assert f["q"].dtype.str == order + dtype
    _on_rank0(comm, make)
    inp = io.read_input(path, comm, layout="zigzag")
    native = np.dtype(dtype).newbyteorder("=")
    for name, x in data.items():
        got = getattr(inp, name)
        assert got.dtype == native and got.dtype.isnative, name
        segs = all_segments(x.shape[2], comm.size, "zigzag")[comm.rank]
        want = np.concatenate([x[:, :, g:g + ln] for g, ln in segs], axis=2) if segs else x[:, :, :0]
        np.testing.assert_array_equal(got, want.astype(native))
    assert io.read_input(path, comm, dtype="float64").q.dtype == np.float64


def _rows(comm, n):
    """This rank's contiguous rows of arange(n) as one dataset ``x``."""
    x = np.arange(n, dtype=np.float32)
    segs = all_segments(n, comm.size, "contiguous")[comm.rank]
    local = np.concatenate([x[g:g + ln] for g, ln in segs]) if segs else x[:0]
    return {"x": io.Rows(local, n, 0)}


def test_output_needs_free_space(comm, shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "out.h5")
    st = os.statvfs(shared_dir)
    free = st.f_bavail * st.f_frsize
    io.check_output(path, comm, nbytes=1000)
    with pytest.raises(atomic.NoSpaceError, match="not enough free space") as info:
        io.check_output(path, comm, nbytes=free + 1)
    assert info.value.errno == errno.ENOSPC and "free" in str(info.value)
    with pytest.raises(OSError, match="not enough free space"):
        io.check_space(path, 2 * free, comm)
    assert atomic.space_needed(100 << 20) > 100 << 20
    monkeypatch.setattr(atomic, "space_needed", lambda n: 10 * free)  # write_rows checks too
    with pytest.raises(atomic.NoSpaceError):
        io.write_rows(path, _rows(comm, 4), comm)
    assert os.listdir(shared_dir) == []


def test_a_write_registers_and_locks_its_temporary(comm, shared_dir, monkeypatch):
    """While the write runs, every rank knows the temporary's name and rank 0 holds its lock."""
    from mpiattn.io import writing

    seen = {}
    outputs = io.Outputs()
    name = "_write_parallel" if io.parallel_hdf5() else "_write_serial"
    real = getattr(writing, name)

    def spy(c, tmp, *a):
        seen["registered"] = outputs.active() == {os.path.dirname(tmp)}
        seen["locked"] = os.path.exists(os.path.join(os.path.dirname(tmp), "lock"))
        seen["stale"] = _on_rank0(comm, lambda: temporaries.remove_stale(shared_dir, outputs.active()))
        real(c, tmp, *a)
    monkeypatch.setattr(writing, name, spy)
    io.write_rows(os.path.join(shared_dir, "out.h5"), _rows(comm, 6), comm, outputs=outputs)
    assert seen["registered"] and seen["locked"] and outputs.active() == frozenset()
    if comm.rank == 0:  # (the lock itself, seen from another writer: test_stale_temporaries_...)
        stale = seen["stale"]
        assert stale.removed == [] and stale.kept == [(stale.kept[0][0], "this process is writing it")]
    with h5py.File(os.path.join(shared_dir, "out.h5"), "r") as f:
        np.testing.assert_array_equal(f["x"][...], np.arange(6, dtype=np.float32))
    assert sorted(os.listdir(shared_dir)) == ["out.h5"]


def test_stale_temporaries_are_told_from_live_ones(serial_only, tmp_path):
    live = Temporary.reserve(str(tmp_path / "a.h5"))
    with open(live.data, "wb") as f:
        f.write(b"live")
    dead = Temporary.reserve(str(tmp_path / "b.h5"))
    with open(dead.data, "wb") as f:
        f.write(b"x" * 123)
    dead.close()  # its writer died: the lock is free, the files stay
    young_lockless = tmp_path / ".f.h5.mpiattn-00000000cc.tmp"  # a writer between mkdir and lock
    young_lockless.mkdir()
    old_lockless = tmp_path / ".g.h5.mpiattn-00000000dd.tmp"  # a removal cut short (NFS)
    old_lockless.mkdir()
    (old_lockless / ".nfs000123").write_bytes(b"w" * 7)
    os.utime(old_lockless, (time.time() - 2 * temporaries.LOCKLESS_DIR_AGE_S,) * 2)
    # an older mpiattn's temporaries: a data file, its lock file beside it (or none at all)
    old_dead = tmp_path / ".h.h5.mpiattn-00000000ee.tmp"
    old_dead.write_bytes(b"v" * 5)
    (tmp_path / (old_dead.name + ".lock")).write_bytes(b"pid 1")
    young_orphan = tmp_path / ".c.h5.mpiattn-00000000aa.tmp"
    young_orphan.write_bytes(b"y")
    old_orphan = tmp_path / ".d.h5.mpiattn-00000000bb.tmp"
    old_orphan.write_bytes(b"z")
    os.utime(old_orphan, (time.time() - 2 * temporaries.ORPHAN_AGE_S,) * 2)
    old_probe = tmp_path / ".mpiattn-probe-0123456789ab"
    old_probe.write_bytes(b"")
    os.utime(old_probe, (time.time() - 3600,) * 2)
    other = tmp_path / ".e.h5.tmp"  # not ours
    other.write_bytes(b"")
    stale = io.remove_stale(str(tmp_path))
    assert sorted(stale.removed) == sorted([(dead.dir, 123), (str(old_orphan), 1),
                                            (str(old_lockless), 0), (str(old_dead), 5)])
    kept = dict(stale.kept)
    assert "alive" in kept[live.dir] and f"pid {os.getpid()}" in kept[live.dir]
    assert "no lock file" in kept[str(young_orphan)] and "no lock file" in kept[str(young_lockless)]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(live.dir), young_lockless.name, young_orphan.name, other.name])
    live.publish(str(tmp_path / "a.h5"), replace=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["a.h5", young_lockless.name, young_orphan.name,
                                                   other.name])
    assert (tmp_path / "a.h5").read_bytes() == b"live"
    with pytest.raises(FileNotFoundError, match="not a directory"):
        io.remove_stale(str(tmp_path / "nowhere"))


def test_reserve_starts_over_when_a_cleaner_took_the_name(serial_only, tmp_path, monkeypatch):
    """A cleaner that removed a fresh temporary before its writer locked it costs a new name."""
    real = temporaries._lock
    calls = []

    def lock(fd, block):
        if not calls:  # the first reservation: a cleaner gets there first
            first = [p for p in os.listdir(tmp_path)][0]
            temporaries._remove_tree(str(tmp_path / first))
        calls.append(fd)
        return real(fd, block)
    monkeypatch.setattr(temporaries, "_lock", lock)
    tmp = Temporary.reserve(str(tmp_path / "out.h5"))
    assert len(calls) == 2 and os.listdir(tmp_path) == [os.path.basename(tmp.dir)]
    assert sorted(os.listdir(tmp.dir)) == ["lock"]
    assert tmp.remove() and os.listdir(tmp_path) == []


def _raised_in(filename, exc):
    """``exc`` raised from code compiled as ``filename`` (its traceback shows that file)."""
    scope = {"exc": exc}
    exec(compile("def fail():\n    raise exc\n", filename, "exec"), scope)
    try:
        scope["fail"]()
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_a_failed_collective_write_is_told_as_an_os_error(serial_only):
    """h5py's ValueError for a full disk -> NoSpaceError; other h5py errors -> OSError; ours kept."""
    from mpiattn.io.writing import _write_error

    inside = os.path.join(os.sep, "site-packages", "h5py", "_hl", "dataset.py")
    full = _raised_in(inside, ValueError("Unable to create dataset (MPI_File_write_at_all failed: "
                                         "Other I/O error No space left on device)"))
    told = _write_error(full, "/d/out.h5")
    assert isinstance(told, atomic.NoSpaceError) and told.errno == errno.ENOSPC
    assert str(told) == ("the disk filled up while writing /d/out.h5 (No space left on device); "
                         "nothing was written under that name")
    other = _write_error(_raised_in(inside, RuntimeError("Can't write data")), "/d/out.h5")
    assert type(other) is OSError and other.errno == errno.EIO and "Can't write data" in str(other)
    mine = _raised_in(os.path.join(os.sep, "work", "mpiattn", "io", "writing.py"), TypeError("bug"))
    assert _write_error(mine, "/d/out.h5") is None  # a bug of ours keeps its type and traceback
    assert _write_error(_raised_in(inside, KeyboardInterrupt()), "/d/out.h5") is None
