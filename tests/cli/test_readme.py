"""The README's examples as written: the Python example runs and prints its result.

Serial session only (launches ``mpiexec``). The example is taken from the
README verbatim, with only ``N`` made small.
"""

import os
import re
import sys

from helpers import mpiexec, run_group

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def _text():
    with open(README) as f:
        return f.read()


def test_python_example_prints_its_result(serial_only, tmp_path):
    code = re.search(r"```python\n(.*?)```", _text(), re.S).group(1)
    assert "gather(lse_r, axis=-1)" in code and "print(" in code
    small = code.replace("B, H, N, E = 1, 8, 8192, 64", "B, H, N, E = 1, 8, 96, 8")
    assert small != code
    script = tmp_path / "script.py"
    script.write_text(small)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    rc, out, err = run_group([mpiexec(), "-n", "2", sys.executable, str(script)], 120,
                             cwd=tmp_path, env=env)
    assert rc == 0, err
    assert out.splitlines() == ["out (1, 8, 96, 8), lse (1, 8, 96), dq (1, 8, 96, 8)",
                                "query 0 sees key 0 only, so out[..., 0, :] == v[..., 0, :]: True"]


def test_check_line_checks_the_same_computation_under_a_new_name():
    lines = [ln for ln in _text().splitlines() if "mpiattn run " in ln]
    plain = [ln for ln in lines if "--check" not in ln and ln.startswith("mpiexec")]
    checked = [ln for ln in lines if "--check" in ln]
    assert plain and checked
    for ln in checked:  # same input and flags as the plain run, another output, no --force
        assert "--causal" in ln and "--force" not in ln and "-o out.h5" not in ln
    assert "mpiattn-example-out.h5" in _text()
