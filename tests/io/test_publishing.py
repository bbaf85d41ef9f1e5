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
from mpiattn.io import naming, publishing
from mpiattn.io.naming import NEW, ChangedError, Rule, identity_of, publish_file, publish_together
from mpiattn.io.temporaries import Temporary
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

    def other_job_first(self, items):
        with open(items[0][1], "wb") as f:  # (rank 0 publishes: the other job's file appears now)
            f.write(b"the other job's output")
        return real(self, items)
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


def _writers(target, n, text):
    """``n`` temporaries beside ``target``, writer ``i``'s data ``text.format(i)``."""
    tmps = []
    for i in range(n):
        tmp = Temporary.reserve(target)
        with open(tmp.data, "wb") as f:
            f.write(text.format(i).encode())
        tmps.append(tmp)
    return tmps


def _at_once(tmps, publish, refused):
    """Every temporary published by its own thread, all released together; ``{i: "won" or
    "refused"}`` (``refused``: the exception of a writer that loses)."""
    start = threading.Barrier(len(tmps))
    outcome = {}

    def one(i, tmp):
        start.wait()
        try:
            publish(tmp)
            outcome[i] = "won"
        except refused:
            outcome[i] = "refused"
            tmp.remove()
    threads = [threading.Thread(target=one, args=(i, t)) for i, t in enumerate(tmps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "renameat2"])
def test_concurrent_publishers_one_wins(serial_only, tmp_path, monkeypatch, links):
    """D3: many writers publish to one name at once without force: exactly one succeeds."""
    if not links:
        def no_links(src, dst):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_links)
    target = str(tmp_path / "out.h5")
    tmps = _writers(target, 8, "writer {}")
    outcome = _at_once(tmps, lambda tmp: tmp.publish(target, replace=False), FileExistsError)
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(winners) == 1 and len(outcome) == len(tmps)
    with open(target, "rb") as f:
        assert f.read() == f"writer {winners[0]}".encode()
    assert os.listdir(tmp_path) == ["out.h5"]


def test_no_hard_links_and_no_renameat2_is_a_clear_error(serial_only, tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(naming, "_RENAME_NOREPLACE", 1 << 30)  # a flag no kernel knows: EINVAL
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
    assert _blocked(lambda: outputs.vote([(writing, str(tmp_path / "a.h5"))]))
    late = Temporary.reserve(str(tmp_path / "d.h5"))  # a name rank 0 sends after the stop
    assert _blocked(lambda: outputs.adopt(late.dir))
    assert not os.path.exists(late.dir) and late.dir in outputs.removed  # removed by the stopped rank
    late.close()
    assert os.listdir(tmp_path) == []


def _written(outputs, target, text=b"done"):
    tmp = outputs.reserve(str(target))
    with open(tmp.data, "wb") as f:
        f.write(text)
    return tmp


def test_a_committed_output_is_published_and_the_stop_says_so(serial_only, tmp_path):
    outputs = io.Outputs()
    target = str(tmp_path / "out.h5")
    tmp = _written(outputs, target)
    outputs.vote([(tmp, target)])
    outputs.decided([(tmp, target)])  # every rank voted, and the owner knows: the commit point
    result = {}
    t = threading.Thread(target=lambda: result.update(s=outputs.stop("SIGINT", wait_s=30)))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # the stop waits for the publication it cannot undo
    outputs.publish([(tmp, target, NEW)])
    outputs.settle([(tmp, target)])
    t.join(timeout=30)
    assert result["s"] == publishing.Stopped([], [target], [], [])
    assert os.listdir(tmp_path) == ["out.h5"] and (tmp_path / "out.h5").read_bytes() == b"done"


def test_the_owner_revokes_a_vote_whose_outcome_it_has_not_seen(serial_only, tmp_path):
    """Issue 31: rank 0 voted, the agreement has not returned: a stop removes it at once (rank 0 is
    the only publisher), and the main thread, when the agreement returns, blocks instead."""
    outputs = io.Outputs()
    target = str(tmp_path / "out.h5")
    tmp = _written(outputs, target)
    outputs.vote([(tmp, target)])
    stopped = outputs.stop("SIGTERM", wait_s=30)  # returns at once: nothing is committed
    assert stopped.removed == [tmp.dir] and stopped.pending == [] and stopped.undecided == []
    assert _blocked(lambda: outputs.decided([(tmp, target)]))
    assert os.listdir(tmp_path) == []


def test_a_rank_that_is_not_the_owner_leaves_its_vote_to_the_owner(serial_only, tmp_path):
    owner = Temporary.reserve(str(tmp_path / "out.h5"))
    with open(owner.data, "wb") as f:
        f.write(b"done")
    outputs = io.Outputs()
    target = str(tmp_path / "out.h5")
    tmp = outputs.adopt(owner.dir)
    outputs.vote([(tmp, target)])
    stopped = outputs.stop("SIGTERM", wait_s=0)
    assert stopped.removed == [] and stopped.undecided == [target]
    assert os.path.isdir(owner.dir)  # the owner decides
    # the owner does not answer: this rank removes it, and tells what the target now is
    owner_publishes = threading.Thread(target=lambda: owner.publish(target, replace=False))
    owner_publishes.start()
    owner_publishes.join()
    removed, published = outputs.give_up()
    assert (removed, published) == ([], [target])  # the owner had named it: complete, published
    other = Temporary.reserve(str(tmp_path / "b.h5"))
    open(other.data, "wb").close()
    second = io.Outputs()
    adopted = second.adopt(other.dir)
    second.vote([(adopted, str(tmp_path / "b.h5"))])
    second.stop("SIGTERM", wait_s=0)
    assert second.give_up() == ([other.dir], [])  # removed before the owner named it
    with pytest.raises(OSError):
        other.publish(str(tmp_path / "b.h5"), replace=False)  # the owner cannot name it any more
    other.close()
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]


def test_a_group_is_named_whole_or_not_at_all(serial_only, tmp_path):
    """The output and the cache of ``decode --append``: one name fails, the other is undone."""
    out, cache = str(tmp_path / "out.h5"), str(tmp_path / "cache.h5")
    with open(cache, "wb") as f:
        f.write(b"cache v0")
    os.chmod(cache, 0o640)
    read = identity_of(cache)
    a, b = Temporary.reserve(out), Temporary.reserve(cache)
    for tmp, text in ((a, b"out"), (b, b"cache v1")):
        with open(tmp.data, "wb") as f:
            f.write(text)
    with open(cache, "ab") as f:  # another run grew the cache meanwhile
        f.write(b"+")
    with pytest.raises(ChangedError, match="modified while this run was using it"):
        publish_together([(a.data, out, NEW), (b.data, cache, Rule.grows(read))])
    assert not os.path.exists(out) and open(cache, "rb").read() == b"cache v0+"
    publish_together([(a.data, out, NEW), (b.data, cache, Rule.grows(identity_of(cache)))])
    assert open(out, "rb").read() == b"out" and open(cache, "rb").read() == b"cache v1"
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o640)  # the mode of the file it replaced
    c = Temporary.reserve(out)
    open(c.data, "wb").close()
    d = Temporary.reserve(cache)
    with open(d.data, "wb") as f:
        f.write(b"cache v2")
    with pytest.raises(FileExistsError):  # the output exists: the cache is not replaced either
        publish_together([(d.data, cache, Rule.grows(identity_of(cache))), (c.data, out, NEW)])
    assert open(cache, "rb").read() == b"cache v1"
    os.chmod(cache, 0o444)
    with pytest.raises(PermissionError, match="read-only"):
        publish_together([(d.data, cache, Rule.grows(identity_of(cache)))])
    for tmp in (a, b, c, d):
        tmp.remove()


def test_two_runs_growing_one_file_at_once_one_is_refused(serial_only, tmp_path):
    """Issue 26 item 1: both read the same cache; both publish at once: one wins, one is refused."""
    cache = str(tmp_path / "cache.h5")
    with open(cache, "wb") as f:
        f.write(b"v0")
    read = identity_of(cache)
    tmps = _writers(cache, 6, "v0 + row of run {}")
    outcome = _at_once(tmps, lambda tmp: publish_together([(tmp.data, cache, Rule.grows(read))]),
                       ChangedError)
    for tmp in tmps:
        tmp.remove()
    assert sorted(outcome.values()) == ["refused"] * 5 + ["won"]
    winner = next(i for i, o in outcome.items() if o == "won")
    assert open(cache, "rb").read() == f"v0 + row of run {winner}".encode()
