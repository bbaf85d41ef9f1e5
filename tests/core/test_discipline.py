"""The collective discipline (mpiattn.comm.discipline): mistakes that used to hang raise instead.

* the checking mode (``MPIATTN_CHECK_COLLECTIVES``): ranks at different collectives raise one
  ``CallMismatch`` naming both call sites; a rank that waits too long raises;
* a rank that has ended while another waits at a public call: the waiting ranks raise,
  naming it (a launched job);
* two threads on one communicator: a clear end (a launched job; one rank: a RuntimeError);
* a plan whose communicator was freed: a ValueError, not a raw MPI error.
"""

import re
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import mpiattn
from mpiattn.comm import errors
from mpiattn.comm.core import Comm
from mpiattn.comm.discipline import CHECK_VARIABLE, checking_timeout

from helpers import job_env, mpiexec, run_group


@pytest.fixture
def checked(comm, monkeypatch):
    """A Comm of its own in the checking mode (waits of at most 20 s), freed afterwards."""
    monkeypatch.setenv(CHECK_VARIABLE, "20")
    c = Comm(comm.mpi.Dup())
    yield c
    c.free()


def test_the_variable_is_a_flag_or_seconds():
    assert checking_timeout({}) is None
    assert checking_timeout({CHECK_VARIABLE: "0"}) is None
    assert checking_timeout({CHECK_VARIABLE: "1"}) == 120.0
    assert checking_timeout({CHECK_VARIABLE: "2.5"}) == 2.5
    for bad in ("yes", "-3", "nan", "inf"):
        with pytest.raises(ValueError, match=CHECK_VARIABLE):
            checking_timeout({CHECK_VARIABLE: bad})


def test_the_same_collectives_pass_the_check(checked, comm):
    x = np.arange(3.0) + checked.rank
    assert checked.allgather_obj(checked.rank) == list(range(checked.size))
    assert checked.bcast_obj("a" if checked.rank == 0 else None) == "a"
    checked.barrier()
    np.testing.assert_array_equal(checked.allreduce_(x.copy()),
                                  np.arange(3.0) * checked.size + sum(range(checked.size)))


@pytest.mark.mpi(min_size=2)
def test_ranks_at_different_collectives_raise_one_error_naming_both(checked):
    """Rank 0 gathers, the others wait at a barrier: without the check both would wait forever
    (or, worse, match each other's messages)."""
    with pytest.raises(errors.CallMismatch, match="ranks reach different collectives") as info:
        if checked.rank == 0:
            checked.allgather_obj("mine")
        else:
            checked.barrier()
    text = str(info.value)
    assert "Comm.allgather_obj from" in text and "Comm.barrier from" in text
    assert text.count("test_discipline.py") == 2  # each site: the line of this test that asked
    assert checked.allgather_obj(text) == [text] * checked.size
    assert isinstance(info.value, errors.Agreed)
    checked.barrier()  # in step again


@pytest.mark.mpi(min_size=2)
def test_a_library_decision_made_on_one_rank_is_caught(checked):
    """One rank attends while the others gather: the public calls' collectives differ at once."""
    x = mpiattn.shard(np.ones((1, 1, 4 * checked.size, 2)), comm=checked)
    with pytest.raises(errors.CallMismatch, match="rank 0 is at"):
        if checked.rank == 0:
            mpiattn.attention(x, x, x, comm=checked)
        else:
            mpiattn.gather(x, comm=checked)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_waits_too_long_raises(comm, monkeypatch):
    """Rank 0 waits 1.5 s at a barrier the others reach 3 s later (from the same line)."""
    monkeypatch.setenv(CHECK_VARIABLE, "1.5")
    c = Comm(comm.mpi.Dup())
    said = None
    try:
        if c.rank:
            time.sleep(3.0)
        try:
            c.barrier()
        except RuntimeError as exc:
            said = str(exc)
            c.mpi.Barrier()  # the barrier its check was to guard
    finally:
        c.free()
    if c.rank == 0:
        assert said is not None and "waited 2 s in Comm.barrier" in said and CHECK_VARIABLE in said
    else:
        assert said is None


def test_a_plan_on_a_freed_communicator_is_refused(comm):
    user = comm.mpi.Dup()
    x = np.ones((1, 1, 3, 2))
    plan = mpiattn.plan_attention(x, x, x, comm=user)
    user.Free()
    with pytest.raises(ValueError, match="its communicator was freed"):
        plan.forward(x, x, x)
    with pytest.raises(ValueError, match="its communicator was freed"):
        plan.run_forward(x, x, x, None, None)


def test_two_threads_on_one_communicator_at_one_rank_raise(comm):
    """One rank: the second thread raises (with several ranks the job ends: below)."""
    if comm.size != 1:
        pytest.skip("one rank")
    c = Comm(comm.mpi.Dup())
    seen = []
    inside = threading.Event()
    leave = threading.Event()

    def hold():
        with c.discipline.claim("the first thread's call"):
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="two threads of rank 0 use one communicator") as info:
            c.allgather_checked(lambda: 1, call="second")
        seen.append(str(info.value))
    finally:
        leave.set()
        t.join()
        c.free()
    assert "the first thread's call" in seen[0]


def _job(tmp_path, text, n, timeout=90):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(text))
    return run_group([mpiexec(), "-n", str(n), sys.executable, str(script)], timeout, env=job_env())


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_ended_is_named_by_the_ranks_waiting_for_it(serial_only, tmp_path, n):
    """The last rank ends its program; the others attend: each raises, naming it (rank 0 hears
    the notice, and passes it on to rank 1)."""
    rc, out, err = _job(tmp_path, """
        import numpy as np, mpiattn
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        x = mpiattn.shard(np.ones((1, 1, 4 * c.size, 2)))
        mpiattn.attention(x, x, x)           # every rank: fine
        if c.rank == c.size - 1:
            raise SystemExit(0)              # this rank is done
        try:
            mpiattn.attention(x, x, x)
        except RuntimeError as exc:
            print(f"rank {c.rank}: {exc}", flush=True)
    """, n)
    assert rc == 0, err
    for r in range(n - 1):
        assert f"rank {r}: rank {n - 1} of this communicator has ended" in out, (out, err)


@pytest.mark.parametrize("n", [2, 3])
def test_an_orderly_end_leaves_no_notice_unmatched(serial_only, tmp_path, n):
    """Every rank ends normally: each takes its predecessor's departure notice before MPI's
    finalize (one left unmatched makes UCX warn at every job's end: seen with Debian's MPICH)."""
    rc, out, err = _job(tmp_path, """
        import atexit, time, numpy as np, mpiattn
        from mpi4py import MPI
        from mpiattn.comm import Comm
        from mpiattn.comm.discipline import DEPART_TAG

        def probe():  # registered first, so it runs after the Comm's own handler
            MPI.COMM_WORLD.Barrier()  # every rank's notice sent
            end, left = time.monotonic() + 0.3, False
            while time.monotonic() < end and not left:
                left = c.discipline.mpi.Iprobe(source=MPI.ANY_SOURCE, tag=DEPART_TAG)
            print(f"rank {MPI.COMM_WORLD.rank}: unmatched {left}", flush=True)

        atexit.register(probe)
        c = Comm(MPI.COMM_WORLD)
        x = mpiattn.shard(np.ones((1, 1, 4 * c.size, 2)), comm=c)
        mpiattn.attention(x, x, x, comm=c)
    """, n)
    assert rc == 0, err
    assert sorted(re.findall(r"rank \d+: unmatched (?:True|False)", out)) == [f"rank {r}: unmatched False"
                                                                   for r in range(n)], (out, err)


@pytest.mark.parametrize("how", ["user-dup", "comm-mpi"])
def test_a_communicator_freed_under_its_comm_ends_the_job_cleanly(serial_only, tmp_path, how):
    """A communicator freed without the Comm's ``free`` (the user's duplicate, whose freeing
    frees the Comms made on it; or the Comm's own ``mpi``): at exit the Comm sends and takes no
    departure notice on it (Open MPI aborts a job on any call with ``COMM_NULL``: exit code 5,
    ``MPI_ERR_COMM``, seen in the openmpi lane)."""
    rc, out, err = _job(tmp_path, f"""
        import numpy as np, mpiattn
        from mpi4py import MPI
        from mpiattn.comm import Comm
        user = MPI.COMM_WORLD.Dup()
        c = Comm(user)
        x = mpiattn.shard(np.ones((1, 1, 4 * c.size, 2)), comm=c)
        mpiattn.attention(x, x, x, comm=c)
        (user if {how!r} == "user-dup" else c.mpi).Free()
        print(f"rank {{MPI.COMM_WORLD.rank}}: freed", flush=True)
    """, 2)
    assert rc == 0, (out, err)
    assert sorted(re.findall(r"rank \d: freed", out)) == ["rank 0: freed", "rank 1: freed"], (out, err)
    assert "MPI_ERR" not in out + err and "error" not in (out + err).lower(), (out, err)


def test_a_backward_on_one_rank_only_ends_with_a_message(serial_only, tmp_path):
    """mpiattn.torch: rank 0 runs a backward, rank 1 finishes: rank 0 raises (it waited forever)."""
    pytest.importorskip("torch")
    rc, out, err = _job(tmp_path, """
        import torch, mpiattn.torch as mt
        from mpi4py import MPI
        x = torch.randn(1, 2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x_r = mt.shard(x, dim=2).detach().requires_grad_(True)
        out = mt.attention(x_r, x_r, x_r, causal=True)
        if MPI.COMM_WORLD.rank == 0:
            out.sum().backward()
    """, 2)
    assert rc != 0
    assert "rank 1 of this communicator has ended" in err and "attention_backward" in err, err


def test_two_threads_on_one_communicator_end_the_job_with_its_reason(serial_only, tmp_path):
    rc, out, err = _job(tmp_path, """
        import threading, numpy as np, mpiattn
        x = mpiattn.shard(np.ones((1, 1, 64, 8)))
        plan = mpiattn.plan_attention(x, x, x, causal=True)
        def loop():
            for _ in range(200):
                plan.forward(x, x, x)
        ts = [threading.Thread(target=loop) for _ in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("no conflict seen", flush=True)
    """, 2)
    assert rc != 0 and "two threads of rank" in err and "comm.Dup()" in err, (out, err)
    assert "MPI_ERROR" not in err
