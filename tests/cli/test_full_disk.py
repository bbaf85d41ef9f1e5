"""A full disk: a small tmpfs (root only), through ``mpiexec``.

* The free-space check refuses an output that cannot fit, before any work,
  with a clear message and nothing left behind.
* When the disk fills up during the write anyway (the check patched away),
  the job still ends with exit code 1 and one message, leaves no temporary
  file, and no crash in HDF5's clean-up at exit (HDF5 2.0 segfaults there
  after a failed write; the command line leaves with ``os._exit``). With
  parallel HDF5 (the CI lane ``parallel_hdf5``) the same holds: the failing
  rank aborts the job after one line.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import mpiexec, run_group

NO_CHECK = textwrap.dedent("""
    import sys
    from mpiattn.io import atomic
    atomic._space_problem = lambda path, nbytes: None  # the check passes; the disk fills while writing
    from mpiattn import cli
    sys.argv = ["mpiattn", *sys.argv[1:]]
    sys.exit(cli.main())
""")
BIG = ["--seq", "40000", "--heads", "4", "--dim", "32", "-q"]  # about 59 MiB of q, k, v


@pytest.fixture
def small_disk(serial_only, tmp_path):
    """A 20 MiB tmpfs at tmp_path/disk (skipped unless it can be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _launch(cwd, *args, script=None):
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", OMP_NUM_THREADS="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    cmd = [mpiexec(), "-n", "2", sys.executable, *([str(script)] if script else ["-m", "mpiattn"]),
           *map(str, args)]
    return run_group(cmd, 180, cwd=cwd, env=env)


def test_too_big_output_is_refused_before_any_work(small_disk, tmp_path):
    code, out, err = _launch(tmp_path, "make-data", small_disk / "big.h5", *BIG)
    assert code == 1, out + err
    assert err.count("mpiattn: error:") == 1 and "not enough free space" in err
    assert "MiB free" in err and "[Errno" not in err
    assert os.listdir(small_disk) == []


def test_disk_filling_up_while_writing_ends_cleanly(small_disk, tmp_path):
    """Serial HDF5: the error travels with the writers' token; parallel HDF5 (mpio): the
    failing rank aborts the job, after one plain line (no h5py traceback)."""
    script = tmp_path / "no_check.py"
    script.write_text(NO_CHECK)
    code, out, err = _launch(tmp_path, "make-data", small_disk / "big.h5", *BIG, script=script)
    assert code == 1, out + err  # not 139 (SIGSEGV) nor a Hydra "BAD TERMINATION"
    lines = [ln for ln in err.splitlines() if ln.startswith("mpiattn")]  # (not the launcher's own lines)
    assert len(lines) == 1 and "disk filled up while writing" in lines[0], err
    assert "BAD TERMINATION" not in out
    assert os.listdir(small_disk) == []


def test_a_full_disk_holding_the_job_log_too_still_ends_cleanly(small_disk, tmp_path):
    """Issue 26 item 11: prefill's cache fills the disk that also holds the job's log. The
    temporary is removed before anything is printed, so the one message reaches the log (no h5py
    release reports first), the exit code is 1 (not Hydra's 255), and nothing is left behind."""
    script = tmp_path / "no_check.py"
    script.write_text(NO_CHECK)
    code, _, _ = _launch(tmp_path, "make-data", tmp_path / "in.h5", "--seq", "30000", "--heads",
                         "4", "--dim", "32", "-q")
    assert code == 0
    (small_disk / "fill").write_bytes(b"\0" * (1 << 20))
    log = small_disk / "log"
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", OMP_NUM_THREADS="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    with open(log, "w") as f:
        code = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), "prefill",
                               str(tmp_path / "in.h5"), "-o", str(small_disk / "cache.h5"), "-q"],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=180).returncode
    text = log.read_text()
    assert code == 1, text
    said = [ln for ln in text.splitlines() if ln.startswith("mpiattn")]  # (not the launcher's)
    assert len(said) == 1 and "disk filled up while writing" in said[0], text
    assert "Exception ignored" not in text and "Traceback" not in text
    assert sorted(os.listdir(small_disk)) == ["fill", "log"]


def _prefilled_cache(tmp_path, cache, seq):
    """make-data of ``seq`` prompt rows and one new token in tmp_path, prefilled into ``cache``."""
    small = ["--heads", "4", "--dim", "32", "-q"]
    for name, rows in (("prompt.h5", seq), ("new.h5", 1)):
        code, out, err = _launch(tmp_path, "make-data", tmp_path / name, "--seq", rows, *small)
        assert code == 0, out + err
    code, out, err = _launch(tmp_path, "prefill", tmp_path / "prompt.h5", "-o", cache, "-q")
    assert code == 0, out + err


def _append(tmp_path, cache, out):
    return _launch(tmp_path, "decode", cache, "--queries", tmp_path / "new.h5", "-o", out,
                   "--append", "-q")


def test_an_append_with_room_for_its_output_but_not_the_cache_does_nothing(small_disk, tmp_path):
    """Issue 26 item 5: the output (a few KiB) fits, the grown cache (about 10 MiB beside the
    10 MiB one it replaces, on a 20 MiB disk) does not: refused before any work, nothing written."""
    cache = small_disk / "cache.h5"
    _prefilled_cache(tmp_path, cache, 7000)
    before = open(cache, "rb").read()
    code, out, err = _append(tmp_path, cache, small_disk / "out.h5")
    assert code == 1, out + err
    assert err.count("mpiattn: error:") == 1 and "not enough free space" in err, err
    assert sorted(os.listdir(small_disk)) == ["cache.h5"]
    assert open(cache, "rb").read() == before


def test_an_append_to_a_cache_in_a_read_only_directory_does_nothing(small_disk, tmp_path):
    """Issue 26 item 5: the cache's directory cannot be written (a read-only mount: root too):
    refused before any work, no output published elsewhere."""
    cache = small_disk / "cache.h5"
    _prefilled_cache(tmp_path, cache, 500)
    before = open(cache, "rb").read()
    p = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {p.stderr.strip()}")
    code, out, err = _append(tmp_path, cache, tmp_path / "out.h5")
    assert code == 1, out + err
    assert err.count("mpiattn: error:") == 1, err
    assert not (tmp_path / "out.h5").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.h5")]
    assert open(cache, "rb").read() == before
