"""``--watchdog`` on the command line: it never ends a healthy job, however its ranks are
paced, and a timeout under the minimum is a usage error (``mpiattn.comm.watchdog``,
``mpiattn.cli.dispatch``). The lost ranks it must still catch: ``tests/core/test_watchdog.py``
and ``tests/two_hosts/``."""

import pathlib
import subprocess
import sys
import textwrap

import h5py
import pytest

from mpiattn import cli
from mpiattn.comm.watchdog import MIN_TIMEOUT_S
from helpers import finish_group, job_env, mpiexec

#: Runs of the repeated test (the defect it guards against showed in about half of them).
TRIES = 4
RESULTS = {"out", "lse", "dq", "dk", "dv"}


def _input(directory) -> None:
    assert cli.main(["make-data", str(directory / "in.h5"), "--seq", "256", "--heads", "2",
                     "--dim", "16", "--with-dout", "-q"]) == 0


def _launch(directory, *argv) -> tuple[int, str]:
    """A 2-rank job in ``directory``; returns its exit code and output."""
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, *argv], cwd=directory, env=job_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    code, out, err = finish_group(p, 240, f"the job {argv} hung")
    return code, out + err


def _published(path) -> set:
    with h5py.File(path, "r") as f:
        return set(f)


def test_runs_at_a_one_second_watchdog_on_busy_cores_never_abort(serial_only, tmp_path):
    """Both cores kept busy by other processes: no run is ended by its watchdog, before or
    after it published its output."""
    _input(tmp_path)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(TRIES):
            code, out = _launch(tmp_path, "-m", "mpiattn", "run", "in.h5", "-o", f"out{i}.h5", "-q",
                                "--watchdog", "1")
            assert code == 0 and "heard nothing" not in out, (i, out)
            assert _published(tmp_path / f"out{i}.h5") == RESULTS
    finally:
        for p in busy:
            p.kill()
            p.wait()


SLOW_RANK_0 = textwrap.dedent("""
    import sys, time
    from mpiattn.comm import watchdog

    _start = watchdog.Watchdog.start


    def slow_start(self):
        started = _start(self)
        if self.comm.rank == 0:
            time.sleep(3.0)  # a slow file system, a descheduled process: rank 1 waits for it
        return started


    watchdog.Watchdog.start = slow_start
    from mpiattn.__main__ import program

    sys.exit(program())
""")


def test_a_rank_slow_after_the_watchdog_started_is_not_taken_for_a_lost_one(serial_only, tmp_path):
    """Rank 1 waits 3 s for rank 0 at the command's first collective check, its first on the
    communicator, which mpi4py makes holding Python's lock: its watchdog thread cannot beat,
    yet the 1 s watchdog must not end the job."""
    _input(tmp_path)
    (tmp_path / "slow.py").write_text(SLOW_RANK_0)
    code, out = _launch(tmp_path, "slow.py", "run", "in.h5", "-o", "out.h5", "-q", "--watchdog", "1")
    assert code == 0 and "heard nothing" not in out, out
    assert _published(tmp_path / "out.h5") == RESULTS


@pytest.mark.parametrize("command", ["run", "make-data"])
def test_a_watchdog_under_the_minimum_is_a_usage_error(comm, shared_dir, capsys, command):
    """Exit 2 on every rank, the error naming the option and the minimum, nothing written."""
    directory = pathlib.Path(shared_dir)
    if command == "run":
        _input(directory)
        argv = ["run", str(directory / "in.h5"), "-o", str(directory / "out.h5")]
    else:
        argv = ["make-data", str(directory / "out.h5"), "--seq", "64", "--heads", "2", "--dim", "8"]
    capsys.readouterr()
    code = cli.main([*argv, "-q", "--watchdog", f"{MIN_TIMEOUT_S / 2:g}"])
    err = capsys.readouterr().err
    assert comm.allgather_obj(code) == [2] * comm.size
    assert not (directory / "out.h5").exists()
    if comm.rank == 0:  # argparse's usage, then the one error line
        last = err.strip().splitlines()[-1]
        assert "--watchdog" in last and f"{MIN_TIMEOUT_S:g}" in last, err
