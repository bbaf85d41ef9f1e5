"""``--check``: how a distributed result is compared with the float64 reference.

The reference is the library's one dense attention
(:func:`mpiattn.kernels.reference.dense_attention`, in float64 on the
gathered arrays); :func:`check_errors` measures each result against it with
an error that stays sound where the exact result is about 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_errors"]


def _row_norm(x: np.ndarray) -> float:
    """The largest 2-norm of a row (last axis) of ``x``; 0 for an empty array."""
    return float(np.sqrt(np.square(x, dtype=np.float64).sum(axis=-1)).max(initial=0.0))


def _largest(x: np.ndarray) -> float:
    return float(np.abs(x, dtype=np.float64).max(initial=0.0))


def check_errors(got: dict, ref: Any, q: Any, k: Any, v: Any, dout: Any = None,
                 scale: float | None = None) -> dict[str, float]:
    """The error of each result in ``got`` against the exact one, scaled by the operands.

    ``error = max |x - x_exact| / a`` over the finite entries (``inf`` when
    the infinities differ), where ``a`` is the larger of ``max |x_exact|``
    and a bound that the operands' magnitudes set on ``x`` (``|q|``, ``|k|``,
    ``|v|``, ``|dout|`` the largest rows' 2-norms, ``s`` the scale)::

        out  max|v|             (each row is an average of rows of v)
        lse  1 + |s| |q| |k|    (|s q.k| bounds each score)
        dv   max|dout|          (sum_i P_ij dout_i, sum_i P_ij ~ 1)
        dq   |s| |dout| |v| max|k|      dk   |s| |dout| |v| max|q|
        dsinks  |dout| |v|      (each row's D = dout . out; exp(sink - lse) <= 1)

    So an exact result near 0 (e.g. ``dq`` of a row whose softmax is
    one-hot) is judged by the rounding its operands allow, not divided by
    its own tiny magnitude, as in the test suite's rule.

    Parameters
    ----------
    got : dict
        Name (``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dsinks``) -> the computed global array.
    ref : mpiattn.kernels.reference.Exact
    q, k, v, dout : global arrays (``dout`` needed for the gradients)
    scale : float, optional
        Default ``1/sqrt(E)``.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    s = abs(1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))
    qn, kn, vn = _row_norm(q), _row_norm(k), _row_norm(v)
    dn = 0.0 if dout is None else _row_norm(np.asarray(dout))
    bound = {"out": _largest(v), "lse": 1.0 + s * qn * kn,
             "dv": 0.0 if dout is None else _largest(dout),
             "dq": s * dn * vn * _largest(k), "dk": s * dn * vn * _largest(q), "dsinks": dn * vn}
    errors = {}
    for name, x in got.items():
        want = getattr(ref, name)
        x = np.asarray(x, dtype=np.float64)
        fin = np.isfinite(want)
        if not np.array_equal(fin, np.isfinite(x)) or not np.array_equal(x[~fin], want[~fin]):
            errors[name] = math.inf
            continue
        a = max(_largest(want[fin]), bound[name], 1e-300)
        errors[name] = float(np.abs(x[fin] - want[fin]).max(initial=0.0)) / a
    return errors
