"""The softcap's module (:mod:`mpiattn.masks.softcap`): its formula against float64 math, its
chain rule against finite differences, and that it is the one place a kernel's ``tanh`` is
written (the strategies and engines are checked through it by test_modifiers.py)."""

import ast
import math
import pathlib

import numpy as np
import pytest

import mpiattn
from mpiattn.masks import Modifiers
from mpiattn.masks.softcap import Softcap, check_softcap

PACKAGE = pathlib.Path(mpiattn.__file__).parent
#: the modules that may write tanh: the rule's own, and the references (which share no code
#: with what they check)
MAY_WRITE_TANH = {"masks/softcap.py", "kernels/reference.py"}


def _raw(dtype, seed=0):
    """Raw scores over [-40, 40], with exact zeros and values near the cap."""
    x = np.random.default_rng(seed).uniform(-40, 40, size=(2, 3, 17, 19)).astype(dtype)
    x[0, 0, 0, :3] = (0.0, 7.5, -7.5)
    return x


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-15), (np.float32, 5e-7)])
def test_the_scores_are_c_tanh_x_over_c(dtype, tol):
    c = 7.5
    x = _raw(dtype)
    want = np.vectorize(lambda v: c * math.tanh(float(v) / c))(x)
    y = Softcap(c).forward_(x.copy())
    assert y.dtype == dtype
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol * c)
    assert np.all(np.abs(y) <= c)
    kept = x.copy()
    y2 = Softcap(c).saving_(kept, out=np.empty_like(x))
    np.testing.assert_array_equal(y2, y)  # the two forwards agree bit for bit
    np.testing.assert_allclose(kept, np.tanh(x.astype(np.float64) / c), rtol=tol, atol=tol)


def test_the_chain_rule_matches_finite_differences():
    c, h = 3.0, 1e-6
    x = _raw(np.float64, seed=1) / 8
    f = Softcap(c)
    dS = np.random.default_rng(2).standard_normal(x.shape)
    numeric = dS * (f.forward_(x + h) - f.forward_(x - h)) / (2 * h)
    kept = x.copy()
    f.saving_(kept, out=np.empty_like(x))
    got = f.chain_(dS.copy(), kept)
    np.testing.assert_allclose(got, numeric, rtol=1e-7, atol=1e-9)


def test_a_float16_gradient_takes_a_float32_factor():
    """The CuPy kernels' mixed case: dS in the operands' dtype, the saved t in the accumulator's."""
    x = _raw(np.float32) / 10
    kept = x.copy()
    Softcap(2.0).saving_(kept, out=np.empty_like(x))
    dS = np.ones(x.shape, np.float16)
    got = Softcap(2.0).chain_(dS, kept)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, 1 - np.tanh(x.astype(np.float64) / 2) ** 2, rtol=1e-3, atol=1e-3)


def test_the_modifiers_hand_out_the_transform():
    assert Modifiers().transform is None
    assert Modifiers(softcap=4.0).transform == Softcap(4.0)
    assert check_softcap(None) is None and check_softcap(2) == 2.0
    for bad, err in ((0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (True, TypeError),
                     ("3", TypeError)):
        with pytest.raises(err):
            check_softcap(bad)


def tanh_calls(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that call or name ``tanh`` (``xp.tanh``, ``np.tanh``, ``torch.tanh``...)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted({n.lineno for n in ast.walk(tree)
                   if (isinstance(n, ast.Attribute) and n.attr == "tanh")
                   or (isinstance(n, ast.Name) and n.id == "tanh")})


def test_the_formula_is_written_in_one_module(tmp_path):
    found = {str(p.relative_to(PACKAGE)): tanh_calls(p) for p in PACKAGE.rglob("*.py")}
    elsewhere = {name: lines for name, lines in found.items() if lines and name not in MAY_WRITE_TANH}
    assert not elsewhere, f"tanh outside {sorted(MAY_WRITE_TANH)}: {elsewhere}"
    assert found["masks/softcap.py"]  # the scan sees the module's own calls
    probe = tmp_path / "m.py"
    probe.write_text("import numpy as np\nfrom math import tanh\ny = np.tanh(1)\nz = tanh(2)\n")
    assert tanh_calls(probe) == [3, 4]
