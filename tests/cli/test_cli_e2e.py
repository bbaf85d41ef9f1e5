"""End to end: ``mpiexec -n P python -m mpiattn ...`` as subprocesses, with timeouts.

These launch their own MPI jobs, so they run only in the single-process
session (``serial_only``). Every launch has a wall-clock limit: a hang fails
the test instead of blocking the suite. Kept to about ten short launches.
"""

import os
import sys
import textwrap
from types import SimpleNamespace

import h5py
import numpy as np

from helpers import mpiexec, reference, run_group, whole

LIMIT_S = 120


def launch(ranks, *args, cwd, script=None):
    """Run ``python -m mpiattn ARGS`` (or a script) on ``ranks`` ranks (returncode, stdout, stderr)."""
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    cmd = [mpiexec(), "-n", str(ranks), sys.executable]
    cmd += [str(script)] if script else ["-m", "mpiattn", *map(str, args)]
    code, out, err = run_group(cmd, LIMIT_S, cwd=cwd, env=env)
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_example_from_any_directory(serial_only, tmp_path):
    p = launch(2, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("check    max error vs float64") == 1 and "OK" in p.stdout  # rank 0 only
    assert "2 rank(s)" in p.stdout
    _, attrs = whole(tmp_path / "mpiattn-example-out.h5")
    assert attrs["ranks"] == 2 and attrs["mpiattn_example"] == 1
    p = launch(4, "--quiet", cwd=tmp_path)  # overwrites its own earlier output
    assert p.returncode == 0 and p.stdout == "", p.stderr
    assert whole(tmp_path / "mpiattn-example-out.h5")[1]["ranks"] == 4


def test_make_data_and_run_at_1_2_4_ranks(serial_only, tmp_path):
    size = ["--heads", 4, "--kv-heads", 2, "--seq", 300, "--kv-seq", 260, "--dim", 16,
            "--value-dim", 8, "--with-dout", "--padding", 0.1, "--seed", 8, "--causal"]
    assert launch(1, "make-data", "a.h5", *size, cwd=tmp_path).returncode == 0
    p = launch(4, "make-data", "b.h5", *size, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    a, _ = whole(tmp_path / "a.h5")
    b, _ = whole(tmp_path / "b.h5")
    for name in a:  # the same file whatever the number of ranks
        np.testing.assert_array_equal(a[name], b[name])
    ref = reference(a["q"], a["k"], a["v"], a["dout"], causal=True, key_padding_mask=a["key_padding_mask"])
    for ranks in (1, 2, 4):
        out = f"out{ranks}.h5"
        p = launch(ranks, "run", "b.h5", "-o", out, "--check", "--block-size", 64, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert p.stdout.count("OK") == 1
        got, attrs = whole(tmp_path / out)
        assert attrs["ranks"] == ranks and attrs["layout"] == "zigzag"
        for name in ("out", "lse", "dq", "dk", "dv"):
            want = getattr(ref, name)
            fin = np.isfinite(want)
            assert np.array_equal(fin, np.isfinite(got[name]))
            err = np.abs(got[name][fin] - want[fin]).max() / np.abs(want[fin]).max()
            assert err < 1e-4, (ranks, name, err)
    assert sorted(os.listdir(tmp_path)) == ["a.h5", "b.h5", "out1.h5", "out2.h5", "out4.h5"]


def test_errors_are_printed_once_with_exit_codes(serial_only, tmp_path):
    p = launch(2, "run", "x.h5", "-o", "y.h5", "--block-size", "zero", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.count("usage:") == 1 and p.stderr.count("error:") == 1, p.stderr
    p = launch(4, "run", "missing.h5", "-o", "y.h5", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.count("mpiattn: error:") == 1 and "missing.h5 does not exist" in p.stderr, p.stderr
    assert os.listdir(tmp_path) == []


def test_an_agreed_error_exits_1_every_time(serial_only, tmp_path):
    """No rank may be killed by the launcher on the way out: the job's code stays 1, never 9.

    (Hydra kills the ranks still running when one leaves without finalizing
    MPI; with Debian's MPICH 4.0.2 about one launch in eight ended with 9
    while every rank skipped its normal exit.)
    """
    for _ in range(6):
        p = launch(4, "run", "missing.h5", "-o", "y.h5", cwd=tmp_path)
        assert p.returncode == 1 and "BAD TERMINATION" not in p.stdout, p.stdout + p.stderr


def test_open_hdf5_files_are_told_from_h5pys_own_objects(tmp_path):
    """What decides an ``os._exit``: files and what lives in them, not h5py's open datatypes."""
    from mpiattn.cli.dispatch import _hdf5_holds_files

    assert h5py.h5f.get_obj_count() > 0  # (h5py's own datatypes: why the plain count is wrong)
    assert not _hdf5_holds_files(h5py)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3))
        assert _hdf5_holds_files(h5py)
    assert not _hdf5_holds_files(h5py)


def test_a_failure_on_one_rank_ends_the_job(serial_only, tmp_path):
    """A bug that strikes one rank only (no agreed error) aborts the job instead of hanging it."""
    script = tmp_path / "bug.py"
    script.write_text(textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from mpiattn import cli
        from mpiattn.cli import commands, steps

        real = steps.host_names
        def broken(c):
            if c.rank == 1:
                raise KeyError("simulated bug on rank 1")
            return real(c)  # the other ranks wait in an allgather
        steps.host_names = commands.host_names = broken
        sys.exit(cli.main(["info"]))
    """))
    p = launch(3, cwd=tmp_path, script=script)
    assert p.returncode != 0
    assert "simulated bug on rank 1" in p.stderr and "aborting" in p.stderr


def test_failed_write_leaves_previous_output(serial_only, tmp_path):
    """One rank fails part-way through writing: serial HDF5 raises on every rank, parallel HDF5
    aborts the job; either way the old output survives and no temporary file is left."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from mpiattn import cli, io
        from mpiattn.io import writing

        assert cli.main(["make-data", "in.h5", "--seq", "40", "--dim", "4", "--with-dout", "-q"]) == 0
        assert cli.main(["run", "in.h5", "-o", "out.h5", "-q"]) == 0
        real = writing._write_slabs
        def failing(f, datasets, segs_of, collective):
            if MPI.COMM_WORLD.Get_rank() == 1:
                real(f, dict(list(datasets.items())[:1]), segs_of, collective)
                raise OSError("simulated: disk full on rank 1")
            real(f, datasets, segs_of, collective)
        writing._write_slabs = failing
        sys.exit(cli.main(["run", "in.h5", "-o", "out.h5", "--force", "--no-backward"]))
    """))
    p = launch(2, cwd=tmp_path, script=script)
    assert p.returncode != 0
    assert "simulated: disk full on rank 1" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["fail.py", "in.h5", "out.h5"]
    assert "dq" in whole(tmp_path / "out.h5")[0]  # still the first run's output
