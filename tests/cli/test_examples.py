"""examples/train_retrieval.py runs as examples/README.md says, at 1 and 2 ranks, with the same
loss curve (the README: it does not depend on the number of ranks, up to rounding)."""

import os
import sys

import numpy as np

from helpers import mpiexec, run_group

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_retrieval.py")
SMALL = ["--seq-len", "256", "--copies", "4", "--queries", "32", "--noise-tokens", "16",
         "--steps", "3", "--dtype", "float64"]


def test_the_retrieval_example_learns_the_same_at_one_and_two_ranks(serial_only, tmp_path):
    curves = []
    for P in (1, 2):
        history = tmp_path / f"loss_P{P}.txt"
        cmd = [sys.executable, EXAMPLE, *SMALL, "--history", str(history)]
        code, out, err = run_group(([mpiexec(), "-n", str(P)] if P > 1 else []) + cmd, 120,
                                   cwd=tmp_path)
        assert code == 0, err
        assert "done: loss" in out
        curves.append(np.loadtxt(history))
    assert curves[0].shape == (3, 3)
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-12, atol=1e-12)
