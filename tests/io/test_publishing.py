"""Publishing outputs: an atomic no-clobber, the commit point, and the veto of a signal.

Runs at any rank count; the tests that need one process only say so.
"""

import errno
import os
import threading

import h5py
import numpy as np
import pytest

from mpiattn import io
from mpiattn.io import publishing, temporaries
from mpiattn.io.temporaries import Temporary, publish_file
from mpiattn.layouts import all_segments


def _rows(comm, n, value=0.0):
    x = np.arange(n, dtype=np.float32) + value
    segs = all_segments(n, comm.size, "contiguous")[comm.rank]
    local = np.concatenate([x[g:g + ln] for g, ln in segs]) if segs else x[:0]
    return {"x": io.Rows(local, n, 0)}


def _x(path):
    with h5py.File(path, "r") as f:
        return f["x"][...]


def test_an_output_that_appears_while_writing_is_never_replaced(comm, shared_dir, monkeypatch):
    """D3: another job publishes between our start and our publish; without force we refuse."""
    target = os.path.join(shared_dir, "out.h5")
    real = publishing.Outputs.publish

    def other_job_first(self, tmp, path, *, replace):
        with open(path, "wb") as f:  # (rank 0 publishes: the other job's file appears just now)
            f.write(b"the other job's output")
        return real(self, tmp, path, replace=replace)
    monkeypatch.setattr(publishing.Outputs, "publish", other_job_first)
    with pytest.raises(FileExistsError, match="appeared while this run was writing it; not replaced"):
        io.write_rows(target, _rows(comm, 5), comm)
    comm.barrier()
    with open(target, "rb") as f:
        assert f.read() == b"the other job's output"
    assert sorted(os.listdir(shared_dir)) == ["out.h5"]
    io.write_rows(target, _rows(comm, 5, 1.0), comm, force=True)  # force replaces atomically
    np.testing.assert_array_equal(_x(target), np.arange(5, dtype=np.float32) + 1)
    assert sorted(os.listdir(shared_dir)) == ["out.h5"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "renameat2"])
def test_concurrent_publishers_one_wins(serial_only, tmp_path, monkeypatch, links):
    """D3: many writers publish to one name at once without force: exactly one succeeds."""
    if not links:
        def no_links(src, dst):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_links)
    target = str(tmp_path / "out.h5")
    tmps = []
    for i in range(8):
        tmp = Temporary.reserve(target)
        with open(tmp.data, "wb") as f:
            f.write(f"writer {i}".encode())
        tmps.append(tmp)
    start = threading.Barrier(len(tmps))
    outcome = {}

    def publish(i, tmp):
        start.wait()
        try:
            tmp.publish(target, replace=False)
            outcome[i] = "won"
        except FileExistsError:
            outcome[i] = "refused"
            tmp.remove()
    threads = [threading.Thread(target=publish, args=(i, t)) for i, t in enumerate(tmps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(winners) == 1 and len(outcome) == len(tmps)
    with open(target, "rb") as f:
        assert f.read() == f"writer {winners[0]}".encode()
    assert os.listdir(tmp_path) == ["out.h5"]


def test_no_hard_links_and_no_renameat2_is_a_clear_error(serial_only, tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(temporaries, "_RENAME_NOREPLACE", 1 << 30)  # a flag no kernel knows: EINVAL
    src = tmp_path / "src"
    src.write_bytes(b"x")
    with pytest.raises(OSError, match="neither hard links .* nor renameat2.*pass --force"):
        publish_file(str(src), str(tmp_path / "dst"), replace=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_removed_temporary_cannot_come_back(serial_only, tmp_path):
    """Once its directory is gone, a late writer cannot create the data file again."""
    tmp = Temporary.reserve(str(tmp_path / "out.h5"))
    with open(tmp.data, "wb") as f:
        f.write(b"half")
    assert tmp.remove()
    with pytest.raises(FileNotFoundError):
        h5py.File(tmp.data, "w-")
    assert os.listdir(tmp_path) == []


def _blocked(fn):
    """Run ``fn`` in a thread; True when it is still blocked after a moment (it parks for good)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout=0.5)
    return t.is_alive()


def test_stop_vetoes_every_later_step_and_removes_what_is_written(serial_only, tmp_path):
    outputs = io.Outputs()
    writing = outputs.reserve(str(tmp_path / "a.h5"))
    open(writing.data, "wb").close()
    adopted = outputs.adopt(outputs.reserve(str(tmp_path / "b.h5")).dir)
    stopped = outputs.stop("SIGTERM", wait_s=0)
    assert sorted(stopped.removed) == sorted([writing.dir, adopted.dir])
    assert stopped.published == [] and stopped.pending == [] and outputs.stopped == "SIGTERM"
    assert os.listdir(tmp_path) == []
    assert _blocked(lambda: outputs.reserve(str(tmp_path / "c.h5")))  # parks: nothing created
    assert _blocked(lambda: outputs.commit(writing))
    late = Temporary.reserve(str(tmp_path / "d.h5"))  # a name rank 0 sends after the stop
    assert _blocked(lambda: outputs.adopt(late.dir))
    assert not os.path.exists(late.dir) and late.dir in outputs.removed  # removed by the stopped rank
    late.close()
    assert os.listdir(tmp_path) == []


def test_a_committed_output_is_published_and_the_stop_says_so(serial_only, tmp_path):
    outputs = io.Outputs()
    tmp = outputs.reserve(str(tmp_path / "out.h5"))
    with open(tmp.data, "wb") as f:
        f.write(b"done")
    outputs.commit(tmp)  # every rank voted: the commit point is past
    result = {}
    t = threading.Thread(target=lambda: result.update(s=outputs.stop("SIGINT", wait_s=30)))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # the stop waits for the publication it cannot undo
    outputs.publish(tmp, str(tmp_path / "out.h5"), replace=False)
    outputs.settle(tmp, str(tmp_path / "out.h5"))
    t.join(timeout=30)
    assert result["s"] == publishing.Stopped([], [str(tmp_path / "out.h5")], [])
    assert os.listdir(tmp_path) == ["out.h5"] and (tmp_path / "out.h5").read_bytes() == b"done"
