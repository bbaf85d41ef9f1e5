#!/usr/bin/env python
"""Run the whole test suite: once in one process, then under mpiexec with 2, 3, 4 ranks.

Usage: ``python tests/run_all.py [--ranks 1,2,3,4] [--mpiexec-args "FLAGS"] [extra pytest args]``
(``--mpiexec-args`` defaults to ``$MPIATTN_TEST_MPIEXEC_ARGS``, e.g. ``"--oversubscribe"`` for Open MPI).

Each run gets a wall-clock limit so a deadlock fails instead of hanging (each
test also has pytest-timeout's thread-method limit). Ranks other than 0 log to
``tests/.ranklogs/<P>/rank<R>.log``; those logs are printed when a run fails.
The last line sums up all runs as ``N passed, N failed, N skipped``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_LIMIT_S = 1500


def find_mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else (shutil.which("mpiexec") or "mpiexec")


def mpi_library() -> str:
    """The version string of the MPI library mpi4py loads here ('' if it cannot be told); MPI stays uninitialised."""
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
            "from mpi4py import MPI; print(MPI.Get_library_version().strip().splitlines()[0])")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return proc.stdout.replace("\0", "").strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def summary_counts(text: str) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)", ln)]
    if lines:
        for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
            counts["error" if word.startswith("error") else word] += int(num)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,3,4", help="comma-separated rank counts (default 1,2,3,4)")
    ap.add_argument("--mpiexec-args", default=os.environ.get("MPIATTN_TEST_MPIEXEC_ARGS", ""),
                    help="extra launcher flags, one string (default $MPIATTN_TEST_MPIEXEC_ARGS)")
    args, extra = ap.parse_known_args()
    env = dict(os.environ)
    library = mpi_library()
    print(f"=== MPI library: {library or 'unknown'}", flush=True)
    if "MPICH" in library.upper():
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")  # MPICH: waiting ranks yield their core
    elif "OPEN MPI" in library.upper():
        env.setdefault("OMPI_MCA_btl", "self,sm")  # one node: no ~1 s probe of network transports per start
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # waiting ranks yield their core
    # every collective of every Comm (the suite's and the jobs it launches) first compares its
    # call site across the ranks (mpiattn.comm.discipline): a mismatch fails, not hangs
    env.setdefault("MPIATTN_CHECK_COLLECTIVES", "120")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Bytecode is written (where the checkout is writable): the first session compiles the
    # library and pytest rewrites the test modules once, and the later sessions, their ranks
    # and the hundreds of jobs the tests launch read them (with PYTHONDONTWRITEBYTECODE set
    # each of those compiled everything again: about 0.07 s a launch, 3-5 s a session)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    total = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    bad = []
    # data the sessions share (the contract suite's references: the same at every rank count)
    cache = tempfile.mkdtemp(prefix="mpiattn-test-cache-")
    env["MPIATTN_TEST_CACHE_DIR"] = cache
    try:
        _sessions(args, extra, env, total, bad)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    failed = total["failed"] + total["error"]
    print(f"{total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    if bad:
        print(f"runs that failed: {', '.join(f'{p} ranks' for p in bad)}")
    return 1 if (bad or failed) else 0


def _sessions(args, extra, env, total, bad):
    """One pytest session per rank count, each summed into ``total``; failed ones into ``bad``."""
    for p in [int(x) for x in args.ranks.split(",")]:
        logdir = os.path.join(HERE, ".ranklogs", str(p))
        shutil.rmtree(logdir, ignore_errors=True)
        env["MPIATTN_TEST_RANKLOG_DIR"] = logdir
        args_ = [HERE, "--with-mpi", "-q", "-rfEs" if p == 1 else "-rfE", *extra]
        if p == 1:
            cmd = [sys.executable, "-m", "pytest", *args_]
        else:
            cmd = [find_mpiexec(), *shlex.split(args.mpiexec_args), "-n", str(p),
                   sys.executable, os.path.join(HERE, "_rank_main.py"), *args_]
        print(f"=== {p} rank(s): {' '.join(cmd)}", flush=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=RUN_LIMIT_S)
            out, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            out += f"\n*** {p}-rank run exceeded {RUN_LIMIT_S} s and was killed\n"
            rc = -1
        sys.stdout.write(out)
        counts = summary_counts(out)
        # 5 is pytest's "no tests ran" (every test deselected or skipped at this rank count), and
        # also MPI_ERR_COMM, the code of a job Open MPI aborts on a freed communicator, after tests
        # ran: only the first passes
        ok = rc == 0 or (rc == 5 and counts["passed"] + counts["failed"] + counts["error"] == 0)
        if not ok and counts["failed"] + counts["error"] == 0:
            counts["error"] += 1  # crashed or timed out without a pytest summary
        if not ok:
            bad.append(p)
            for name in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []:
                print(f"--- {p} ranks, {name}:")
                with open(os.path.join(logdir, name)) as fh:
                    print(fh.read()[-20000:])
        for key in total:
            total[key] += counts[key]
        print(f"=== {p} rank(s) done in {time.time() - t0:.0f} s, exit code {rc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
