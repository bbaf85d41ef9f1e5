"""``--check``: exact single-process float64 attention and its gradients.

Plain NumPy on *global* arrays, with the score matrix materialised one block
of query rows at a time. It is deliberately simple (no online softmax, no
folding of heads, no MPI) so it can check the distributed code independently:
``--check`` in the CLI and the tests compare against it.

Conventions (those of :func:`mpiattn.attention`): query head ``h`` uses
key/value head ``h // (H // Hkv)``; ``causal`` lets query ``i`` see key ``j``
iff ``j <= i``; ``window = (left, right)`` hides keys outside
``i - left <= j <= i + right`` (None: unbounded side); document ids hide keys
of another document; ``key_padding_mask[b, j]`` True hides key ``j``; a query
that sees no key gets ``out = 0``, ``lse = -inf`` and zero gradients.

Math, per batch ``b`` and query head ``h`` (``s`` the scale)::

    S = s Q K^T (masked -> -inf);  lse = log sum_j exp S;  P = exp(S - lse)
    O = P V
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dP * P))
    dQ = s dS K;  dK = s dS^T Q
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Exact", "exact_attention", "exact_nbytes", "check_errors"]


class Exact(NamedTuple):
    """Exact results, all float64 NumPy arrays.

    Attributes
    ----------
    out : (B, H, N, Ev)
    lse : (B, H, N)
    dq, dk, dv : (B, H, N, E), (B, Hkv, M, E), (B, Hkv, M, Ev), or None without ``dout``
    """

    out: np.ndarray
    lse: np.ndarray
    dq: np.ndarray | None
    dk: np.ndarray | None
    dv: np.ndarray | None


def exact_nbytes(q_shape: tuple, k_shape: tuple, v_shape: tuple, block_rows: int = 256) -> int:
    """Rough peak memory (bytes) of :func:`exact_attention` for global shapes ``q``, ``k``, ``v``.

    Counts the float64 copies of the inputs, the outputs with gradients, and
    a few ``block_rows x M`` score blocks.
    """
    B, H, N, E = q_shape
    _, hkv, M, Ev = v_shape
    words = 3 * B * H * N * (E + Ev) + 3 * B * hkv * M * (E + Ev) + 6 * min(N, block_rows) * M
    return 8 * int(words)


def exact_attention(q: Any, k: Any, v: Any, dout: Any = None, *, causal: bool = False,
              scale: float | None = None, key_padding_mask: Any = None,
              block_rows: int = 256, window: tuple | None = None, segment_ids: Any = None,
              kv_segment_ids: Any = None) -> Exact:
    """Exact attention (and, with ``dout``, its gradients) in float64 on one process.

    Parameters
    ----------
    q : array_like, shape (B, H, N, E)
    k : array_like, shape (B, Hkv, M, E)
    v : array_like, shape (B, Hkv, M, Ev)
    dout : array_like, shape (B, H, N, Ev), optional
        Gradient of the loss with respect to ``out``; when given the
        gradients ``dq``, ``dk``, ``dv`` are computed too.
    causal : bool
        Query ``i`` sees key ``j`` only when ``j <= i``.
    scale : float, optional
        Softmax scale ``s``; default ``1/sqrt(E)``.
    key_padding_mask : array_like of bool, shape (B, M), optional
        True marks a key to ignore.
    window : (left, right), optional
        Query ``i`` sees only keys ``i - left <= j <= i + right``.
    segment_ids, kv_segment_ids : integer array_like, shapes (B, N), (B, M), optional
        Document ids of queries and keys (keys default to the query ids).
    block_rows : int
        Query rows per materialised score block (bounds memory).

    Returns
    -------
    Exact
        ``out`` (B, H, N, Ev), ``lse`` (B, H, N) and the gradients, float64.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, N, E = q.shape
    hkv, M, Ev = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (B, hkv, M, E) or v.shape[:3] != (B, hkv, M) or H % max(hkv, 1):
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    s = 1.0 / math.sqrt(E) if scale is None else float(scale)
    group = H // hkv if hkv else 1
    hidden = np.zeros((B, M), dtype=bool) if key_padding_mask is None else np.asarray(key_padding_mask, bool)
    if hidden.shape != (B, M):
        raise ValueError(f"key_padding_mask has shape {hidden.shape}, expected {(B, M)}")
    grads = dout is not None
    if grads:
        dout = np.asarray(dout, dtype=np.float64)
        if dout.shape != (B, H, N, Ev):
            raise ValueError(f"dout has shape {dout.shape}, expected {(B, H, N, Ev)}")

    out = np.zeros((B, H, N, Ev))
    lse = np.full((B, H, N), -np.inf)
    dq = np.zeros_like(q) if grads else None
    dk = np.zeros_like(k) if grads else None
    dv = np.zeros_like(v) if grads else None
    key_pos = np.arange(M)
    for i0 in range(0, N, max(1, block_rows)):
        i1 = min(N, i0 + max(1, block_rows))
        hide = np.broadcast_to(hidden[:, None, :], (B, i1 - i0, M))
        rows = np.arange(i0, i1)[None, :, None]
        if causal:
            hide = hide | (key_pos[None, None, :] > rows)
        if window is not None and window[0] is not None:
            hide = hide | (key_pos[None, None, :] < rows - window[0])
        if window is not None and window[1] is not None:
            hide = hide | (key_pos[None, None, :] > rows + window[1])
        if segment_ids is not None:
            kseg = segment_ids if kv_segment_ids is None else kv_segment_ids
            hide = hide | (np.asarray(segment_ids)[:, i0:i1, None] != np.asarray(kseg)[:, None, :])
        for b in range(B):
            for h in range(H):
                kv = h // group
                S = s * (q[b, h, i0:i1] @ k[b, kv].T)
                S[hide[b]] = -np.inf
                row_max = S.max(axis=1, initial=-np.inf)
                seen = np.isfinite(row_max)
                P = np.zeros_like(S)
                P[seen] = np.exp(S[seen] - row_max[seen, None])
                denom = P.sum(axis=1)
                P[seen] /= denom[seen, None]
                lse[b, h, i0:i1][seen] = row_max[seen] + np.log(denom[seen])
                out[b, h, i0:i1] = P @ v[b, kv]
                if grads:
                    dO = dout[b, h, i0:i1]
                    dv[b, kv] += P.T @ dO
                    dP = dO @ v[b, kv].T
                    dS = P * (dP - (dP * P).sum(axis=1, keepdims=True))
                    dq[b, h, i0:i1] = s * (dS @ k[b, kv])
                    dk[b, kv] += s * (dS.T @ q[b, h, i0:i1])
    return Exact(out, lse, dq, dk, dv)


def _row_norm(x: np.ndarray) -> float:
    """The largest 2-norm of a row (last axis) of ``x``; 0 for an empty array."""
    return float(np.sqrt(np.square(x, dtype=np.float64).sum(axis=-1)).max(initial=0.0))


def _largest(x: np.ndarray) -> float:
    return float(np.abs(x, dtype=np.float64).max(initial=0.0))


def check_errors(got: dict, ref: Exact, q: Any, k: Any, v: Any, dout: Any = None,
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

    So an exact result near 0 (e.g. ``dq`` of a row whose softmax is
    one-hot) is judged by the rounding its operands allow, not divided by
    its own tiny magnitude, as in the test suite's rule.

    Parameters
    ----------
    got : dict
        Name (``out``, ``lse``, ``dq``, ``dk``, ``dv``) -> the computed global array.
    ref : Exact
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
             "dq": s * dn * vn * _largest(k), "dk": s * dn * vn * _largest(q)}
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
