"""The README's PyTorch example as written (N made small), under mpiexec -n 2."""

import os
import re
import sys

import pytest

from helpers import mpiexec, run_group

pytest.importorskip("torch")

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def test_torch_example_prints_its_result(serial_only, tmp_path):
    with open(README) as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), re.S)
    code = next(b for b in blocks if "mpiattn.torch" in b)
    small = code.replace("B, N, E = 1, 8192, 256", "B, N, E = 1, 37, 16")
    assert small != code
    script = tmp_path / "script.py"
    script.write_text(small)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    rc, out, err = run_group([mpiexec(), "-n", "2", sys.executable, str(script)], 180,
                             cwd=tmp_path, env=env)
    assert rc == 0, err
    assert out.splitlines() == ["y (1, 37, 16), dL/dWq (16, 16), identical on every rank: True"]
