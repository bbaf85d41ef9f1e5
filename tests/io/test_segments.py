"""MPI's shared-memory segment files lose their names once mapped: a killed job leaves none."""

import os
import subprocess
import sys
import textwrap

import pytest

from mpiattn.io import segments
from helpers import job_env, mpiexec


def test_mapped_names_only_live_segment_files(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 /dev/shm/mpich_shm_1a2b_0\n"
        "7f0000100000-7f0000200000 rw-s 00000000 00:1a 12 /dev/shm/mpich_shm_1a2b_0\n"
        "7f0000200000-7f0000300000 rw-s 00000000 00:1a 13 /dev/shm/mpich_shm_old_0 (deleted)\n"
        "7f0000300000-7f0000400000 rw-s 00000000 00:1a 14 /dev/shm/other_segment\n"
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0 \n"
        "7f0000500000-7f0000600000 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    assert segments.mapped(str(maps)) == ["/dev/shm/mpich_shm_1a2b_0"]
    assert segments.mapped(str(tmp_path / "missing")) == []


def test_forgetting_the_names_keeps_mpi_working(comm):
    here = segments.mapped()
    removed = segments.forget_names(comm)
    assert set(removed) <= set(here)
    assert not any(os.path.exists(p) for p in here) and segments.mapped() == []
    import numpy as np
    x = np.ones(1 << 16)
    np.testing.assert_array_equal(comm.allreduce_(x), np.full(1 << 16, comm.size))
    if not here:
        pytest.skip("this MPI keeps no segment file under " + ", ".join(segments.PREFIXES))


KILLED = textwrap.dedent("""
    import os, sys
    from mpiattn.comm import get_comm
    from mpiattn.io import segments
    c = get_comm()
    with open(f"segments.{c.rank}", "w") as f:
        f.write("\\n".join(segments.mapped()))
    if sys.argv[1] == "forget":
        segments.forget_names(c)
    c.barrier()
    if c.rank == 1:
        os.kill(os.getpid(), 9)
    c.barrier()
""")


@pytest.mark.parametrize("forget", [True, False])
def test_a_killed_job_leaves_its_segment_only_when_its_name_was_kept(serial_only, tmp_path, forget):
    (tmp_path / "job.py").write_text(KILLED)
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "job.py", "forget" if forget else "keep"],
                       cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0  # a rank was killed
    paths = set((tmp_path / "segments.0").read_text().split()) | set((tmp_path / "segments.1").read_text().split())
    if not paths:
        pytest.skip("this MPI keeps no segment file under " + ", ".join(segments.PREFIXES))
    left = sorted(x for x in paths if os.path.exists(x))
    for path in left:  # (the control case's leftover: not ours to keep)
        os.unlink(path)
    assert left == ([] if forget else sorted(paths))
