"""Entry point for one rank of an MPI test run (used by ``tests/run_all.py``).

Ranks other than 0 send their output to ``$MPIATTN_TEST_RANKLOG_DIR/rank<R>.log``
before pytest starts, so the console carries rank 0's report only.
"""

import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
logdir = os.environ.get("MPIATTN_TEST_RANKLOG_DIR")
if logdir and rank > 0:
    os.makedirs(logdir, exist_ok=True)
    fd = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)

# Each rank its own pytest temp root: ranks of one job (and other sessions) share the machine,
# and pytest's cleanup of old temp directories races between concurrent sessions.
if "PYTEST_DEBUG_TEMPROOT" not in os.environ:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    os.environ["PYTEST_DEBUG_TEMPROOT"] = tempfile.mkdtemp(prefix=f"mpiattn-pytest-rank{rank}-")
    atexit.register(shutil.rmtree, os.environ["PYTEST_DEBUG_TEMPROOT"], True)

import pytest  # noqa: E402 - after the redirection

sys.exit(pytest.main(sys.argv[1:]))
