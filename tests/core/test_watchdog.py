"""The watchdog: heartbeats between ranks; a rank that falls silent ends the job, one that
merely finishes late does not (``mpiattn.comm.watchdog``)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mpiattn import cli
from mpiattn.comm.errors import Agreed
from mpiattn.comm.watchdog import MIN_TIMEOUT_S, Watchdog, peers_of
from helpers import finish_group, gone_within, job_env, mpiexec


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 13, 64])
def test_peers_watch_each_other_and_reach_every_rank(size):
    peers = {r: peers_of(r, size) for r in range(size)}
    for r, ps in peers.items():
        assert r not in ps and all(r in peers[p] for p in ps)  # each watches those that watch it
        assert len(ps) <= 2 * max(1, size.bit_length())
    if size <= 4:
        assert all(peers[r] == [p for p in range(size) if p != r] for r in range(size))
    seen, todo = {0}, [0]  # an abort spreads along the watch graph: it is connected
    while todo:
        for p in peers[todo.pop()]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    assert seen == set(range(size))


def test_a_timeout_must_be_positive(comm):
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Watchdog(comm, 0)


def test_a_timeout_under_the_minimum_is_refused_alike(comm):
    with pytest.raises(ValueError, match=f"at least {MIN_TIMEOUT_S:g} s") as got:
        Watchdog(comm, MIN_TIMEOUT_S / 2)
    assert isinstance(got.value, Agreed)  # every rank given the same timeout raises it
    Watchdog(comm, MIN_TIMEOUT_S)  # the minimum itself is accepted


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_stops_late_is_not_taken_for_a_lost_one(comm):
    """Rank 0 stops watching at once, the others 2.5 timeouts later: nobody aborts (the late
    ranks keep beating while rank 0 waits for their goodbye; they stop watching rank 0 once it
    said goodbye, though it beats no more)."""
    dog = Watchdog(comm, timeout=1.0, period=0.1).start()
    if comm.rank:
        time.sleep(2.5)
    t = time.monotonic()
    dog.stop()
    waited = comm.allgather_obj(time.monotonic() - t)
    assert waited[0] >= 2.0  # rank 0's stop waited for the others (no abort meanwhile)
    with Watchdog(comm, timeout=5.0):  # again, as a context manager
        comm.barrier()


def test_the_command_line_runs_under_a_watchdog(comm, capsys, shared_dir):
    assert cli.main(["make-data", f"{shared_dir}/in.h5", "--seq", "64", "--heads", "2", "--dim", "8",
                     "--with-dout", "-q", "--watchdog", "30"]) == 0
    assert cli.main(["run", f"{shared_dir}/in.h5", "-o", f"{shared_dir}/out.h5", "-q",
                     "--watchdog", "30"]) == 0


SILENT = textwrap.dedent("""
    import os, signal, sys
    from mpi4py import MPI
    from mpiattn.comm import get_comm
    from mpiattn.comm.watchdog import Watchdog

    c = get_comm()
    with open(f"pid.{c.rank}", "w") as f:
        f.write(str(os.getpid()))
    Watchdog(c, timeout=2.0).start()
    c.barrier()
    if c.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, its watchdog too, falls silent
    c.barrier()  # rank 0 waits here for ever, but for the watchdog
""")


def test_a_silent_rank_ends_the_job_with_one_message(serial_only, tmp_path):
    (tmp_path / "job.py").write_text(SILENT)
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "job.py"], cwd=tmp_path, env=job_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    code, out, err = finish_group(p, 120, "the job did not end after a rank fell silent")
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    if gone_within(pids, 30) is None:  # (a stopped rank that outlived the job would still be there)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"a rank process of {pids} outlived the job")
    assert code == 1, (code, out, err)
    lines = [ln for ln in (out + err).splitlines() if ln.startswith("mpiattn:")]
    assert len(lines) == 1 and "rank 0 (" in lines[0] and "heard nothing from rank 1" in lines[0], out + err


def _job(tmp_path, script, what):
    """Run ``script`` as a 2-rank job; returns ``(exit code, its output)``."""
    (tmp_path / "job.py").write_text(script)
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "job.py"], cwd=tmp_path, env=job_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    code, out, err = finish_group(p, 120, what)
    return code, out + err


WAITING_IN_MPI = textwrap.dedent("""
    import time
    from mpiattn.comm import get_comm
    from mpiattn.comm.watchdog import Watchdog

    c = get_comm()
    fresh = c.mpi.Dup()  # no pickle-based reduce has run on it yet
    with Watchdog(c, timeout=1.0):
        if c.rank == 0:
            time.sleep(3.0)  # a slow rank (a slow file system, a loaded node)
        # rank 1 waits for it in mpi4py's first pickle-based reduce on `fresh`, which duplicates
        # `fresh` without releasing Python's lock: its watchdog thread cannot beat meanwhile
        fresh.allreduce(1)
    fresh.Free()
    print(f"rank {c.rank} done", flush=True)
""")


def test_a_rank_waiting_in_mpi_without_python_s_lock_is_not_taken_for_a_lost_one(serial_only, tmp_path):
    """The first rank at mpiattn's first collective check on a communicator waits holding
    Python's lock, as long as the slowest rank takes to come: it is well, and its MPI still
    matches the heartbeats sent to it (synchronous sends), so nobody aborts."""
    code, out = _job(tmp_path, WAITING_IN_MPI, "the job hung")
    assert code == 0 and "heard nothing" not in out, out
    assert sorted(ln for ln in out.splitlines() if ln.endswith(" done")) == ["rank 0 done", "rank 1 done"]


HELD_AT_ONCE = textwrap.dedent("""
    import ctypes, time
    from mpiattn.comm import get_comm
    from mpiattn.comm.watchdog import Watchdog

    hold = ctypes.PyDLL(None).usleep  # a C call that keeps Python's lock (as loading a big
                                      # extension module does): this rank's watchdog cannot run
    c = get_comm()
    with Watchdog(c, timeout=4.0):  # (counted: about 2.6 s of silence; the margin for a
        c.barrier()                     # loaded CI machine's scheduling, seen short at 3 s)
        if c.rank == 0:
            time.sleep(0.5)  # rank 0 watches rank 1, held from now on, for a while ...
            hold(4_500_000)  # ... then is held too, and wakes first
        else:
            hold(5_500_000)
        c.barrier()
    print(f"rank {c.rank} done", flush=True)
""")


def test_ranks_held_at_the_same_time_do_not_blame_each_other(serial_only, tmp_path):
    """Every rank's Python held at once, past the timeout: a rank whose own watchdog could not
    run does not count that pause as its peer's silence."""
    code, out = _job(tmp_path, HELD_AT_ONCE, "the job hung")
    assert code == 0 and "heard nothing" not in out, out
    assert sorted(ln for ln in out.splitlines() if ln.endswith(" done")) == ["rank 0 done", "rank 1 done"]
