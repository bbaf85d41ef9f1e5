"""Before any work: launch sanity, BLAS threads, option bounds; and progress off terminals.

In-process at any rank count (``cli.main`` on every rank), plus a few
launches of single processes that look like the singletons a broken
launcher starts (serial session only).
"""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mpiattn import cli
from mpiattn.cli import common, resources
from mpiattn.comm import node as nodes
from helpers import run_cli as run, whole


def _make(comm, capsys, path, *extra):
    code, _, err = run(comm, capsys, "make-data", path, "--seq", 40, "--heads", 2, "--dim", 4,
                       "--with-dout", "-q", *extra)
    assert code == 0, err
    return path


# ----------------------------------------------------------------- launch sanity
@pytest.mark.parametrize("var", resources.LAUNCH_VARS)
def test_a_launcher_that_announced_more_ranks_fails_every_rank(comm, capsys, shared_dir,
                                                               monkeypatch, var):
    for v in resources.LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, str(comm.size + 3))
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "make-data", out, "--seq", 8)
    assert code == 1
    if comm.rank == 0:
        assert err.count("mpiattn: error:") == 1 and f"{var}={comm.size + 3}" in err
        assert "srun --mpi=pmi2" in err or "--no-binary=mpi4py" in err, err
    assert not os.path.exists(out)
    monkeypatch.setenv(var, str(comm.size))  # agreeing sizes are fine
    assert run(comm, capsys, "make-data", out, "--seq", 8, "-q")[0] == 0


def test_launch_problem_rules():
    assert resources.launch_problem(4, {}) is None
    assert resources.launch_problem(4, {"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1"}) is None
    text = resources.launch_problem(1, {"SLURM_STEP_NUM_TASKS": "4"})
    assert "srun --mpi=pmi2" in text and "--mpi=pmix" in text and "only itself" in text
    text = resources.launch_problem(1, {"PMI_SIZE": "2"})
    assert "python -m mpi4py --mpi-library" in text and "--no-binary=mpi4py" in text
    assert "Open MPI" in resources.launch_problem(2, {"OMPI_COMM_WORLD_SIZE": "3", "PMI_SIZE": "2"})
    assert resources.launch_problem(1, {"PMI_SIZE": "x"}) is None
    assert resources.launcher_rank({"PMI_RANK": "3"}) == 3 and resources.launcher_rank({}) is None


def test_singletons_each_fail_and_only_the_first_speaks(serial_only, tmp_path):
    """N singletons (srun --mpi=none): every process exits 1, one message, no output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_", "OMPI_"))}
    env.update(SLURM_STEP_NUM_TASKS="2", OMP_NUM_THREADS="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-m", "mpiattn", "make-data", "out.h5", "--seq", "8"],
                              cwd=tmp_path, env=dict(env, SLURM_PROCID=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert [rc for _, _, rc in results] == [1, 1], results
    assert results[0][1].count("mpiattn: error:") == 1 and "srun --mpi=pmi2" in results[0][1]
    assert results[1][0] == results[1][1] == ""
    assert os.listdir(tmp_path) == []


def test_no_mpi_library_is_one_line_with_the_remedy(serial_only, tmp_path):
    """mpi4py finding no MPI library (a venv without the mpich extra, no site MPI; made here by
    MPI4PY_LIBMPI naming a missing file): one line saying how to get one, exit 1, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_", "OMPI_"))}
    env.update(MPI4PY_LIBMPI=str(tmp_path / "missing" / "libmpi.so"))
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    linked = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], env=env, capture_output=True,
                            timeout=120)
    if linked.returncode == 0:
        pytest.skip("this mpi4py was built against its MPI (a site build): MPI4PY_LIBMPI cannot take "
                    "the library away from it")
    for argv in (["info"], ["make-data", "out.h5", "--seq", "8"], []):
        p = subprocess.run([sys.executable, "-m", "mpiattn", *argv], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout=120)
        assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith("mpiattn: error: mpi4py cannot load an MPI library (")
        assert "missing/libmpi.so" in p.stderr and "pip install mpich" in p.stderr
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- threads
def test_threads_share_override_and_report(comm, capsys, shared_dir, monkeypatch):
    for v in resources.THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    out = os.path.join(shared_dir, "out.h5")
    code, text, err = run(comm, capsys, "run", inp, "-o", out, "--engine", "native")
    assert code == 0, err
    node = comm.node
    share = node.share()
    _, attrs = whole(out)
    if attrs["blas_threads"] is not None and nodes.blas_threads() is not None:
        assert attrs["blas_threads"] == share
    assert attrs["blas_threads_source"] == resources.SHARE
    assert comm.rank or f"threads  BLAS {share} per rank" in text
    assert os.environ.get("OMP_NUM_THREADS") is None  # restored after the in-process run
    code, text, err = run(comm, capsys, "run", inp, "-o", out, "--force", "--threads", 1, "-q",
                          "--engine", "native")
    assert code == 0 and whole(out)[1]["blas_threads_source"] == "--threads"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    code, text, err = run(comm, capsys, "info")
    assert code == 0 and (comm.rank or "threads    BLAS" in text and "OPENBLAS_NUM_THREADS=1" in text)


def test_configure_threads_precedence():
    node = nodes.NodeInfo(local_rank=0, local_size=2, cores=8, own_cores=8)
    assert node.share() == 4
    assert nodes.NodeInfo(0, 3, 2, 2).share() == 1 and nodes.NodeInfo(0, 2, 8, 2).share() == 2
    t = resources.configure_threads(node, None, env={"MKL_NUM_THREADS": "3"})
    assert t.source == "MKL_NUM_THREADS=3" and t.limiter is None
    t = resources.configure_threads(node, 1, env={"OMP_NUM_THREADS": "2"})
    try:
        assert t.source == "--threads" and os.environ["OMP_NUM_THREADS"] == "1"
        if t.count is not None:
            assert t.count == 1
    finally:
        t.restore()
    t = resources.configure_threads(node, None, env={})
    try:
        assert t.source == resources.SHARE and "2 rank(s) on 8 core(s)" in t.describe()
    finally:
        t.restore()


def test_library_warns_once_per_comm_when_ranks_times_threads_exceed_cores(monkeypatch):
    from mpi4py import MPI
    from mpiattn.comm.core import Comm

    monkeypatch.setattr(nodes, "blas_threads", lambda: 4)
    with pytest.warns(nodes.OversubscriptionWarning, match="OMP_NUM_THREADS=2"):
        nodes.warn_if_oversubscribed(nodes.NodeInfo(0, 2, 4, 4))
    c = Comm(MPI.COMM_SELF)
    c.node = nodes.NodeInfo(0, 2, 4, 4)
    with pytest.warns(nodes.OversubscriptionWarning):
        c.allgather_checked(lambda: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.allgather_checked(lambda: 1)  # once per communicator
        nodes.warn_if_oversubscribed(nodes.NodeInfo(1, 2, 4, 4))  # the node's first rank speaks
        nodes.warn_if_oversubscribed(nodes.NodeInfo(0, 1, 4, 4))
        monkeypatch.setattr(nodes, "blas_threads", lambda: 1)  # nothing to gain below one thread
        nodes.warn_if_oversubscribed(nodes.NodeInfo(0, 8, 4, 4))


def test_node_info_is_cached_on_the_comm(comm):
    node = comm.node
    assert node is not None and 1 <= node.local_size <= comm.size and 0 <= node.local_rank
    assert node.cores >= node.own_cores >= 1
    assert sum(comm.allgather_obj(node.local_rank == 0)) >= 1


# ----------------------------------------------------------------- bounds and exit 2
BOUNDS = [["run", "in.h5", "-o", "o.h5", "--block-size", "100000000000000000000"],
          ["run", "in.h5", "-o", "o.h5", "--block-size", "2147483648"],
          ["run", "in.h5", "-o", "o.h5", "--block-size", "1e20"],
          ["run", "in.h5", "-o", "o.h5", "--threads", "0"],
          ["make-data", "o.h5", "--seq", "2147483648"],
          ["make-data", "o.h5", "--seed", str(2**63)],
          ["make-data", "o.h5", "--heads", "99999999999999999999"]]


@pytest.mark.parametrize("argv", BOUNDS, ids=[" ".join(a[-2:]) for a in BOUNDS])
def test_integer_options_are_bounded_before_any_work(comm, capsys, shared_dir, monkeypatch, argv):
    monkeypatch.chdir(shared_dir)
    code, _, err = run(comm, capsys, *argv)
    assert code == 2
    assert comm.rank or ("error:" in err and "usage:" in err)
    assert os.listdir(shared_dir) == []


def test_largest_block_size_runs(comm, capsys, shared_dir):
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--block-size", 2**31 - 1, "--check",
                       "-q", "--engine", "native")
    assert code == 0, err
    assert whole(out)[1]["block_size"] == 2**31 - 1


# ----------------------------------------------------------------- clean, progress
def test_clean_command(comm, capsys, shared_dir):
    code, text, _ = run(comm, capsys, "clean", shared_dir)
    assert code == 0 and (comm.rank or "no mpiattn temporary files" in text)
    code, _, err = run(comm, capsys, "clean", os.path.join(shared_dir, "nowhere"))
    assert code == 1 and (comm.rank or "not a directory" in err)


def test_progress_lines_off_terminals(monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: clock[0])
    con = common.Console(0)
    con.tty = False
    quick = con.progress("forward")
    for i in range(1, 11):
        quick(i, 10)  # all within the first seconds: nothing
    assert capsys.readouterr().out == ""
    slow = con.progress("backward")
    for i in range(1, 101):
        clock[0] += 0.5
        slow(i, 100)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and lines[-1].strip().startswith("backward 100 %"), lines
    assert all("%" in ln and "/100 steps" in ln for ln in lines)
    quiet = common.Console(0, quiet=True)
    quiet.tty = False
    quiet.progress("forward")(100, 100)
    assert capsys.readouterr().out == ""


def test_example_regenerated_input_is_a_locked_temporary(comm, capsys, shared_dir, monkeypatch):
    import contextlib

    from mpiattn.cli import commands

    monkeypatch.chdir(shared_dir)
    monkeypatch.setattr(commands, "_example_input", lambda: contextlib.nullcontext(None))
    seen = []
    real = commands.run_file

    def spy(c, con, args, path, *rest):
        tmp = os.path.dirname(path)  # the input is made inside a locked temporary directory
        seen.append((os.path.basename(tmp), tmp in con.outputs.active(),
                     os.path.exists(os.path.join(tmp, "lock"))))
        return real(c, con, args, path, *rest)
    monkeypatch.setattr(commands, "run_file", spy)
    code, _, err = run(comm, capsys, "-q", "--engine", "native")
    assert code == 0, err
    name, registered, locked = seen[0]
    assert name.startswith(".mpiattn-example-in.h5.mpiattn-") and registered and locked
    assert os.listdir(shared_dir) == [cli.EXAMPLE_OUTPUT]
    assert np.isfinite(whole(cli.EXAMPLE_OUTPUT)[0]["out"]).all()
